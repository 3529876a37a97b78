"""Ragged attention: one forward pass over many sequences of different lengths, no padding
between them.

mlx-lm's models take a ``(B, L)`` token array and hand every layer one cache object. agentkv
feeds each step as ``T`` rows of one token (``L = 1``): the decode tokens of every running
sequence and the prefill chunks of joining ones, a chunk laid out one token per row. Every
linear layer, norm and MLP works per token, so this changes nothing for them, and each row's
rotary position comes from the cache's per-row ``offset``.

Each layer gets a :class:`StepCache`: a view that routes row ranges (:class:`Span`) to the
group caches that own them (see ``engine.batch``). A decode span is ``B`` rows of ``B``
sequences sharing one padded group buffer; a prefill span is ``c`` rows of one sequence, which
attend as a ``(1, H, c, D)`` block with a causal mask. Attention therefore runs once per span
over exactly that span's keys, and the model's own code does the rest.

The only hook is ``scaled_dot_product_attention``: every mlx-lm model imports it from
``mlx_lm.models.base`` by name, so :func:`install` points that name, in the model's own
modules, at :func:`ragged_attention`, which hands any other cache straight to mlx-lm's function.

On MLX's CPU backend, decode spans (one query per row) of float layers attend through
:func:`decode_attention`,
the same math as two matmuls over the key-value head groups, which MLX's CPU backend runs
faster than ``mx.fast.scaled_dot_product_attention`` over a long history (``bench_mixed``:
what a long agent costs the others).

A quantized layer (``engine.batch``: q8 per position, q4 keys per channel and values
rotated, each with its newest positions in float) hands attention a
:class:`~engine.batch.held.HeldQuantized`, which :func:`quantized_attention` reads without
expanding the quantized keys (``bench_batch_kv`` measures its working set and time against
expanding them). On a CPU, where MLX's quantized matmul runs one scalar loop per output, a
prompt's chunk (:data:`EXPANDED_ROWS` query rows a key-value head or more) expands the words
it reads for one float matmul instead (``bench_batch_kv`` times a chunk both ways). On every
backend a q8 chunk attends :data:`SCORES_BYTES` of scores at a time, a block of its queries
after another, so its working set does not grow with chunk size times history.

This package imports nothing; import from its modules."""
