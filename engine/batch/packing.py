"""How the packed layers of a cache hold their keys and values (:class:`Packing`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from agentkv.engine.batch.rows import channel_row, expanded_channel_row, is_packed, with_kv
from agentkv.engine.codes import (
    expand,
    packed,
    packed_dim,
    rotated_if,
    unpacked,
)
from agentkv.engine.scheme import LayerScheme


@dataclass(frozen=True, slots=True)
class Packing:
    """How the packed layers of a cache hold their keys and values (see
    :func:`~engine.codes.packed`).

    Attributes:
        bits: 8 or 4.
        schemes: per layer, its :class:`~engine.scheme.LayerScheme` (``layer_scheme``'s
            decision); None: the layer is held in ``dtype`` (no group size divides its heads).
            A q4 layer with keys per channel is held as :class:`ChannelQuantizedKVCache`
            holds it.
        dims: per layer, its (key, value) head sizes.
        dtype: the model's KV dtype, what :meth:`expand` gives back.
    """

    bits: int
    schemes: tuple[LayerScheme | None, ...]
    dims: tuple[tuple[int, int], ...]
    dtype: Any

    @property
    def group_sizes(self) -> tuple[int | None, ...]:
        """Per layer, its group size (None: not quantized)."""
        return tuple(None if s is None else s.group_size for s in self.schemes)

    def quantized(self, i: int) -> bool:
        """Whether layer ``i`` is held packed."""
        return self.schemes[i] is not None

    def channel_keys(self, i: int) -> bool:
        """Whether layer ``i`` is held as :class:`ChannelQuantizedKVCache` holds it (keys per
        channel, values rotated, the newest positions in float)."""
        scheme = self.schemes[i]
        return scheme is not None and scheme.channel_keys

    @property
    def any_channel(self) -> bool:
        return any(self.channel_keys(i) for i in range(len(self.schemes)))

    def key_group(self, i: int) -> int | None:
        """Layer ``i``'s keys' group size: :data:`KEY_GROUP_SIZE` positions per channel (q4),
        else its group size."""
        scheme = self.schemes[i]
        return None if scheme is None else scheme.key_group

    def group_of(self, i: int, kind: str) -> int | None:
        """Layer ``i``'s group size for its ``kind`` ("keys" or "values")."""
        return self.key_group(i) if kind == "keys" else self.group_sizes[i]

    def bits_of(self, i: int, kind: str) -> int:
        """The bits of layer ``i``'s ``kind`` ("keys" or "values"): q4's keys per channel at
        :data:`KEY_BITS`, else :attr:`bits`."""
        scheme = self.schemes[i]
        return scheme.key_bits if kind == "keys" and scheme is not None else self.bits

    def keys_rotated(self, i: int) -> bool:
        """Whether layer ``i`` holds its keys rotated by :func:`hadamard` (q8)."""
        scheme = self.schemes[i]
        return scheme is not None and scheme.rotated_keys

    def scheme(self, i: int) -> dict[str, bool | int]:
        """Layer ``i``'s layout fields as a cache file names them (``agentkv.engine.kv.quant``)."""
        scheme = self.schemes[i]
        return {} if scheme is None else scheme.flags()

    def packed_dims(self, i: int) -> tuple[int, int]:
        """Layer ``i``'s (key, value) words per head, packed."""
        dk, dv = self.dims[i]
        key_words = packed_dim(dk, self.bits_of(i, "keys"), self.key_group(i))  # type: ignore[arg-type]
        return key_words, packed_dim(dv, self.bits, self.group_sizes[i])  # type: ignore[arg-type]

    def pack(self, i: int, row: Any) -> Any:
        """Layer ``i``'s single-row cache packed (as it is when it is already)."""
        if is_packed(row):
            return row
        if self.channel_keys(i):
            return channel_row(row, self.group_sizes[i])
        rotated, bits, group = self.keys_rotated(i), self.bits, self.group_sizes[i]

        def pack(x: mx.array, kind: str) -> mx.array:
            return packed(rotated_if(x, rotated and kind == "keys"), bits, group)

        return with_kv(row, pack, "keys", "values")

    def parts(self, i: int, x: mx.array, kind: str) -> tuple[mx.array, mx.array, mx.array]:
        """Layer ``i``'s packed keys (``kind`` "keys") or values as (words, float16 scales,
        float16 biases): what ``mx.quantize`` made of them, as a cache file stores it."""
        dim = self.dims[i][0 if kind == "keys" else 1]
        return unpacked(x, dim, self.bits_of(i, kind), self.group_of(i, kind))

    def values(self, i: int, x: mx.array, kind: str) -> mx.array:
        """Layer ``i``'s packed keys (``kind`` "keys") or values in the model's dtype (keys
        held rotated rotated back)."""
        dim, group = self.dims[i][0 if kind == "keys" else 1], self.group_of(i, kind)
        bits = self.bits_of(i, kind)
        if kind == "keys" and self.keys_rotated(i):
            x = rotated_if(expand(x, dim, mx.float32, bits, group), True)
            return x.astype(self.dtype)
        return expand(x, dim, self.dtype, bits, group)

    def stores_as(
        self, i: int, bits: int | None, group_size: int | None, scheme: dict[str, bool]
    ) -> bool:
        """Whether layer ``i``'s packed words are what a file of ``bits`` quantizing the layer
        per position in groups of ``group_size``, under the layout flags ``scheme``, stores."""
        return (
            bits == self.bits
            and group_size == self.group_sizes[i]
            and not self.channel_keys(i)
            and scheme == self.scheme(i)
        )

    def expand_layer(self, i: int, row: Any) -> Any:
        """Layer ``i``'s single-row cache in the model's precision (dequantized if packed)."""
        if not is_packed(row):
            return row
        if self.channel_keys(i):
            return expanded_channel_row(row, self.group_sizes[i], self.dims[i], self.dtype)
        return with_kv(row, lambda x, kind: self.values(i, x, kind), "keys", "values")

    def expand(self, layers: list[Any]) -> list[Any]:
        """The rows of a cache in the model's precision (the packed ones dequantized)."""
        return [self.expand_layer(i, row) for i, row in enumerate(layers)]
