"""Model tooling: everything that gets a model's weights and tokenizer onto this machine, below
the engine that loads them (``agentkv.engine.models.loading``). This package imports nothing;
import from its modules:

    directory       the directory a model spec names, and its fingerprint
    tiny            the offline random-weight tiny models (``tiny:<name>`` specs)
    packaged        models shipped as Python packages (``gemma3-270m``)
    hub             Hugging Face ids, from the local cache or downloaded
    gguf            convert a GGUF file into an mlx-lm model directory
    gguf_tokenizer  the GGUF file's tokenizer, as a Hugging Face tokenizer
    chat_formats    the chat templates tiny and converted models are written with
    blas            the system OpenBLAS for MLX's CPU matmuls (loaded before mlx)
"""
