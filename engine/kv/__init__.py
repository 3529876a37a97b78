"""KV caches as files: per-agent caches to host-memory arrays plus metadata, and back.

One noun a module; import from the module (this package imports nothing, so
``agentkv.engine.kv.encoded`` stays free of MLX):

    encoded     EncodedCache, format versions, quantization group sizes (numpy only)
    layouts     each layer's description in a file's metadata, read and checked
    quant       quantizing keys and values, and expanding them (numpy or MLX)
    whole       format 1: a whole cache in one file (encode, decode)
    paged       formats 2 and 3: blocks, segments and a tail (encode, split)
    assemble    a tail and its blocks checked and joined in numpy (any thread)
    load        a tail and its blocks loaded straight into MLX (the generation thread)
"""
