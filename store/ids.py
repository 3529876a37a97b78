"""Agent ids: the format rule and generated ids.

An agent id doubles as a file name under the cache directory, so the rule keeps it one safe path
component: 1-64 ASCII letters, digits, ``_``, ``.`` and ``-``, starting with a letter or digit,
and never containing ``..``.
"""

from __future__ import annotations

import re
import uuid

from agentkv.store.errors import InvalidAgentIdError

AGENT_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
AGENT_ID_RULE = (
    f"agent ids must fully match {AGENT_ID_PATTERN} (1-64 ASCII letters, digits, '_', '.', '-', "
    "starting with a letter or digit) and must not contain '..'; "
    "pass agent_id=None to create_agent() to get a generated id"
)
_AGENT_ID_RE = re.compile(AGENT_ID_PATTERN)


def is_valid_agent_id(agent_id: object) -> bool:
    """Whether ``agent_id`` follows the id rule (see the module docstring)."""
    return (
        isinstance(agent_id, str)
        and _AGENT_ID_RE.fullmatch(agent_id) is not None
        and ".." not in agent_id
    )


def validate_agent_id(agent_id: object) -> str:
    """Return ``agent_id`` unchanged if it follows the id rule.

    Raises:
        InvalidAgentIdError: It does not; the message names the value and the rule.
    """
    if isinstance(agent_id, str) and is_valid_agent_id(agent_id):
        return agent_id
    raise InvalidAgentIdError(agent_id, AGENT_ID_RULE)


def new_agent_id() -> str:
    """A fresh random id such as ``agent-3f9c2a7b1d04``."""
    return f"agent-{uuid.uuid4().hex[:12]}"
