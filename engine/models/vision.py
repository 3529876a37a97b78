"""Images in a vision-language model's prompt: its vision half (mlx-vlm's classes), the tokens
an image stands for, and the features that replace their embeddings.

An image's positions in a token list are not the model's placeholder token but a token of the
image itself: :data:`IMAGE_BASE` plus the image's number (its row in the registry, the same for
the same bytes). Every cache key, block hash and prefix match therefore tells two images apart
while the model's placeholders would not, and a conversation that shows an image again, or
another one that shows it, reuses its KV without the vision tower. Only the rows a step feeds
see the model's embeddings: an image token's row takes the image's features (its ``k``-th,
counting from the first of the run of that token), every other row the token's embedding.

The vision tower runs on a thread of its own (:meth:`Vision.encode`), never the generation
thread: a new image takes seconds of compute on a GPU and minutes on a CPU, and the batch's
decoding turns step on meanwhile. A turn showing an image is fed up to the image while it is
encoded (:meth:`agentkv.engine.sequence.Sequence.feedable`) and holds its features once they come.

Each family's rule (``agentkv.engine.models.image_rules``) says how its prompt writes an image;
those that give image tokens positions of their own (Qwen 3.5) get them from
``agentkv.engine.models.mrope``. Other families read text only and refuse an image by name.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentkv.engine.errors import UnsupportedModelError
from agentkv.engine.models.image_configs import image_rule
from agentkv.engine.models.image_rules import ImageRule
from agentkv.models import blas

if TYPE_CHECKING:
    import mlx.core as mx

log = logging.getLogger(__name__)

IMAGE_BASE = 1 << 24
"""The token of image number ``n`` is ``IMAGE_BASE + n`` (above any vocabulary; int32 on disk)."""
MAX_IMAGE_NUMBER = (1 << 31) - 1 - IMAGE_BASE
Features = tuple["mx.array", tuple["mx.array", ...]]
"""An image's features: the input embeddings of its tokens and its deepstack levels'."""
FEATURES_KEPT = 32
"""Images whose features stay in memory after their prompt is fed (least recently used go)."""
Encoded = Callable[["Features | Exception"], None]
"""Told an image's features, or why they could not be had (on the vision thread)."""


def image_token(number: int) -> int:
    """The token that stands for image ``number`` at each of its positions."""
    if not 0 <= number <= MAX_IMAGE_NUMBER:
        raise ValueError(f"image number {number} is outside 0..{MAX_IMAGE_NUMBER}")
    return IMAGE_BASE + number


def image_tokens_in(tokens: list[int]) -> set[int]:
    """The image tokens among ``tokens``."""
    return {t for t in tokens if t >= IMAGE_BASE} if tokens and max(tokens) >= IMAGE_BASE else set()


def text_tokens(tokens: list[int], placeholder: int) -> list[int]:
    """``tokens`` with every image token as the model's ``placeholder`` (what penalties and a
    draft model, which see ids and not images, are given)."""
    return [placeholder if t >= IMAGE_BASE else t for t in tokens]


class Staged:
    """The deepstack additions of the step about to run (``agentkv.engine.deepstack``): per
    level, the step's image rows and their features."""

    def __init__(self) -> None:
        self._levels: list[tuple[mx.array, mx.array] | None] = []

    def put(self, rows: mx.array, levels: list[mx.array]) -> None:
        self._levels = [(rows, features) for features in levels]

    def clear(self) -> None:
        self._levels = []

    def take(self, level: int) -> tuple[mx.array, mx.array] | None:
        """Level ``level``'s addition, once (None: nothing staged for it)."""
        if level >= len(self._levels):
            return None
        got, self._levels[level] = self._levels[level], None
        return got


