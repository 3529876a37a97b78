"""A per-sequence prompt cache: the layers' caches, the tokens they hold, and the earlier
points it can be cut back to (checkpoints)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

CHECKPOINTS_KEPT = 2
"""Earlier turn boundaries a cache can be cut back to (see :meth:`PromptCache.checkpointed`);
shared heads (``Checkpoint.head``) are kept besides."""


@dataclass(slots=True, frozen=True)
class Checkpoint:
    """The sliding-window layers' state after a cache's first ``num_tokens`` tokens: with the
    global layers cut to that length, the cache as it was there, exactly.

    ``head``: the end of a shared head (a system prompt and tools other conversations start
    with, see ``agentkv.caches.tiers``): carried on through every later turn, where turn
    boundaries are kept only while recent. ``prompt_end``: where a prompt's history ended and
    its reply began (``GenerationRequest.checkpoint_at``); a saved cache keeps the latest such
    one (``agentkv.engine.kv.paged``)."""

    num_tokens: int
    windows: dict[int, Any]  # layer index -> the RotatingKVCache as it was then (never changed)
    nbytes: int
    head: bool = False
    prompt_end: bool = False


@dataclass(slots=True)
class PromptCache:
    """Per-layer mlx-lm caches (KVCache / RotatingKVCache) and the exact tokens they hold.

    Made on the generation thread, which also sizes it (``nbytes``, and ``window_nbytes`` for
    its sliding-window layers), so that code on other threads (the hot tier's byte budget)
    never calls into MLX. ``checkpoints``: earlier points it can be cut back to although its
    sliding windows have moved on (most recent first; see :meth:`checkpointed`).

    ``packing``: set when some layers hold their keys and values quantized, as a batch with
    ``batch_kv_bits`` holds them (uint32 arrays, ``agentkv.engine.batch.packing.Packing``; its
    ``expand`` gives the float layers); None when every layer is in the model's precision.
    """

    layers: list[Any]
    tokens: list[int]
    nbytes: int | None = None  # computed on construction when not given
    window_nbytes: int | None = None
    checkpoints: tuple[Checkpoint, ...] = ()
    packing: Any = None

    def __post_init__(self) -> None:
        if self.nbytes is None:
            self.nbytes = sum(layer_nbytes(layer) for layer in self.layers)
        if self.window_nbytes is None:
            self.window_nbytes = sum(
                layer_nbytes(layer) for layer in self.layers if _is_window(layer)
            )

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def held_nbytes(self) -> int:
        """Bytes it keeps alive: its layers and its turn checkpoints' windows. Shared heads'
        windows are not counted: many caches hold the same ones (the hot tier counts them
        once, see ``agentkv.caches.hot``)."""
        return self.nbytes + sum(point.nbytes for point in self.checkpoints if not point.head)

    @property
    def _channel_packed(self) -> bool:
        """Whether some layers hold keys per channel (``batch_kv_bits=4``): their float copies
        of the newest positions are of this cache's end, so it cannot be cut shorter."""
        return self.packing is not None and self.packing.any_channel

    def as_head(self) -> PromptCache:
        """This cache, marked as a shared head: caches resumed from it keep a checkpoint where
        it ends (see :meth:`checkpointed`), so other conversations that start with the same
        tokens can be cut back to it exactly."""
        windows = {i: layer for i, layer in enumerate(self.layers) if _is_window(layer)}
        if not windows or not self.tokens or self._channel_packed:
            return self  # every layer is global: any prefix can be had anyway (or none)
        point = Checkpoint(self.num_tokens, windows, self.window_nbytes or 0, head=True)
        earlier = tuple(c for c in self.checkpoints if c.num_tokens < self.num_tokens)
        return dataclasses.replace(self, checkpoints=(point, *earlier))

    def checkpointed(
        self, earlier: PromptCache, recent: bool = True, reply_began: bool = False
    ) -> PromptCache:
        """This cache, able to be cut back to where ``earlier`` ends (and to ``earlier``'s own
        checkpoints, :data:`CHECKPOINTS_KEPT` in all), although its sliding windows moved on;
        ``earlier``'s shared heads, and this cache's own checkpoints past ``earlier`` (where its
        history ended), are kept whatever ``recent`` says, and so is where ``earlier`` ends
        when its reply began there (``reply_began``: the prompt was a generation prompt only;
        flagged ``prompt_end``, as a saved cache keeps it).

        ``earlier`` is the cache this one was resumed from: its first tokens are this one's,
        and this one's global layers hold the same keys and values for them, so only
        ``earlier``'s sliding-window layers are kept (a window each, not a history). A client
        that rewrites its last turn (resends it changed) then resumes from the turn before.
        """
        windows = {i: layer for i, layer in enumerate(earlier.layers) if _is_window(layer)}
        if not windows or not 0 < earlier.num_tokens < self.num_tokens or self._channel_packed:
            return self  # (a cache packed with keys per channel is only had whole)
        heads = [c for c in earlier.checkpoints if c.head]
        # Its own, past where it resumed: where this turn's history ended (``checkpoint_at``).
        own = [c for c in self.checkpoints if c.num_tokens > earlier.num_tokens]
        points: list[Checkpoint] = []
        if recent or reply_began:
            turns = [c for c in earlier.checkpoints if not c.head] if recent else []
            end = Checkpoint(
                earlier.num_tokens, windows, earlier.window_nbytes or 0, prompt_end=reply_began
            )
            points = [end, *turns][:CHECKPOINTS_KEPT]
        at = {c.num_tokens: c for c in [*points, *own]} | {c.num_tokens: c for c in heads}
        kept = tuple(at[n] for n in sorted(at, reverse=True))
        return dataclasses.replace(self, checkpoints=kept)

    def longest_prefix(self, keep: int) -> PromptCache | None:
        """The cache of the first ``keep`` tokens if it can be had (:meth:`prefix`), else of
        the longest checkpoint within them; None when neither can."""
        cut = self.prefix(keep)
        if cut is not None or self._channel_packed:
            return cut
        from mlx_lm.models.cache import KVCache

        for point in sorted(self.checkpoints, key=lambda c: -c.num_tokens):
            if not 0 < point.num_tokens <= keep:
                continue
            layers = []
            for i, layer in enumerate(self.layers):
                if i in point.windows:
                    layers.append(point.windows[i])
                elif type(layer) is KVCache:
                    trimmed = _cut(layer, point.num_tokens)  # as in prefix()
                    layers.append(trimmed)
                else:
                    return None
            earlier = tuple(c for c in self.checkpoints if c.num_tokens < point.num_tokens)
            return PromptCache(
                layers,
                self.tokens[: point.num_tokens],
                nbytes=self.nbytes,
                window_nbytes=point.nbytes,
                checkpoints=(point, *earlier) if point.head else earlier,
                packing=self.packing,
            )
        return None

    def prefix(self, keep: int) -> PromptCache | None:
        """The cache of the first ``keep`` tokens, sharing this one's arrays (which it leaves
        as they are), or None when that is empty or cannot be had.

        A global-attention layer just holds fewer positions. A sliding-window layer can only
        give back positions it still holds: once its window has moved on (it dropped the
        oldest ones), only the whole cache is available. A cache packed with keys per channel
        (``batch_kv_bits=4``) is only available whole.
        """
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        from agentkv.engine.mlxlm import set_write_index

        if keep == self.num_tokens:
            return self
        if not 0 < keep < self.num_tokens or self._channel_packed:
            return None
        layers = []
        for layer in self.layers:
            kind = type(layer)
            if kind is not KVCache and not (
                kind is RotatingKVCache and layer.offset <= layer.max_size
            ):
                return None
            trimmed = _cut(layer, keep)
            if kind is RotatingKVCache:
                set_write_index(trimmed, keep)
            layers.append(trimmed)
        return PromptCache(  # the same arrays
            layers,
            self.tokens[:keep],
            nbytes=self.nbytes,
            window_nbytes=self.window_nbytes,
            checkpoints=tuple(c for c in self.checkpoints if c.num_tokens <= keep),
            packing=self.packing,
        )


def _cut(layer: Any, keep: int) -> Any:
    """A shallow copy of ``layer`` holding its first ``keep`` positions: no MLX work, and the
    original is intact (a quantized row's float copies of its newest positions are left
    behind: the batch expands the cut row's from its words)."""
    trimmed = copy.copy(layer)
    trimmed.offset = keep
    if getattr(layer, "recent", None) is not None:
        trimmed.recent = None
    return trimmed


def layer_nbytes(layer: Any) -> int:
    """A layer's bytes, with the float copies of a channel-packed row's newest positions and
    first position."""
    floats = [x for part in ("recent", "first_kv") for x in getattr(layer, part, None) or ()]
    return layer.nbytes + sum(x.nbytes for x in floats)


def _is_window(layer: Any) -> bool:
    """Whether a layer holds a window of the history rather than all of it: a sliding-window
    layer, or recurrent state (``agentkv.engine.batch.state``: a window of no positions)."""
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    return type(layer) is RotatingKVCache or isinstance(layer, ArraysCache)
