"""Length groups: sequences whose KV share one padded buffer per layer (:class:`KVGroup`)."""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

from agentkv.engine.batch.buffers import MIN_GROWTH, GroupRotatingKVCache
from agentkv.engine.batch.layout import KVLayout
from agentkv.engine.models.caches import is_state


class Row(Protocol):
    """What a group holds of a sequence (``agentkv.engine.sequence.Sequence``): the tokens its row
    holds, and the group it is in, which the group sets."""

    tokens: list[int]
    group: KVGroup | None


class KVGroup:
    """Sequences whose KV share one padded buffer per layer (mlx-lm's batch caches).

    A sequence enters through a group of its own (:meth:`start`), prefills there, and may then
    be merged into a group of similar lengths (:meth:`absorb`). Row ``i`` of every layer is
    ``seqs[i]``.
    """

    __slots__ = ("layers", "padded", "seqs")

    def __init__(self, layers: list[Any], seqs: list[Row]):
        self.layers = layers
        self.seqs = seqs
        self.padded = len(seqs) > 1  # its buffers may hold positions no sequence owns
        for seq in seqs:
            seq.group = self

    @classmethod
    def start(
        cls, layout: KVLayout, seq: Row, layers: list[Any] | None, first: list | None = None
    ) -> KVGroup:
        """A group holding ``seq`` alone, starting from ``layers`` (copied) or empty;
        ``first``: per layer, its first position's keys and values (see
        :meth:`KVLayout.buffers`)."""
        if layers is None:
            return cls(layout.empty_layers(first), [seq])
        return cls(layout.buffers(layers, first), [seq])

    @property
    def lengths(self) -> list[int]:
        return [len(s.tokens) for s in self.seqs]

    @property
    def held_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def settled(self) -> bool:
        """Whether no sliding layer holds positions beyond its ring. A prompt's chunk leaves
        them until the row's next decode step writes in place; a group that merged then would
        pad every row of the other group to them, past what those rows reserved."""
        return all(
            layer.keys is None or layer.keys.shape[2] <= layer.max_size
            for layer in self.layers
            if isinstance(layer, GroupRotatingKVCache)
        )

    @property
    def positions(self) -> mx.array:
        """Each row's next position (its rotary offset, read off an attention layer; a model
        without attention reads none)."""
        layer = next((x for x in self.layers if not is_state(x)), None)
        return mx.array(self.lengths) if layer is None else layer.offset

    def absorb(self, other: KVGroup) -> None:
        """Append ``other``'s sequences as rows of this group (both buffers are copied)."""
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.extend(theirs)
        for seq in other.seqs:
            seq.group = self
        self.seqs += other.seqs
        self.padded = True
        other.seqs, other.layers = [], []

    def extract(self, seq: Row) -> list[Any]:
        """``seq``'s own per-layer caches (KVCache / RotatingKVCache), copied out; packed for
        the layers held quantized (``Packing.expand`` expands them)."""
        row = self.seqs.index(seq)
        return [layer.extract(row) for layer in self.layers]

    def windows(self, seq: Row, layout: KVLayout) -> dict[int, Any] | None:
        """``seq``'s sliding-window and recurrent layers as they are now (copied out), for a
        checkpoint (``agentkv.engine.request.Checkpoint``); None when it has none, or when its
        layers hold keys per channel (such a cache is only had whole)."""
        if layout.packing is not None and layout.packing.any_channel:
            return None
        row = self.seqs.index(seq)
        got = {
            i: self.layers[i].extract(row) for i, w in enumerate(layout.windows) if w is not None
        }
        return got or None

    def remove(self, seqs: list[Row]) -> None:
        gone = {id(s) for s in seqs}
        keep = [i for i, s in enumerate(self.seqs) if id(s) not in gone]
        for seq in seqs:
            seq.group = None
        if not keep:
            self.seqs, self.layers = [], []
            return
        if len(keep) < len(self.seqs):
            for layer in self.layers:
                layer.filter(keep)
            self.seqs = [self.seqs[i] for i in keep]

    def compact(self, layout: KVLayout) -> bool:
        """Copy the group into buffers sized for the sequences it still holds, when rows that
        left (the longest, say) leave it holding much more; returns whether it did."""
        lengths = self.lengths
        if not lengths or self.held_bytes <= 1.125 * layout.padded_bytes(lengths) + len(
            lengths
        ) * layout.owned_bytes(MIN_GROWTH):
            return False
        self.layers = [
            layout._buffer(j, [layer.extract(i) for i in range(len(lengths))])
            if not is_state(layer)
            else layer  # a row of state each: nothing padded
            for j, layer in enumerate(self.layers)
        ]
        return True


def best_group(layout: KVLayout, groups: list[KVGroup], joining: list[int]) -> KVGroup | None:
    """The group that sequences of these lengths add the least padding to, within tolerance."""
    best, best_waste = None, None
    for group in groups:
        lengths = group.lengths + joining
        if not layout.fits_one_group(lengths):
            continue
        waste = layout.padded_bytes(lengths) - sum(layout.owned_bytes(n) for n in lengths)
        if best_waste is None or waste < best_waste:
            best, best_waste = group, waste
    return best
