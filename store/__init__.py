"""Persistence for agentkv: an async SQLite registry of agents, transcripts and KV cache entries.

Typical use::

    from store import NewMessage, Registry

    async with await Registry.open("data/agentkv.sqlite") as registry:
        agent = await registry.create_agent(system_prompt="You are terse.")
        await registry.append_messages(agent.id, [NewMessage("user", "hi")])
"""

from store.errors import (
    AgentExistsError,
    AgentNotFoundError,
    InvalidAgentIdError,
    InvalidRecordError,
    MigrationError,
    RegistryClosedError,
    StoreError,
)
from store.ids import AGENT_ID_PATTERN, is_valid_agent_id, new_agent_id, validate_agent_id
from store.records import (
    AgentRecord,
    CacheRecord,
    MessageRecord,
    NewCacheEntry,
    NewMessage,
    Role,
)
from store.registry import UNSET, Registry

__all__ = [
    "AGENT_ID_PATTERN",
    "UNSET",
    "AgentExistsError",
    "AgentNotFoundError",
    "AgentRecord",
    "CacheRecord",
    "InvalidAgentIdError",
    "InvalidRecordError",
    "MessageRecord",
    "MigrationError",
    "NewCacheEntry",
    "NewMessage",
    "Registry",
    "RegistryClosedError",
    "Role",
    "StoreError",
    "is_valid_agent_id",
    "new_agent_id",
    "validate_agent_id",
]
