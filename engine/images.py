"""A turn's images in the engine: checked when it is submitted, encoded on the vision thread
(``agentkv.engine.models.vision``) while the batch steps on, each image's features handed to
the generation thread at a step boundary (its turn fed up to the image until then)."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any

from agentkv.engine.errors import EngineClosedError, UnsupportedModelError
from agentkv.engine.models.vision import IMAGE_BASE, Vision, image_runs, image_tokens_in
from agentkv.engine.sequence import SeqStatus

if TYPE_CHECKING:
    from agentkv.engine.loop import GenerationLoop
    from agentkv.engine.models.loading import LoadedModel
    from agentkv.engine.request import GenerationRequest
    from agentkv.engine.scheduler import Scheduler
    from agentkv.engine.sequence import Sequence

log = logging.getLogger(__name__)


def vision_of(model: LoadedModel) -> Vision:
    """``model``'s images; raises UnsupportedModelError, naming it and why, unless it takes
    them."""
    if model.vision is None:
        raise UnsupportedModelError(
            f"images: {model.spec} is not a vision-language model; it reads text only"
        )
    model.vision.check()
    return model.vision


def mark(model: LoadedModel, request: GenerationRequest, seq: Sequence) -> None:
    """Check ``request``'s images and mark where ``seq``'s prompt shows them (on the event
    loop, in ``Engine.submit``). Raises ValueError for ids outside the vocabulary that are no
    image's, an image without its bytes, or (where image tokens take positions of their own)
    without its size; UnsupportedModelError for a model that takes no images."""
    vocab_size = model.vocab_size
    if max(request.prompt_tokens) >= vocab_size:  # in C: submit runs on the event loop
        shown = image_tokens_in(request.prompt_tokens)
        if not shown or any(vocab_size <= t < IMAGE_BASE for t in request.prompt_tokens):
            raise ValueError(
                f"prompt_tokens contain ids outside the vocabulary (size {vocab_size})"
            )
        vision = vision_of(model)
        if missing := sorted(shown - request.images.keys()):
            raise ValueError(f"images: no bytes for image tokens {missing[:8]}")
        seq.whole_images = vision.check().bidirectional
        seq.images_at = image_runs(seq.prompt, len(seq.tokens))
    vision = model.vision
    if vision is not None and vision.rule is not None and vision.rule.positioned:
        # Where image tokens take positions of their own, all that follows depends on them.
        shown = image_tokens_in(request.prompt_tokens)
        if request.cache is not None:
            shown |= image_tokens_in(request.cache.tokens)
        if missing := sorted(shown - request.image_sizes.keys()):
            raise ValueError(f"images: no sizes for image tokens {missing[:8]}")


def encode(vision: Vision | None, loop: GenerationLoop, seq: Sequence) -> None:
    """Have the vision thread encode the images ``seq``'s prompt shows (those kept are handed
    over at once); each one's features reach ``seq`` on ``loop``'s thread, or its turn fails
    with the error that encoding raised."""
    for token in dict.fromkeys(token for _, token in seq.images_at):
        done = functools.partial(_encoded, loop, seq, token)
        if (kept := vision.encode(token, seq.request.images[token], done)) is not None:
            done(kept)


def _encoded(loop: GenerationLoop, seq: Sequence, token: int, features: Any) -> None:
    if isinstance(features, Exception):
        log.warning("images: a turn's image cannot be read: %s", features)
        loop.cancel(seq, error=features)
    else:
        with contextlib.suppress(EngineClosedError):  # (it closed meanwhile)
            loop.call_soon(lambda: seq.features.__setitem__(token, features))


def decoding(scheduler: Scheduler) -> bool:
    """Whether a turn in ``scheduler``'s batch is decoding (any thread may ask)."""
    return any(s.status is SeqStatus.DECODING for s in list(scheduler.running))
