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

from agentkv.engine.models.image_rules import ImageRule
from agentkv.engine.models.vision import IMAGE_BASE, image_token, image_tokens_in
from agentkv.engine.request import PromptCache
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
    return NewImage(data, FORMATS[kind], image.width, image.height)


def image_part(number: int, sha256: str, size: tuple[int, int]) -> dict[str, Any]:
    """A stored image as a content part: its number, the SHA-256 of its bytes, its size."""
    return {"type": "image", "image": number, "sha256": sha256, "width": size[0], "height": size[1]}


def image_parts(numbers: Sequence[int], images: Sequence[NewImage], text: str) -> list[dict]:
    """A user message's content parts: its images (stored, by number), then its text."""
    parts = [
        image_part(n, image.sha256, (image.width, image.height))
        for n, image in zip(numbers, images, strict=True)
    ]
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
    for i, j, data in found:
        if not isinstance(data, bytes | bytearray):
            where = f"messages[{i}].content[{j}].data"
            raise InvalidImageError(f"{where}: an image must be bytes, got {type(data).__name__}")
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
    sizes = await index.sizes(known.values())
    sizes |= {numbers[d]: (i.width, i.height) for d, i in zip(new, checked, strict=True)}
    out = [dict(m) for m in messages]
    for (i, j, _), digest in zip(found, digests, strict=True):
        if out[i]["content"] is messages[i]["content"]:
            out[i]["content"] = list(out[i]["content"])
        number = numbers[digest]
        out[i]["content"][j] = image_part(number, digest, sizes[number])
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
    """``message`` with its image parts as images of their size (number 0): what counting
    tokens needs. Raises InvalidImageError for one whose size cannot be read."""
    from PIL import Image, UnidentifiedImageError

    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = []
    for j, part in enumerate(content):
        if part.get("type") == "image" and "data" in part:
            try:
                size = Image.open(io.BytesIO(part["data"])).size  # (its header only)
            except (UnidentifiedImageError, OSError) as exc:
                raise InvalidImageError(f"content[{j}]: not a readable image ({exc})") from None
            part = image_part(0, "", size)
        parts.append(part)
    return {**message, "content": parts}


def images_of(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The image parts of ``messages``, in the order they are rendered."""
    return [
        part
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


def image_tokens(
    encode: Callable[[str], list[int]],
    text: str,
    images: Sequence[dict[str, Any]],
    rule: ImageRule | None,
) -> list[int]:
    """``encode(text)`` of rendered text that shows ``images`` (stored image parts, in order):
    each marker the template wrote expanded as the model's processor does for that image and
    its placeholders made the image's own tokens. Raises ChatTemplateError when the template
    wrote another count of images."""
    if rule is None:  # (AgentRuntime refuses images for such a model before rendering)
        raise ChatTemplateError("the model takes no images")
    pieces = text.split(rule.marker)
    if len(pieces) != len(images) + 1:
        raise ChatTemplateError(
            f"the model's chat template wrote {len(pieces) - 1} images for the {len(images)} shown"
        )
    expanded = [pieces[0]]
    for image, piece in zip(images, pieces[1:], strict=True):
        size = (image["width"], image["height"])
        try:
            expanded += [rule.expansion(size), piece]
        except ValueError as exc:  # (Qwen's processor: a side 200 times the other)
            raise InvalidImageError(
                f"an image of {size[0]}x{size[1]} pixels: the model's processor refuses it ({exc})"
            ) from None
    tokens = encode("".join(expanded))
    runs, last = 0, -1  # (the last token not between an image's runs of placeholders)
    for i, token in enumerate(tokens):
        if token == rule.placeholder:
            runs += last != rule.placeholder
            if runs <= len(images):
                tokens[i] = image_token(images[runs - 1]["image"])
        if token not in rule.joiners:
            last = token
    if runs != len(images):
        raise ChatTemplateError(
            f"the model's chat template wrote {runs} images for the {len(images)} shown"
        )
    return tokens


async def request_images(
    index: ImageIndex, prompt: list[int], cache: PromptCache | None
) -> dict[str, Any]:
    """A turn's request ``images`` (the bytes of those its prompt shows) and ``image_sizes``
    (of those its cache holds too), by token; nothing where it shows none."""
    shown = image_tokens_in(prompt)
    held = image_tokens_in(cache.tokens) if cache is not None else set()
    if not shown and not held:
        return {}
    data = await index.data(t - IMAGE_BASE for t in shown)
    sizes = await index.sizes(t - IMAGE_BASE for t in shown | held)
    return {
        "images": {IMAGE_BASE + n: b for n, b in data.items()},
        "image_sizes": {IMAGE_BASE + n: size for n, size in sizes.items()},
    }
