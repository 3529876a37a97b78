"""What shape a reply must take: ``response_format`` (OpenAI's chat shape), read into the JSON
Schema the engine holds the reply to (``agentkv.engine.grammar``).

- None or ``{"type": "text"}``: free text;
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: a
  value the schema accepts (``strict`` or not, the reply is held to the schema).
"""

from __future__ import annotations

from typing import Any

from agentkv.errors import InvalidResponseFormatError

FREE = object()  # free text: no grammar


def schema_of(response_format: Any) -> Any:
    """The JSON Schema a ``response_format`` asks for (None: any JSON object), or ``FREE``.
    Raises InvalidResponseFormatError naming what is wrong."""
    if response_format is None:
        return FREE
    if not isinstance(response_format, dict):
        raise InvalidResponseFormatError("response_format: must be an object with a 'type'")
    kind = response_format.get("type")
    if kind == "text":
        return FREE
    if kind == "json_object":
        return None
    if kind != "json_schema":
        raise InvalidResponseFormatError(
            f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidResponseFormatError(
            "response_format.json_schema.schema: required (a JSON Schema object)"
        )
    return spec["schema"]
