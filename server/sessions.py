"""Agent ids a request names or implies: a Claude Code session's agent, an agent named by
``metadata.user_id`` / ``user``, and the prefixes of the agents the server creates itself; and
the per-request metadata lines clients put in system prompts, which are dropped so that the
prompt's prefix stays the same from one request to the next."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from agentkv.store import is_valid_agent_id

VOLATILE_LINES = re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)
"""Lines that carry no instruction and change from request to request: Claude Code's billing
attribution (``x-anthropic-billing-header: cc_version=2.1.330.a1b; cc_entrypoint=cli;``, its
suffix new for every prompt), the first block of its system prompt."""

_VOLATILE_PREFIX = "x-anthropic-billing-header:"

STATELESS_PREFIX = "stateless-"
SESSION_PREFIX = "claude-code-"
RESPONSES_SESSION_PREFIX = "session-"  # sessions named by Responses API clients (Codex)
_LEGACY_SESSION = re.compile(r"_session_([0-9A-Za-z-]{8,64})$")


def without_volatile_lines(system: Any) -> Any:
    """A system prompt (a string or a list of text blocks) without :data:`VOLATILE_LINES`; a
    block left with no text is dropped. Anything else is returned as it is (and refused later,
    by whoever checks it)."""
    if isinstance(system, str):
        return _without_volatile(system)
    if not isinstance(system, list):
        return system
    kept = []
    for block in system:
        text = block.get("text") if isinstance(block, dict) else None
        if isinstance(text, str) and _VOLATILE_PREFIX in text:
            text = _without_volatile(text)
            if not text:
                continue
            block = {**block, "text": text}
        kept.append(block)
    return kept


def session_of(user_id: str | None) -> str | None:
    """The Claude Code session in a ``metadata.user_id``: JSON with a ``session_id`` (current
    Claude Code), or ``user_<hash>_account_<uuid>_session_<uuid>`` (older versions)."""
    if not user_id:
        return None
    try:
        data = json.loads(user_id)
    except (ValueError, RecursionError):
        match = _LEGACY_SESSION.search(user_id)
        return match.group(1) if match else None
    session = data.get("session_id") if isinstance(data, dict) else None
    return session if isinstance(session, str) and session else None


def _without_volatile(text: str) -> str:
    # A regex scan of a long prompt holds the GIL throughout (the event loop waits); finding
    # the prefix first is a fast search.
    return VOLATILE_LINES.sub("", text) if _VOLATILE_PREFIX in text else text


def named_agent(user_id: str | None) -> str | None:
    """``user_id`` when it can be an agent id (other ids just identify a user: ignored)."""
    return user_id if user_id is not None and is_valid_agent_id(user_id) else None


def session_agent_id(
    session: str, tools: list[dict[str, Any]] | None, prefix: str = SESSION_PREFIX
) -> str:
    """``<prefix><session>-<tool set>`` (``claude-code-`` for Claude Code): a session's main
    conversation and its side requests (titles, summaries: other prompts, no tools) each keep
    their own agent and cache."""
    names = sorted(t.get("function", t).get("name", "") for t in tools or [])
    tool_set = hashlib.sha256(json.dumps(names).encode()).hexdigest()[:8]
    if not is_valid_agent_id(f"{prefix}{session}-{tool_set}"):
        session = hashlib.sha256(session.encode()).hexdigest()[:40]
    return f"{prefix}{session}-{tool_set}"
