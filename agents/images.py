"""Images in a turn: checked before anything is stored, then named by their number in the
registry (``Registry.images``) inside the message's content parts, as chat templates read them
(``{"type": "image", "image": <number>}``)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from agentkv.engine.models.vision import ImageRule, image_token
from agentkv.errors import ChatTemplateError, InvalidImageError
from agentkv.messages import Message
from agentkv.store.images import ImageIndex, NewImage

MAX_IMAGE_BYTES = 20 * 1024 * 1024
"""The largest encoded image a message may hold (Anthropic's API takes at most 5 MB a request's
image, OpenAI's 20 MB)."""
MAX_IMAGE_PIXELS = 50_000_000
"""The most pixels an image may decode to (a larger one is refused before it is decoded)."""
MAX_IMAGES = 32
"""The most images one message may show (``chat(images=)``)."""
MAX_CONVERSATION_IMAGES = 500
"""The most images one resent conversation may show (OpenAI's API takes 500 a request)."""
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


def checked_images(images: Sequence[bytes]) -> list[NewImage]:
    """The images of a message, each checked (an encoded PNG, JPEG, WebP or GIF that decodes,
    within :data:`MAX_IMAGE_BYTES` and :data:`MAX_IMAGE_PIXELS`). Raises InvalidImageError
    naming the image (``images[i]``) and what is wrong."""
    if isinstance(images, bytes | str) or not isinstance(images, Sequence):
        raise InvalidImageError("images must be a list of encoded images (bytes)")
    if len(images) > MAX_IMAGES:
        raise InvalidImageError(f"{len(images)} images in one message; at most {MAX_IMAGES}")
    return [checked_image(data, f"images[{i}]") for i, data in enumerate(images)]


def checked_image(data: Any, where: str) -> NewImage:
    """``data`` as a :class:`NewImage`, checked (see :func:`checked_images`)."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidImageError(f"{where}: an image must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise InvalidImageError(f"{where}: the image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidImageError(
            f"{where}: {len(data)} bytes; an image may hold at most {MAX_IMAGE_BYTES}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            kind = image.format
            if kind in FORMATS and image.width * image.height > MAX_IMAGE_PIXELS:
                raise InvalidImageError(
                    f"{where}: {image.width}x{image.height} pixels; at most "
                    f"{MAX_IMAGE_PIXELS} an image"
                )
            image.load()  # the whole first frame decodes (a truncated file does not)
    except InvalidImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidImageError(f"{where}: not a readable image ({exc})") from None
    except Image.DecompressionBombWarning as exc:
        raise InvalidImageError(f"{where}: too many pixels ({exc})") from None
    if kind not in FORMATS:
        raise InvalidImageError(f"{where}: a {kind} image; PNG, JPEG, WebP and GIF are read")
    return NewImage(data, FORMATS[kind])


def image_part(number: int, sha256: str) -> dict[str, Any]:
    """A stored image as a content part: its number and the SHA-256 of its bytes."""
    return {"type": "image", "image": number, "sha256": sha256}


def image_parts(numbers: Sequence[int], images: Sequence[NewImage], text: str) -> list[dict]:
    """A user message's content parts: its images (stored, by number), then its text."""
    parts = [image_part(n, image.sha256) for n, image in zip(numbers, images, strict=True)]
    return parts + ([{"type": "text", "text": text}] if text else [])


async def with_stored_images(index: ImageIndex, messages: list[Message]) -> list[Message]:
    """``messages`` with each image part that holds its bytes (``{"type": "image", "data":
    <bytes>}``, as the HTTP APIs give them) stored and named by number instead (an image
    stored before is not decoded again). Raises InvalidImageError naming the part."""
    found = [
        (i, j, part["data"])
        for i, m in enumerate(messages)
        if isinstance(m.get("content"), list)
        for j, part in enumerate(m["content"])
        if isinstance(part, dict) and part.get("type") == "image" and "data" in part
    ]
    if not found:
        return messages
    if len(found) > MAX_CONVERSATION_IMAGES:
        raise InvalidImageError(
            f"{len(found)} images in one conversation; at most {MAX_CONVERSATION_IMAGES}"
        )
    digests = await asyncio.to_thread(lambda: [hashlib.sha256(d).hexdigest() for *_, d in found])
    known = await index.numbers(digests)
    new = {
        d: (i, j, data) for d, (i, j, data) in zip(digests, found, strict=True) if d not in known
    }
    checked = await asyncio.to_thread(
        lambda: [checked_image(data, f"messages[{i}].content[{j}]") for i, j, data in new.values()]
    )
    numbers = dict(known) | dict(zip(new, await index.add(checked), strict=True))
    out = [dict(m) for m in messages]
    for (i, j, _), digest in zip(found, digests, strict=True):
        if out[i]["content"] is messages[i]["content"]:
            out[i]["content"] = list(out[i]["content"])
        out[i]["content"][j] = image_part(numbers[digest], digest)
    return out


def shows_images(messages: Sequence[Message]) -> bool:
    """Whether some message has an image part."""
    return any(
        isinstance(part, dict) and part.get("type") == "image"
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
    )


def unnamed_images(message: Message) -> Message:
    """``message`` with its image parts as any image (number 0): what counting tokens needs."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [image_part(0, "") if p.get("type") == "image" else p for p in content]
    return {**message, "content": parts}


def images_of(messages: Sequence[Message]) -> list[int]:
    """The numbers of the images ``messages`` show, in the order they are rendered."""
    return [
        part["image"]
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


def image_tokens(
    encode: Callable[[str], list[int]], text: str, numbers: Sequence[int], rule: ImageRule | None
) -> list[int]:
    """``encode(text)`` of rendered text that shows the images ``numbers`` (in order), each
    marker the template wrote expanded as the model's processor does and its placeholders
    made the image's own tokens. Raises ChatTemplateError when the template wrote another
    count of images."""
    if rule is None:  # (AgentRuntime refuses images for such a model before rendering)
        raise ChatTemplateError("the model takes no images")
    tokens = encode(text.replace(rule.marker, rule.expansion))
    runs, previous = 0, None
    for i, token in enumerate(tokens):
        if token == rule.placeholder:
            runs += previous != rule.placeholder
            if runs <= len(numbers):
                tokens[i] = image_token(numbers[runs - 1])
        previous = token
    if runs != len(numbers):
        raise ChatTemplateError(
            f"the model's chat template wrote {runs} images for the {len(numbers)} shown"
        )
    return tokens
