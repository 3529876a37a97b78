"""Agents' KV caches: in memory (the hot tier) and on disk, paged into content-addressed
blocks shared between agents.

Layout under the cache root::

    <agent id>/<messages>-<hex>.safetensors     the agent's tail (format 3 or 2; format 1: a whole
                                                cache, still read, replaced at the next save)
    _blocks/<key[:2]>/<key>-<n>.safetensors     a segment: n consecutive blocks, the last one
                                                ``key``, written by one save (a block is the
                                                global-attention layers' keys and values of
                                                ``block_tokens`` tokens)
    _blocks/<key[:2]>/<key>.window.safetensors  optional: the sliding-window layers' state at
                                                block ``key``'s end (a new cache can start there)
    _blocks/<key[:2]>/<key>.safetensors         one block (written before segments; still read)

A block's key is a hash chain (XXH3-128) over the model, the storage settings and every token
up to the block's end, so caches whose tokens start alike list the same keys and share the
files; a segment's name says its content (its last key fixes every token before it). The
registry records where each block is (``kv_blocks``) and lists each agent's blocks
(``kv_cache_blocks``). A segment none of whose blocks an agent lists is garbage and is
collected after saves and deletions, except while a turn that stored it as a shared prefix
still runs (it is pinned). Segments keep a resume to a few files (one per save that added
blocks, plus the tail) however small the blocks.

One noun a module: ``layout`` (paths, names, block keys), ``writes`` (the writer thread and
the writes in flight), ``save``, ``load`` (and verification), ``janitor`` (garbage
collection, pins, the disk budget, the sweep), ``prefixes`` (shared prefixes and heads),
``stats`` (``DiskStats``), ``shared`` (what the parts share), and ``disk``, the disk's front
(``DiskCaches``); ``hot`` (``HotTier``: recently used caches in memory, under a byte budget)
and ``tiers`` (``CacheTiers``: both tiers as one, what the runtime and its turns hold).
"""

from agentkv.caches.disk import DiskCaches
from agentkv.caches.layout import BLOCKS_DIR, chain_keys
from agentkv.caches.load import LoadedCache, StaleCacheError
from agentkv.caches.stats import DiskStats

__all__ = ["BLOCKS_DIR", "DiskCaches", "DiskStats", "LoadedCache", "StaleCacheError", "chain_keys"]
