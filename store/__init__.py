"""Persistence for agentkv: an async registry of agents, transcripts and KV cache entries
(SQLite, or PostgreSQL for workers that share it), and the cache files.

Typical use::

    from agentkv.store import NewMessage, Registry

    async with await Registry.open("data/agentkv.sqlite") as registry:
        agent = await registry.create_agent(system_prompt="You are terse.")
        await registry.append_messages(agent.id, [NewMessage("user", "hi")])

KV cache files (safetensors + checksum, atomic) are written off the event loop by one thread;
a newer job for the same key replaces one that has not started::

    writer = CacheWriter()
    job = partial(write_cache_file, cache_dir / rel_path, tensors, metadata)
    info = await asyncio.wrap_future(writer.submit(agent.id, job))
    if info is not None:  # None: a newer job for this agent superseded this one
        await registry.caches.set(agent.id, NewCacheEntry(rel_path, ..., message_count=n))
        cache = read_cache_file(cache_dir / rel_path, expected_checksum=info.checksum)
    await asyncio.to_thread(writer.close)  # finishes the queued jobs, then stops the thread
"""

from agentkv.store.cache_files import (
    CacheFile,
    CacheFileInfo,
    read_cache_file,
    remove_cache_file,
    write_cache_file,
)
from agentkv.store.errors import (
    AgentChangedError,
    AgentExistsError,
    AgentNotFoundError,
    BlocksMissingError,
    CacheFileCorruptError,
    CacheFileError,
    CacheFileMissingError,
    CacheWriterClosedError,
    Corruption,
    InvalidAgentIdError,
    InvalidRecordError,
    MigrationError,
    RegistryClosedError,
    RegistryStorageError,
    ResponseNotFoundError,
    StoreError,
)
from agentkv.store.ids import AGENT_ID_PATTERN, is_valid_agent_id, new_agent_id, validate_agent_id
from agentkv.store.images import content_key
from agentkv.store.leases import Lease, LeaseIndex
from agentkv.store.records import (
    MAX_NAME_CHARS,
    AgentRecord,
    CacheRecord,
    DiskUsage,
    MessageRecord,
    NewBlock,
    NewCacheEntry,
    NewMessage,
    NewResponse,
    ResponseRecord,
    Role,
    StoredBlock,
)
from agentkv.store.registry import Registry
from agentkv.store.responses import ResponseIndex
from agentkv.store.writer import CacheWriter, JobFuture

__all__ = [
    "AGENT_ID_PATTERN",
    "MAX_NAME_CHARS",
    "AgentChangedError",
    "AgentExistsError",
    "AgentNotFoundError",
    "AgentRecord",
    "BlocksMissingError",
    "CacheFile",
    "CacheFileCorruptError",
    "CacheFileError",
    "CacheFileInfo",
    "CacheFileMissingError",
    "CacheRecord",
    "CacheWriter",
    "CacheWriterClosedError",
    "Corruption",
    "DiskUsage",
    "InvalidAgentIdError",
    "InvalidRecordError",
    "JobFuture",
    "Lease",
    "LeaseIndex",
    "MessageRecord",
    "MigrationError",
    "NewBlock",
    "NewCacheEntry",
    "NewMessage",
    "NewResponse",
    "Registry",
    "RegistryClosedError",
    "RegistryStorageError",
    "ResponseIndex",
    "ResponseNotFoundError",
    "ResponseRecord",
    "Role",
    "StoreError",
    "StoredBlock",
    "content_key",
    "is_valid_agent_id",
    "new_agent_id",
    "read_cache_file",
    "remove_cache_file",
    "validate_agent_id",
    "write_cache_file",
]
