"""The batch's KV memory: length groups, what they hold, and what a turn will need.

mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache`` left-pad every sequence to the longest
one. agentkv keeps them, but per *group*: sequences of similar length share one padded buffer
per layer, and attention runs once per group (``agentkv.engine.attention``). A sequence joins the
group where it adds the least padding, and only while the group's padded size stays within
``PADDING_TOLERANCE`` of what its sequences own; otherwise it starts a group of its own. So the
batch holds about the sum of its sequences' histories, not batch size × the longest.

The buffers themselves are in ``agentkv.engine.batch``; with ``batch_kv_bits`` they hold their
keys and values quantized (global and sliding-window layers alike).

The batch's per-layer buffers: mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache``, growing
by :func:`growth` (see ``agentkv.engine.batch`` for the groups that hold them), and quantized KV
inside the running batch (``EngineConfig.batch_kv_bits``).

Buffers grow by ``growth(size)`` tokens (at least ``MIN_GROWTH``, else 1/16 of the size) instead
of mlx-lm's fixed 256, so a few hundred short sequences do not each carry 256 empty positions.

**q8** (:class:`GroupQuantizedKVCache`, :class:`GroupQuantizedRotatingKVCache`): each
position's keys and values ``mx.quantize``d, its words, float16 scales and float16 biases
packed into one uint32 row (:func:`packed`), keys rotated first by :func:`hadamard` (a
power-of-two head size: ``LayerScheme.rotated_keys``; attention rotates the query alike). That is
exactly what a q8 cache file stores (``agentkv.engine.kv``: keys rotated, cast to float16, then
quantized), so a row read from a q8 file of the same group size (its keys rotated) joins the
batch without a dequantize, and a finished row is stored and held in the hot tier as the batch
held it: the bytes never drift across resumes. mlx-lm's batch caches only move positions along
one axis (grow, rotate, pad, merge, extend, filter, extract, trim), so they run unchanged on
quantized words; a token's keys are quantized once, when written, and attention reads them
through ``mx.quantized_matmul`` as they are (``agentkv.engine.attention``; on a CPU a prompt's chunk
expands the positions it reads for one float matmul). A group buffer holds the
words and the words of their scales and biases in two such buffers moved alike
(:class:`QuantizedLayer`), so attention reads them whole, without a copy; rows come and go
packed. A row also keeps float
copies of its newest :data:`FLOAT_WINDOW` positions (:class:`QuantizedLayer`): each query
reads its own position and the :data:`FLOAT_WINDOW` before it from them instead of their
words, back to the last point a cache can start from (its fence: where the row joined, a
stored block's boundary, a shared head's end), so a position reads the same however it was
reached (and computes the same, to float32 rounding where a CPU's chunk sums in another
order than a decode step). Padding positions are zero words, scales and biases (they read
as 0 and are masked anyway).

**q4** (:class:`ChannelQuantizedKVCache`, :class:`ChannelQuantizedRotatingKVCache`): four
bits per position lose too much of the keys (a few channels are far larger than the rest), so
q4 holds them as a q4 cache file does: keys per channel over groups of
:data:`~engine.config.KEY_GROUP_SIZE` positions at :data:`~engine.config.KEY_BITS` bits (KIVI;
the group's scales spread over its positions' slots, so the packed rows keep per-position
shapes and mlx-lm's operations still move them), values rotated by :func:`hadamard` and
quantized to 4 bits per position in groups of the layer's group size, and the newest positions
(:data:`FLOAT_WINDOW` and the key group not yet whole) kept in float beside the buffer.
Attention scores the quantized keys as they are (each group's scales fold into the query) and
rotates its output back (``agentkv.engine.attention``).
A sliding window's ring holds one key group more than the window (:func:`ring_size`), so no
group loses a scale slot while one of its positions is in the window.

A row extracted from a group is a ``KVCache`` / ``RotatingKVCache`` of packed arrays, which
also carries ``recent``, its float positions (q8: and ``float_count``, how many it reads; a
finished q8 turn leaves them behind, ``agentkv.engine.loop``), and a q4 global layer's ``first_kv``,
its first position in float (a finished turn leaves it behind: the batch computes it again
from the first token); its :class:`Packing` says how to read it (:meth:`Packing.expand` gives
the float cache, from the words).

This package imports nothing; import from its modules."""
