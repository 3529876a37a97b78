"""Everything agentkv relies on in mlx-lm beyond its public API, behind one door.

agentkv drives mlx-lm's own model code and cache classes; a few things it needs are not part
of their public protocol. Each is here, named for what agentkv relies on, and
``tests/test_mlxlm_contract.py`` checks every one against the installed mlx-lm, so a release
that changes one fails there with a message naming it, not somewhere in the batch:

- a ``RotatingKVCache``'s positions in temporal order (``_temporal_order``) and where it
  writes next (``_idx``), to save a ring and rebuild it from its positions;
- a batch buffer's shared write position (``BatchKVCache._idx``, ``BatchRotatingKVCache._idx``
  and ``_offset``), which agentkv's buffers grow from and merge rows at;
- dropping a one-row batch buffer's newest positions after a multi-position update
  (:func:`drop_newest`: ``trim`` and, for a ring, its buffer cut to ``_idx``), a drafted
  step's rejected drafts;
- an object's class changed in place (``recast``): a batch buffer mlx-lm's ``merge`` made of
  its own class, a decoder layer given agentkv's span-by-span call;
- the attention hook: every mlx-lm model imports ``scaled_dot_product_attention`` from
  ``mlx_lm.models.base`` by name, and :func:`route_attention` points that name, in the
  model's own modules, at agentkv's step attention.

Nothing else in the project reads or writes an mlx-lm private name or patches mlx-lm
(``tests/test_layers.py`` checks the sources).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

T = TypeVar("T")

SDPA = base.scaled_dot_product_attention
"""mlx-lm's attention function, as its models import it (:func:`route_attention` points
them elsewhere)."""


# ---- caches ----------------------------------------------------------------------------------


def temporal_order(ring: RotatingKVCache, x: mx.array) -> mx.array:
    """A ring's keys or values (``x``: ``ring.keys`` or ``ring.values``) oldest first, its
    ``keep`` prefix first and unfilled slots of a larger buffer dropped."""
    return ring._temporal_order(x)


def write_index(cache: Any) -> int:
    """Where a ring (``RotatingKVCache``) or a batch buffer (``BatchKVCache``,
    ``BatchRotatingKVCache``) writes its next position: the columns its buffer uses."""
    return cache._idx


def set_write_index(cache: Any, index: int) -> None:
    """Make a ring or batch buffer write its next position at column ``index``: a ring rebuilt
    from positions in temporal order writes after its newest, ``keys.shape[2]``."""
    cache._idx = index


def ring_offset(buffer: Any) -> int:
    """A ``BatchRotatingKVCache``'s positions written so far, the same for every row (what its
    buffer grows from)."""
    return buffer._offset


def set_batch_extent(buffer: Any, columns: int) -> None:
    """A ``BatchRotatingKVCache`` built from rows left-padded to ``columns`` positions: it has
    written that many and writes next after them."""
    buffer._idx = buffer._offset = columns


def drop_newest(buffer: Any, n: int) -> None:
    """Drop the ``n`` newest positions of a one-row batch buffer whose last update wrote
    more than one position (a span of rows: a prompt's chunk, a drafted step): a
    ``BatchKVCache`` writes its next position where they began, a ``BatchRotatingKVCache``
    (in temporal order after such an update, its buffer as long as what it holds) holds
    what it held before them and that many more."""
    buffer.trim(n)
    if isinstance(buffer, BatchRotatingKVCache):
        buffer.keys = buffer.keys[..., : buffer._idx, :]
        buffer.values = buffer.values[..., : buffer._idx, :]


# ---- classes and hooks -----------------------------------------------------------------------


def recast(obj: Any, cls: type[T]) -> T:
    """``obj`` with its class changed in place to ``cls``, a subclass of its own class (or of
    the class it shares ``cls``'s mlx-lm base with) that adds behaviour, not state."""
    obj.__class__ = cls
    return obj


def route_attention(model: nn.Module, attention: Callable[..., mx.array]) -> int:
    """Point ``scaled_dot_product_attention`` in the modules of ``model``'s layers at
    ``attention`` (which falls back to :data:`SDPA` for what it does not handle).

    Returns:
        How many of those modules use it (0: the model has attention of its own, which the
        hook does not reach).
    """
    names = {type(m).__module__ for _, m in model.named_modules()}
    routed = 0
    for name in names:
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is SDPA:
            module.scaled_dot_product_attention = attention
        if current in (SDPA, attention):
            routed += 1
    return routed


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (``model.layers``, as mlx-lm's models list them)."""
    return [layer for layer in getattr(model, "layers", None) or () if isinstance(layer, nn.Module)]


class _Evaluated:
    """A linear layer's call (mixed in before its class) that evaluates its product."""

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = super().__call__(x, *args, **kwargs)  # type: ignore[misc]
        mx.eval(out)
        return out


_EVALUATED: dict[type, type] = {}


def evaluated_products(model: nn.Module) -> None:
    """Have ``model``'s linear layers (a vision tower's, on a thread beside the batch's)
    evaluate their products as they go. MLX's scheduler holds every thread's evaluation to a
    few tasks in flight between them: a whole tower evaluated at once would hold each of the
    batch's products behind one of the tower's (beside a 4 s tower on a CPU, not one token);
    one product at a time, the two threads take turns."""
    for _, module in model.named_modules():
        kind = type(module)
        if issubclass(kind, (nn.Linear, nn.QuantizedLinear)) and not issubclass(kind, _Evaluated):
            fields = {"__module__": kind.__module__}
            recast(
                module, _EVALUATED.setdefault(kind, type(kind.__name__, (_Evaluated, kind), fields))
            )
