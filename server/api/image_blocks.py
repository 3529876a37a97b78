"""Images as the HTTP APIs send them: Anthropic ``image`` blocks (base64), OpenAI ``image_url``
parts and Responses ``input_image`` items (data URLs). Each becomes a content part holding the
image's bytes, ``{"type": "image", "data": <bytes>}``, which the runtime checks (format, size),
stores once by content and renders (``agentkv.images``). Remote URLs are refused: this server
fetches nothing."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from typing import Any

from agentkv.images import MAX_IMAGE_BYTES
from agentkv.server.errors import APIError

_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,", re.A)
_MAX_BASE64 = (MAX_IMAGE_BYTES + 2) // 3 * 4


def image_part(data: bytes) -> dict[str, Any]:
    """An image's content part: its bytes and their SHA-256 (what conversations are matched
    by, ``agentkv.store.images.content_key``)."""
    return {"type": "image", "data": data, "sha256": hashlib.sha256(data).hexdigest()}


def base64_image(data: object, where: str) -> dict[str, Any]:
    """An image part of base64 text (a 400 naming ``where`` unless it decodes)."""
    if not isinstance(data, str) or not data:
        raise APIError.invalid(f"{where}: the image's base64 data is missing", where)
    if len(data) > _MAX_BASE64 + 4:
        raise APIError.invalid(
            f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes; send a smaller one", where
        )
    try:
        return image_part(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        raise APIError.invalid(f"{where}: the image's data is not base64", where) from None


def url_image(url: object, where: str) -> dict[str, Any]:
    """An image part of a ``data:`` URL; any other URL is refused (nothing is fetched)."""
    if not isinstance(url, str) or not url:
        raise APIError.invalid(f"{where}: the image's URL is missing", where)
    match = _DATA_URL.match(url)
    if match is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "no scheme"
        raise APIError.invalid(
            f"{where}: {scheme!r} image URLs are not fetched by this server; send the image "
            "inline as a data URL (data:image/png;base64,...)",
            where,
        )
    return base64_image(url[match.end() :], where)


def anthropic_image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An Anthropic ``image`` block (``source.type`` ``base64``; ``url`` is refused)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return base64_image(source.get("data"), f"{where}.source.data")
    if kind == "url":
        return url_image(source.get("url"), f"{where}.source.url")
    raise APIError.invalid(
        f"{where}.source: an image source of type {kind!r}; send type 'base64'", where
    )


def openai_image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """A Chat Completions ``image_url`` part (``image_url.url``, a data URL)."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    return url_image(url, f"{where}.image_url.url")


def responses_image(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A Responses ``input_image`` item (``image_url``, a data URL; ``file_id`` is refused)."""
    if item.get("image_url") is None and item.get("file_id") is not None:
        raise APIError.invalid(
            f"{where}.file_id: uploaded files are not kept by this server; send the image "
            "inline as image_url (a data URL)",
            f"{where}.file_id",
        )
    return url_image(item.get("image_url"), f"{where}.image_url")


def joined(parts: list[dict[str, Any]], joiner: str) -> str | list[dict[str, Any]]:
    """A message's content: its text parts joined when it holds no image, else its parts."""
    if all(p["type"] == "text" for p in parts):
        return joiner.join(p["text"] for p in parts)
    return list(parts)


def merged(first: Any, second: Any, joiner: str) -> str | list[dict[str, Any]]:
    """Two messages' contents as one (text joined; parts, where either holds an image)."""
    if isinstance(first, str) and isinstance(second, str):
        return joiner.join((first, second))

    def parts(content: Any) -> list[dict[str, Any]]:
        return content if isinstance(content, list) else [{"type": "text", "text": content}]

    return [*parts(first), *parts(second)]
