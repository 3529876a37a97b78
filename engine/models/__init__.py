"""A model as the engine holds it. This package imports nothing; import from its modules:

    loading  a spec's directory loaded through mlx_lm.load (LoadedModel)
    caches   the kinds of cache a model keeps (attention, sliding window, recurrent state)
    o200k    the o200k vocabulary a gpt-oss tokenizer lacks (harmony's token ids)

Getting a model onto this machine (tiny models, packaged ones, the hub, GGUF) is
``agentkv.models``.
"""
