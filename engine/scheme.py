"""How a layer's keys and values are quantized, decided once for the batch and the cache files
alike (:func:`layer_scheme`): a file whose layer has the batch's scheme joins the batch as it
is stored, without being expanded and quantized again.

- **q8**: keys and values per position in groups of the layer's group size; keys rotated by
  ``agentkv.engine.codes.hadamard`` first where the key head size is a power of two (attention
  rotates the query alike).
- **q4**: values per position, rotated, and keys per channel over
  :data:`~engine.config.KEY_GROUP_SIZE` positions at :data:`~engine.config.KEY_BITS` bits
  (KIVI: a few channels are far larger than the rest) where the key head size is a whole
  number of key groups and the value head size a power of two; keys per position where the
  positions are not stored in order (a window that keeps its first positions) or a stored
  block holds part of a key group; keys and values per position, not rotated, elsewhere.
- a layer whose head sizes no group size divides stays in the model's precision (None).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from agentkv.engine.config import GROUP_SIZES, KEY_BITS, KEY_GROUP_SIZE, choose_group_size

log = logging.getLogger(__name__)
FLAGS = ("channel_keys", "rotated_values", "rotated_keys")
"""The flags of a layer's scheme, as a cache file's layout names them."""
_warned: set[tuple[int, int]] = set()


@dataclass(frozen=True, slots=True)
class LayerScheme:
    """A quantized layer's scheme: its bits and group size (values, and keys per position),
    and the flags (see the module docstring)."""

    bits: int
    group_size: int
    rotated_keys: bool = False
    channel_keys: bool = False
    rotated_values: bool = False

    @property
    def key_group(self) -> int:
        """The keys' group: :data:`KEY_GROUP_SIZE` positions per channel, else positions'
        groups of :attr:`group_size` channels."""
        return KEY_GROUP_SIZE if self.channel_keys else self.group_size

    @property
    def key_bits(self) -> int:
        return KEY_BITS if self.channel_keys else self.bits

    def flags(self) -> dict[str, bool | int]:
        """The scheme's fields as a cache file's layout names them (only those set)."""
        fields: dict[str, bool | int] = {}
        if self.channel_keys:
            fields |= {"channel_keys": True, "key_group_size": KEY_GROUP_SIZE, "key_bits": KEY_BITS}
        if self.rotated_values:
            fields["rotated_values"] = True
        if self.rotated_keys:
            fields["rotated_keys"] = True
        return fields

    @classmethod
    def stored(cls, bits: int, group_size: int, layout: dict[str, Any]) -> LayerScheme:
        """The scheme a cache file's layer ``layout`` names."""
        return cls(bits, group_size, **{f: bool(layout.get(f)) for f in FLAGS})


def layer_scheme(
    bits: int | None,
    group_size: int | None,
    dims: tuple[int, int],
    block_tokens: int | None = None,
    keep: int | None = None,
) -> LayerScheme | None:
    """The scheme of a layer of (key, value) head sizes ``dims`` quantized at ``bits`` in
    groups of ``group_size`` (or, where it does not divide them or is None, the first of
    ``agentkv.engine.config.FALLBACK_GROUP_SIZES`` that does), stored in blocks of ``block_tokens``
    (None: not paged) from a window that keeps its first ``keep`` positions; None where it is
    held in the model's precision (``bits`` None, or no group size divides its heads: logged
    once per head size)."""
    if bits is None:
        return None
    key_dim, value_dim = dims
    # A group size divides both head sizes exactly when it divides their gcd.
    group = choose_group_size(math.gcd(key_dim, value_dim), group_size)
    if group is None:
        _warn_unquantized(key_dim, value_dim)
        return None
    if bits == 8:
        return LayerScheme(8, group, rotated_keys=_power_of_two(key_dim))
    # The batch holds a q4 layer either so (keys per channel, values rotated) or plainly; a
    # file also where its positions cannot be grouped per channel (a window that keeps its
    # first positions, blocks of partial key groups): values rotated, keys per position.
    rotated_values = _power_of_two(value_dim) and key_dim % KEY_GROUP_SIZE == 0
    blocks_whole = block_tokens is None or block_tokens % KEY_GROUP_SIZE == 0
    channel = rotated_values and blocks_whole and not keep
    return LayerScheme(bits, group, channel_keys=channel, rotated_values=rotated_values)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _warn_unquantized(key_dim: int, value_dim: int) -> None:
    if (key_dim, value_dim) not in _warned:
        _warned.add((key_dim, value_dim))
        log.warning(
            "KV head size %d/%d is not divisible by any quantization group size %s; such "
            "layers stay in the model's precision (in the batch and in cache files)",
            key_dim,
            value_dim,
            GROUP_SIZES,
        )
