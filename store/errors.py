"""Exceptions raised by the agent registry.

Every error the store raises on purpose derives from :class:`StoreError`, so callers can catch
the whole family or one specific class::

    StoreError
    ├── InvalidAgentIdError  (also ValueError)   the id breaks the format rule; DB not touched
    ├── InvalidRecordError   (also ValueError)   a field of an agent, message or cache entry is bad
    ├── AgentNotFoundError   (also LookupError)  no agent with that id
    ├── AgentExistsError                         create_agent with an id already in use
    ├── RegistryClosedError                      the registry was used after close()
    └── MigrationError                           the database could not be brought to schema head

SQLAlchemy errors that are not one of these (a full disk, a corrupt file) propagate unchanged.
"""

from __future__ import annotations

_MAX_SHOWN = 80


def _shown(value: object) -> str:
    """``repr(value)``, shortened so a megabyte of junk does not end up in a log line."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else f"{text[: _MAX_SHOWN - 3]}..."


class StoreError(Exception):
    """Base class of every error raised by the store."""


class InvalidAgentIdError(StoreError, ValueError):
    """An agent id does not follow the id rule; raised before any database access.

    Attributes:
        agent_id: The rejected value, exactly as given.
    """

    def __init__(self, agent_id: object, rule: str) -> None:
        self.agent_id = agent_id
        super().__init__(f"invalid agent id {_shown(agent_id)}: {rule}")


class InvalidRecordError(StoreError, ValueError):
    """A field of an agent, message or cache entry has a value the store cannot keep."""


class AgentNotFoundError(StoreError, LookupError):
    """No agent with the given id exists.

    Attributes:
        agent_id: The id that was looked up.
    """

    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        super().__init__(
            f"no agent with id {agent_id!r}; create it with create_agent() "
            "or pick one from list_agents()"
        )


class AgentExistsError(StoreError):
    """``create_agent`` was given an id that is already taken.

    Attributes:
        agent_id: The id that is already in use.
    """

    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        super().__init__(
            f"an agent with id {agent_id!r} already exists; choose another id, "
            "pass agent_id=None to generate one, or delete_agent() it first"
        )


class RegistryClosedError(StoreError):
    """The registry was used after ``close()``; open a new one with ``Registry.open``."""


class MigrationError(StoreError):
    """The database could not be migrated to the schema this code expects."""
