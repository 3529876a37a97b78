"""Model acquisition: everything that gets a model's weights and tokenizer onto this machine
and into MLX. This package imports nothing; import from its modules:

    loading         resolve a model spec, load it through mlx_lm.load, fingerprint it
    tiny            the offline random-weight tiny models (``tiny:<name>`` specs)
    packaged        models shipped as Python packages (``gemma3-270m``)
    gguf            convert a GGUF file into an mlx-lm model directory
    gguf_tokenizer  the GGUF file's tokenizer, as a Hugging Face tokenizer
    blas            the system OpenBLAS for MLX's CPU matmuls (loaded before mlx)
"""
