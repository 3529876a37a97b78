"""agentkv's public API: persistent LLM agents over a continuously batched MLX engine.

from agents import AgentRuntime, RuntimeConfig, SamplingParams
"""

import importlib
from typing import TYPE_CHECKING, Any

from agents.config import RuntimeConfig
from agents.errors import (
    AgentKVError,
    ChatTemplateError,
    ContextLengthError,
    EmptyMessageError,
    InvalidMessageError,
    InvalidResponseFormatError,
    RuntimeClosedError,
    ToolsUnsupportedError,
    TurnFailedError,
    WorkerIdInUseError,
)
from engine.config import EngineConfig, Policy
from engine.errors import CacheUnusableError, EngineOverloadedError, KVBudgetError
from store import (
    AgentChangedError,
    AgentExistsError,
    AgentNotFoundError,
    AgentRecord,
    InvalidAgentIdError,
    MessageRecord,
    RegistryStorageError,
    StoreError,
)

if TYPE_CHECKING:
    from agents.caches.tiers import CacheInfo
    from agents.runtime import AgentRuntime
    from agents.types import Reply, TextDelta, Timings, Usage
    from engine.request import TokenLogprob
    from engine.sampling import SamplingParams

# Imported when first used: these load MLX, which configuring a runtime or catching its errors
# does not need (``from agents import RuntimeConfig`` stays light).
_LAZY = {
    "AgentRuntime": "agents.runtime",
    "CacheInfo": "agents.caches.tiers",
    "Reply": "agents.types",
    "TextDelta": "agents.types",
    "Timings": "agents.types",
    "Usage": "agents.types",
    "SamplingParams": "engine.sampling",
    "TokenLogprob": "engine.request",
}


def __dir__() -> list[str]:
    return sorted(globals().keys() | _LAZY.keys())


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agents' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AgentChangedError",
    "AgentExistsError",
    "AgentKVError",
    "AgentNotFoundError",
    "AgentRecord",
    "AgentRuntime",
    "CacheInfo",
    "CacheUnusableError",
    "ChatTemplateError",
    "ContextLengthError",
    "EmptyMessageError",
    "EngineConfig",
    "EngineOverloadedError",
    "InvalidAgentIdError",
    "InvalidMessageError",
    "InvalidResponseFormatError",
    "KVBudgetError",
    "MessageRecord",
    "Policy",
    "RegistryStorageError",
    "Reply",
    "RuntimeClosedError",
    "RuntimeConfig",
    "SamplingParams",
    "StoreError",
    "TextDelta",
    "Timings",
    "TokenLogprob",
    "ToolsUnsupportedError",
    "TurnFailedError",
    "Usage",
    "WorkerIdInUseError",
]
