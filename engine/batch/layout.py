"""The batch's KV layout: per layer its window, its bytes a token and how it is held
(:class:`KVLayout`); the first positions a quantized layer reads in float."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from agentkv.engine.batch.buffers import GroupKVCache, GroupRotatingKVCache, growth
from agentkv.engine.batch.channel import channel_buffer
from agentkv.engine.batch.held import FLOAT_WINDOW, float_window
from agentkv.engine.batch.packing import Packing
from agentkv.engine.batch.quantized import quantized_buffer
from agentkv.engine.batch.rows import is_packed
from agentkv.engine.batch.state import GroupStateCache
from agentkv.engine.codes import quantized_token_bytes
from agentkv.engine.config import group_size_for
from agentkv.engine.errors import InvalidCacheError, UnsupportedModelError
from agentkv.engine.models.caches import flat_caches, is_state
from agentkv.engine.scheme import layer_scheme

log = logging.getLogger(__name__)
PADDING_TOLERANCE = 0.10  # a group holds at most 10% more than its sequences own


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Per layer: the sliding window (None: global attention; 0: recurrent state, which holds
    no positions, ``agentkv.engine.batch.state``) and K+V bytes per token in the batch;
    ``packing``: how
    the layers are held quantized (None: in the model's precision); ``states``: per layer, the
    bytes of one sequence's recurrent state (0 for attention layers), whatever its length."""

    windows: tuple[int | None, ...]
    token_bytes: tuple[int, ...]
    heads: tuple[tuple[int, int, int], ...] = ()  # (KV heads, key dim, value dim) per layer
    by_window: tuple[tuple[int | None, int], ...] = ()  # summed over layers of each window
    packing: Packing | None = None
    states: tuple[int, ...] = ()  # state entries' bytes per sequence, per layer
    state_sizes: tuple[int, ...] = ()  # entries of each layer's ArraysCache (0: attention)
    nested: tuple[int, ...] = ()  # per model layer, the caches its CacheList holds (0: none)

    def __post_init__(self) -> None:
        if not self.states:
            object.__setattr__(self, "states", (0,) * len(self.windows))
            object.__setattr__(self, "state_sizes", (0,) * len(self.windows))
        sums: dict[int | None, int] = {}
        for w, b in zip(self.windows, self.token_bytes, strict=True):
            sums[w] = sums.get(w, 0) + b
        object.__setattr__(self, "by_window", tuple(sums.items()))

    @classmethod
    def of(cls, model: Any, bits: int | None = None, group_size: int | None = None) -> KVLayout:
        """Read the model's layers off one token run through fresh caches; ``bits``: hold the
        layers quantized (in groups of ``group_size``, None: the precision's own, or of
        another size that divides their heads: a layer none divides stays unquantized,
        logged once)."""
        group_size = group_size_for(bits, group_size)
        nested_caches = make_prompt_cache(model)
        caches, nested = flat_caches(nested_caches)
        for c in caches:
            if type(c) not in (KVCache, RotatingKVCache, ArraysCache) or getattr(c, "keep", 0):
                raise UnsupportedModelError(
                    f"{type(model).__module__}: agentkv batches models whose layers all use "
                    f"mlx-lm's KVCache, RotatingKVCache (without keep) or ArraysCache; this one "
                    f"uses {type(c).__name__}"
                )
        model(mx.array([[1]]), cache=nested_caches)
        mx.eval([c.state for c in caches])
        windows = tuple(_window(c) for c in caches)
        heads = tuple((0, 0, 0) if is_state(c) else _heads(c) for c in caches)
        token_bytes = [
            0 if is_state(c) else (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
            for c in caches
        ]
        states = tuple(c.nbytes if is_state(c) else 0 for c in caches)
        sizes = tuple(len(c.cache) if is_state(c) else 0 for c in caches)
        if bits is None:
            return cls(windows, tuple(token_bytes), heads, (), None, states, sizes, nested)
        schemes = [
            None if s else layer_scheme(bits, group_size, (dk, dv))
            for s, (_, dk, dv) in zip(sizes, heads, strict=True)
        ]
        for i, ((n, dk, dv), scheme) in enumerate(zip(heads, schemes, strict=True)):
            if scheme is not None:
                token_bytes[i] = quantized_token_bytes(
                    n, dk, dv, bits, scheme.group_size, scheme.key_group, scheme.key_bits
                )
        dims = tuple((dk, dv) for _, dk, dv in heads)
        dtype = next(c.keys.dtype for c in caches if not is_state(c))
        packing = Packing(bits, tuple(schemes), dims, dtype)
        return cls(windows, tuple(token_bytes), heads, (), packing, states, sizes, nested)

    @property
    def bits(self) -> int | None:
        """The batch's KV bits (None: the model's precision)."""
        return None if self.packing is None else self.packing.bits

    def quantized(self, i: int) -> bool:
        """Whether layer ``i`` is held quantized in the batch."""
        return self.packing is not None and self.packing.quantized(i)

    @property
    def layer_types(self) -> list[type]:
        return [
            KVCache if w is None else ArraysCache if w == 0 else RotatingKVCache
            for w in self.windows
        ]

    @property
    def windowed(self) -> bool:
        """Whether some layers hold a window of the history (sliding windows, recurrent
        state), which a cache cannot be cut back through."""
        return any(w is not None for w in self.windows)

    @property
    def recurrent(self) -> bool:
        """Whether some layers hold recurrent state (``agentkv.engine.batch.state``)."""
        return any(self.states)

    def owned_bytes(self, tokens: int, window_extra: int = 0) -> int:
        """Bytes a sequence of ``tokens`` holds on its own (``window_extra``: positions a
        sliding layer holds beyond its window while a prefill chunk goes in; a quantized layer:
        its float positions, and with keys per channel a global layer's first position or a
        ring's extra key group)."""
        held = sum(
            b * (tokens if w is None else min(tokens, w + window_extra)) for w, b in self.by_window
        )
        held += sum(self.states)
        return held + sum(self._float_extra(i, tokens) for i in range(len(self.windows)))

    def _float_extra(self, i: int, tokens: int) -> int:
        """A quantized layer's float positions (q4: with a global layer's first position, and a
        ring's extra key group)."""
        if self.packing is None or not self.packing.quantized(i):
            return 0
        group, (n, dk, dv) = self.packing.key_group(i), self.heads[i]
        if not self.packing.channel_keys(i):
            return FLOAT_WINDOW * n * (dk + dv) * self.packing.dtype.size
        floats = float_window(group) * n * (dk + dv) * self.packing.dtype.size
        if self.windows[i] is None:  # and its first position (ModelRunner.first_positions)
            return floats + n * (dk + dv) * self.packing.dtype.size
        return floats + min(tokens, group) * self.token_bytes[i]

    def padded_bytes(self, lengths: list[int]) -> int:
        """Bytes a group of sequences of these lengths holds, each padded to the longest."""
        return len(lengths) * self.owned_bytes(max(lengths)) if lengths else 0

    def fits_one_group(self, lengths: list[int]) -> bool:
        owned = sum(self.owned_bytes(n) for n in lengths)
        return self.padded_bytes(lengths) <= (1 + PADDING_TOLERANCE) * owned

    def reservation(self, final_tokens: int, overhang: int) -> int:
        """What a sequence ending at ``final_tokens`` may hold at most: its own bytes with the
        buffer's growth step, ``overhang`` positions beyond each sliding window
        (:meth:`overhang`) and its group's padding allowance."""
        held = self.owned_bytes(final_tokens + growth(final_tokens), window_extra=overhang)
        return int(held * (1 + PADDING_TOLERANCE)) + 1

    def capacity(self, budget_bytes: int, overhang: int) -> int:
        """The most tokens a sequence can hold within ``budget_bytes`` reserved alone (its
        :meth:`reservation`; 0: none; at most 2**40)."""
        low, high = 0, 1 << 40
        while high - low > 1:  # low fits; high does not, or is the most asked
            middle = (low + high) // 2
            fits = self.reservation(middle, overhang) <= budget_bytes
            low, high = (middle, high) if fits else (low, middle)
        return low

    def overhang(self, layers: list[Any] | None, prompt: int, chunk: int) -> int:
        """Positions a sequence's sliding layers may hold beyond their windows in the batch:
        the largest chunk of its ``prompt`` tokens still to come (chunks of at most ``chunk``;
        a chunk of ``c`` leaves a ring ``c - 1`` over its window until the next decode step
        writes in place). A short turn on a long history reserves its own chunk, not
        ``prefill_step_size``, in every sliding layer. A cache's float and q8 rows join cut to
        their windows (mlx-lm's merge); a q4 row joins with every column it holds (its key
        groups whole), so what its ``layers`` hold beyond their rings counts too. Layers that
        do not match the model count nothing here (joining refuses them)."""
        extra = min(prompt, chunk)
        if not layers or self.packing is None or not self.packing.any_channel:
            return extra
        for i, (layer, w) in enumerate(zip(layers, self.windows, strict=False)):
            if w is None or not self.packing.channel_keys(i):
                continue
            if not isinstance(layer, RotatingKVCache) or layer.max_size != w:
                continue
            keys = layer.keys
            if not isinstance(keys, mx.array) or keys.ndim != 4 or not is_packed(layer):
                continue
            ring = w + self.packing.key_group(i)  # with its extra key group (_float_extra)
            extra = max(extra, keys.shape[2] - ring)
        return extra

    @property
    def reads_first_positions(self) -> bool:
        """Whether a row's group buffers take its :func:`first_positions` (q4's global layers
        read them in float over their words: see
        ``agentkv.engine.batch.channel._ChannelQuantized``)."""
        return self.packing is not None and any(
            self.packing.channel_keys(i) and w is None for i, w in enumerate(self.windows)
        )

    def buffers(self, layers: list[Any], first: list | None = None) -> list[Any]:
        """One sequence's group buffers (a row each, copied) from its checked ``layers``: what
        the model attends through in the batch (mlx-lm batch caches, quantized ones packing
        float rows). ``first``: per layer, the keys and values of the sequence's first
        position in float (``ModelRunner.first_positions``; a q4 global layer reads them
        instead of their words), or None."""
        self.check(layers)
        return [self._buffer(i, [x], first and first[i]) for i, x in enumerate(layers)]

    def empty_layers(self, first: list | None = None) -> list[Any]:
        """A sequence's empty group buffers (``first``: as :meth:`buffers`)."""
        return [self._buffer(i, [], first and first[i]) for i in range(len(self.windows))]

    def _buffer(self, i: int, layers: list[Any], first: Any = None) -> Any:
        """Layer ``i``'s group buffer of ``layers`` (one row each; none: one empty row). A
        layer held quantized packs float rows first (a paused row is packed already)."""
        w = self.windows[i]
        if w == 0:
            if not layers:
                return GroupStateCache.empty(self.state_sizes[i])
            return GroupStateCache.merge(layers)
        if self.quantized(i):
            rows = [self.packing.pack(i, x) for x in layers]
            if self.packing.channel_keys(i):
                return channel_buffer(rows, w, self.packing.group_sizes[i], first)
            group = self.packing.group_sizes[i]
            bits = self.packing.bits
            return quantized_buffer(rows, w, bits, group, self.packing.keys_rotated(i))
        if not layers:
            return GroupKVCache([0]) if w is None else GroupRotatingKVCache(w, [0])
        return (GroupKVCache if w is None else GroupRotatingKVCache).merge(layers)

    def check(self, layers: list[Any]) -> None:
        """Raise InvalidCacheError unless ``layers`` are caches this model's layers can use
        (a layer held quantized also takes a row packed by the batch: a paused sequence's)."""
        types = [ArraysCache if is_state(x) else type(x) for x in layers]
        if types != self.layer_types:
            raise InvalidCacheError(
                f"cache layers {[t.__name__ for t in types]} do not match the model's "
                f"{[t.__name__ for t in self.layer_types]}"
            )
        for i, (layer, window) in enumerate(zip(layers, self.windows, strict=True)):
            if window == 0:
                self._check_state(i, layer)
                continue
            if window is not None and layer.max_size != window:
                raise InvalidCacheError(
                    f"a sliding-window layer holds {layer.max_size} positions; the model's "
                    f"window is {window}"
                )
            if not self.heads or layer.keys is None:
                continue
            want = self.heads[i]
            if is_packed(layer):
                if not self.quantized(i):
                    raise InvalidCacheError(f"cache layer {i} is packed; the batch's is not")
                want = (want[0], *self.packing.packed_dims(i))
            if _heads(layer) != want:
                raise InvalidCacheError(
                    f"cache layer {i} holds (KV heads, key dim, value dim) {_heads(layer)}; "
                    f"the model's are {want}"
                )

    def _check_state(self, i: int, layer: Any) -> None:
        if len(layer.cache) != self.state_sizes[i] or (
            any(x is not None for x in layer.cache)
            and sum(x.nbytes for x in layer.cache if x is not None) != self.states[i]
        ):
            shapes = [None if x is None else tuple(x.shape) for x in layer.cache]
            raise InvalidCacheError(
                f"cache layer {i} holds recurrent state {shapes}; the model's layer holds "
                f"{self.state_sizes[i]} arrays of {self.states[i]} bytes"
            )


def _window(cache: Any) -> int | None:
    if is_state(cache):
        return 0
    return cache.max_size if type(cache) is RotatingKVCache else None


def first_positions(model: Any, token: int) -> list[tuple[mx.array, mx.array]]:
    """Per layer, the keys and values every sequence starting with ``token`` holds at its
    first position, in the model's precision. Causal attention makes them a function of that
    token alone: one forward pass of it through ``model`` (on the generation thread). A q4
    batch reads its global layers' (:meth:`KVLayout.buffers`); a cache dequantized from a
    file takes them in place of its first position's words (``agentkv.engine.kv.load``)."""
    nested = make_prompt_cache(model)
    model(mx.array([[token]]), cache=nested)
    caches = flat_caches(nested)[0]
    got = [
        None
        if is_state(c)
        else (mx.contiguous(c.keys[..., :1, :]), mx.contiguous(c.values[..., :1, :]))
        for c in caches
    ]
    mx.eval([x for x in got if x is not None])
    return got


def _heads(cache: Any) -> tuple[int, int, int]:
    return cache.keys.shape[1], cache.keys.shape[3], cache.values.shape[3]
