"""Validation of registry inputs that are not records of their own: agent fields, message batches.

Every failure is an ``InvalidRecordError`` (a ``ValueError``) naming the field and what to pass.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentkv.store.errors import InvalidRecordError
from agentkv.store.records import MAX_FINGERPRINT_CHARS, MAX_NAME_CHARS, NewMessage, Role

_ROLES = frozenset(role.value for role in Role)


def agent_fields(**fields: Any) -> dict[str, Any]:
    """Validate agent columns given by keyword; return them (``sampling`` copied)."""
    name = fields.get("name")
    if "name" in fields and (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS):
        shown = f"<{len(name)} characters>" if isinstance(name, str) and name else repr(name)
        raise InvalidRecordError(f"name={shown}: expected a str of 1-{MAX_NAME_CHARS} characters")
    prompt = fields.get("system_prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidRecordError(f"system_prompt={prompt!r}: expected a str or None")
    fingerprint = fields.get("model_fingerprint")
    if fingerprint is not None and (
        not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= MAX_FINGERPRINT_CHARS
    ):
        raise InvalidRecordError(
            f"model_fingerprint={fingerprint!r}: expected None or a str of "
            f"1-{MAX_FINGERPRINT_CHARS} characters"
        )
    ttl = fields.get("idle_ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
        raise InvalidRecordError(f"idle_ttl_s={ttl!r}: expected None or an int >= 1 (seconds)")
    if fields.get("tools") is not None:
        tools = fields["tools"]
        try:
            fields["tools"] = json.loads(json.dumps(tools, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise InvalidRecordError(f"tools: not JSON-serialisable ({exc})") from exc
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidRecordError("tools: expected None or a list of JSON objects")
    if "sampling" in fields:
        sampling = fields["sampling"]
        try:
            # A JSON round trip copies it and proves it will come back out of the column equal.
            fields["sampling"] = json.loads(json.dumps(sampling, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise InvalidRecordError(
                f"sampling={sampling!r}: not JSON-serialisable ({exc})"
            ) from exc
        if not isinstance(sampling, dict) or fields["sampling"] != sampling:
            raise InvalidRecordError(
                f"sampling={sampling!r}: expected a dict with str keys and JSON values"
            )
    return fields


def new_messages(messages: Sequence[NewMessage]) -> list[NewMessage]:
    """Return the batch as a list after checking it is non-empty and every message valid."""
    batch = list(messages)
    if not batch:
        raise InvalidRecordError("messages is empty: pass at least one NewMessage")
    for index, message in enumerate(batch):
        if not isinstance(message, NewMessage):
            raise InvalidRecordError(
                f"messages[{index}] is a {type(message).__name__}, expected a NewMessage"
            )
        if not isinstance(message.role, str) or message.role not in _ROLES:
            raise InvalidRecordError(
                f"messages[{index}].role={message.role!r}: expected one of "
                f"{', '.join(role.value for role in Role)}"
            )
        if not isinstance(message.content, str):
            raise InvalidRecordError(
                f"messages[{index}].content is a {type(message.content).__name__}, expected str"
            )
        if message.token_count is not None and not _is_count(message.token_count):
            raise InvalidRecordError(
                f"messages[{index}].token_count={message.token_count!r}: "
                "expected None or an int >= 0"
            )
    return batch


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_limit(limit: object) -> None:
    """Check that a page size is an int >= 1."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidRecordError(f"limit={limit!r}: expected an int >= 1")


def check_count(name: str, value: object) -> None:
    """Check that ``value`` is an int >= 0 (a position or a count)."""
    if not _is_count(value):
        raise InvalidRecordError(f"{name}={value!r}: expected an int >= 0")