class Vision:
    """A vision-language model's images: its rule and, loaded on the first image (a
    text-only conversation never loads or runs it), its vision tower. Features are computed
    on the vision thread (started with the first image), one image at a time, and the last
    :data:`FEATURES_KEPT` images' are kept."""

    def __init__(self, path: Path, config: dict[str, Any], tokenizer: Any, embed: Any):
        self.path = path
        self.family = family = config.get("model_type", "?")
        self.rule = image_rule(config, tokenizer, path)
        self._embed = embed  # the language model's token embedding (shared, not copied)
        self._model: Any = None
        self._processor: Any = None
        self._features: OrderedDict[int, Features] = OrderedDict()
        deepstack = config["vision_config"].get("deepstack_visual_indexes") or ()
        self.levels = len(deepstack) if family.startswith("qwen3_vl") else 0
        """Deepstack levels: features added after the first decoder layers (Qwen3-VL)."""
        self.staged = Staged()
        self._grids: dict[tuple[int, int], tuple[int, int]] = {}
        self.encoded = 0
        """Images the vision tower has run on (each distinct image once while it is kept)."""
        self._lock = threading.Lock()  # (_features, _waiting: the vision thread's and callers')
        self._waiting: dict[int, list[Encoded]] = {}  # image token -> told when it is encoded
        self._closed = False
        self._busy = threading.Lock()  # held while the tower runs
        self.decoding: Callable[[], bool] = lambda: False
        """Whether turns are decoding (the engine's): a tower that starts then shares the
        CPU's BLAS with them (``agentkv.models.blas.cores_shared``)."""
        self.on_load: Callable[[Any], None] = lambda model: None
        """Called with mlx-vlm's model once loaded, on the vision thread (the engine's: its
        products evaluated one at a time, ``agentkv.engine.mlxlm.evaluated_products``)."""

    @classmethod
    def of(cls, path: Path, config: dict[str, Any], tokenizer: Any, model: Any) -> Vision | None:
        """The vision half of the model at ``path`` (None for a text model)."""
        if not config.get("vision_config"):
            return None
        inner = getattr(model, "language_model", model)
        embed = getattr(getattr(inner, "model", inner), "embed_tokens", None)
        return cls(path, config, tokenizer, embed)

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of the tokens of an image of ``size`` (width, height)."""
        if (known := self._grids.get(size)) is None:
            known = self._grids[size] = self.check().grid(size)
        return known

    @property
    def placeholder(self) -> int | None:
        """The id that stands for an image's tokens where ids are read (the model's image
        token, or what the family's model reads there: ``ImageRule.reads``)."""
        return None if self.rule is None else self.rule.reads

    @property
    def refusal(self) -> str | None:
        """Why this model takes no images (None: it does)."""
        if self.rule is None:
            return f"agentkv feeds no images to {self.family} models; they read text only"
        if self._embed is None:
            return f"{self.family}: its token embedding was not found"
        return None

    def check(self) -> ImageRule:
        """The image rule; raises UnsupportedModelError naming the model when it takes none."""
        if (why := self.refusal) is not None:
            raise UnsupportedModelError(f"images: {self.path.name}: {why}")
        assert self.rule is not None
        return self.rule

    def encode(self, token: int, data: bytes, done: Encoded) -> Features | None:
        """Image ``token``'s features when they are kept; else None, and the vision thread
        encodes ``data`` (once however many ask) and tells ``done`` the features, or the
        exception encoding raised. Any thread may call it."""
        with self._lock:
            if (kept := self._features.get(token)) is not None:
                self._features.move_to_end(token)
                return kept
            if token in self._waiting:
                self._waiting[token].append(done)
                return None
            self._waiting[token] = [done]
        _on_vision_thread(functools.partial(self._work, token, data))
        return None

    def close(self) -> None:
        """Encode nothing more; returns once an image being encoded is (those waiting are
        dropped), so that no tower runs on while the process exits."""
        self._closed = True
        with self._busy:
            pass

    def _work(self, token: int, data: bytes) -> None:
        shared = blas.cores_shared() if self.decoding() else contextlib.nullcontext()
        try:
            with self._busy, shared:
                if self._closed:
                    return
                got: Features | Exception = self._encode(token, data)
            with self._lock:
                self._features[token] = got
                while len(self._features) > FEATURES_KEPT:
                    self._features.popitem(last=False)
        except Exception as exc:
            got = exc
        with self._lock:
            waiting = self._waiting.pop(token, [])
        for done in waiting:
            try:
                done(got)
            except Exception:  # (e.g. its engine closed meanwhile)
                log.exception("images: delivering an image's features failed")

    def _encode(self, token: int, data: bytes) -> Features:
        """The image's ``(tokens, hidden)`` input embeddings, as the model merges them, and
        its deepstack levels' (each ``(tokens, hidden)``; none for most families)."""
        import mlx.core as mx

        rule = self.check()
        model, processor = self._loaded()
        image = _decoded(data)
        n = rule.tokens(image.size)
        processed = processor(images=[image], return_tensors="np", **rule.processing())
        extra = {k: mx.array(v) for k, v in processed.items() if _is_pixel_input(k)}
        ids = mx.full((1, n), rule.placeholder, dtype=mx.int32)
        got = model.get_input_embeddings(
            ids,
            mx.array(processed["pixel_values"]),
            mask=mx.ones((1, n), dtype=mx.int32),
            **extra,
        )
        levels = tuple(getattr(got, "deepstack_visual_embeds", None) or ())[: self.levels]
        main = got.inputs_embeds[0]
        if rule.embedding_scale != 1.0:  # (the language model scales them back)
            main = main / rule.embedding_scale
        got = (main, levels)
        mx.eval(got)
        self.encoded += 1
        if got[0].shape[0] != n or any(x.shape[0] != n for x in levels):
            raise UnsupportedModelError(
                f"images: {self.path.name}: {got[0].shape[0]} features for {n} tokens"
            )
        if len(levels) != self.levels:
            raise UnsupportedModelError(
                f"images: {self.path.name}: {len(levels)} deepstack levels, not {self.levels}"
            )
        return got

    def embeddings(
        self, inputs: mx.array, rows: list[tuple[int, int, int]], features: dict[int, Features]
    ) -> mx.array:
        """The input embeddings of a step's ``inputs`` (one token a row): ``rows`` are the
        image rows, each ``(row, image token, index within the image)``; ``features`` maps an
        image token to its features. The rows' deepstack features are staged for the step's
        layers (``agentkv.engine.deepstack``)."""
        import mlx.core as mx

        rule = self.check()
        placeholder = mx.array(rule.placeholder, inputs.dtype)
        h = self._embed(mx.where(inputs >= IMAGE_BASE, placeholder, inputs))
        pieces: list[list[mx.array]] = [[] for _ in range(1 + self.levels)]
        at = []
        for token in dict.fromkeys(t for _, t, _ in rows):
            mine = [(r, k) for r, t, k in rows if t == token]
            main, levels = features[token]
            which = mx.array([k % main.shape[0] for _, k in mine])
            for kept, level in zip(pieces, (main, *levels), strict=True):
                kept.append(level[which])
            at += [r for r, _ in mine]
        rows_at = mx.array(at)
        h[rows_at] = mx.concatenate(pieces[0]).astype(h.dtype)
        self.staged.put(rows_at, [mx.concatenate(level) for level in pieces[1:]])
        return h

    def _loaded(self) -> tuple[Any, Any]:
        if self._model is None:
            from mlx_vlm.utils import load_model

            try:
                model = load_model(self.path, lazy=True)
                processor = self.check().image_processor(self.path)
            except Exception as exc:
                raise UnsupportedModelError(
                    f"images: mlx-vlm cannot load the vision half of {self.path.name} "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            # Its language model's weights stay unread: embeddings come from the one in use.
            model.language_model.model.embed_tokens = self._embed
            self.on_load(model)
            self._model, self._processor = model, processor
            log.info("%s: vision tower loaded for images", self.path.name)
        return self._model, self._processor


_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_thread_lock = threading.Lock()


def _on_vision_thread(job: Callable[[], None]) -> None:
    """Run ``job`` on the vision thread, one for the process, started with the first image
    and never ended: a thread that ends runs MLX's thread-local destructors, which abort a
    process that is exiting meanwhile."""
    global _thread
    with _thread_lock:
        if _thread is None:
            _thread = threading.Thread(target=_vision_thread, daemon=True, name="vision")
            _thread.start()
    _jobs.put(job)


def _vision_thread() -> None:
    import mlx.core as mx

    stream = mx.new_stream(mx.default_device())  # (a thread's streams are its own)
    while True:
        job = _jobs.get()
        try:
            with mx.stream(stream):
                job()
        except Exception:  # (a job reports its own errors; never end the thread)
            log.exception("images: a vision job failed")
        del job  # (holds its Vision until the next job)


def _is_pixel_input(name: str) -> bool:
    """Whether a processor's output ``name`` goes to the vision tower beside the pixels (the
    image's grid, sizes, LFM2-VL's patch shapes and mask)."""
    return name.startswith("image_") or name in ("spatial_shapes", "pixel_attention_mask")


def _decoded(data: bytes) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.seek(0)  # a GIF's first frame
    return image.convert("RGB")


def image_rows(
    history: list[int], chunk: list[int], first_row: int, joiners: frozenset[int] = frozenset()
) -> list[tuple[int, int, int]]:
    """The image rows of a prefill ``chunk`` fed after ``history``, starting at step row
    ``first_row``: ``(row, image token, index within its image)``. An image is a run of its
    token, ``joiners`` between its runs counting as within it (Pixtral's row breaks,
    LFM2-VL's tile markers)."""
    rows = []
    run_token, run = None, 0
    i = len(history)  # (an image the history began: its tokens there so far)
    while i and (history[i - 1] >= IMAGE_BASE or history[i - 1] in joiners):
        i -= 1
    for token in history[i:]:
        if token >= IMAGE_BASE:
            run_token, run = token, run + 1 if token == run_token else 1
    for j, token in enumerate(chunk):
        if token in joiners:
            continue
        if token < IMAGE_BASE:
            run_token, run = None, 0
            continue
        if token != run_token:
            run_token, run = token, 0
        rows.append((first_row + j, token, run))
        run += 1
    return rows


def image_blocks(chunk: list[int]) -> tuple[int, ...]:
    """Per token of a prompt chunk, which of its runs of image tokens it is in (-1: text)."""
    blocks, block, previous = [], -1, None
    for token in chunk:
        if token >= IMAGE_BASE and token != previous:
            block += 1
        blocks.append(block if token >= IMAGE_BASE else -1)
        previous = token
    return tuple(blocks)


def image_runs(prompt: list[int], start: int) -> tuple[tuple[int, int], ...]:
    """``(position, image token)`` of the first token of each run of an image's tokens in
    ``prompt``, which begins at conversation position ``start``."""
    return tuple(
        (start + i, t)
        for i, t in enumerate(prompt)
        if t >= IMAGE_BASE and (i == 0 or prompt[i - 1] != t)
    )
