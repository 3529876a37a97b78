"""agentkv's public API: persistent LLM agents over a continuously batched MLX engine.

from agents import AgentRuntime, RuntimeConfig, SamplingParams
"""

import engine  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx.core)

from agents.config import RuntimeConfig
from agents.errors import (
    AgentKVError,
    ChatTemplateError,
    ContextLengthError,
    EmptyMessageError,
    InvalidMessageError,
    RuntimeClosedError,
    ToolsUnsupportedError,
    TurnFailedError,
)
from agents.runtime import AgentRuntime
from agents.types import CacheInfo, Reply, TextDelta, Timings, Usage
from engine.config import EngineConfig, Policy
from engine.errors import EngineOverloadedError, KVBudgetError
from engine.sampling import SamplingParams
from store import (
    AgentExistsError,
    AgentNotFoundError,
    AgentRecord,
    InvalidAgentIdError,
    MessageRecord,
    RegistryStorageError,
    StoreError,
)

__all__ = [
    "AgentExistsError",
    "AgentKVError",
    "AgentNotFoundError",
    "AgentRecord",
    "AgentRuntime",
    "CacheInfo",
    "ChatTemplateError",
    "ContextLengthError",
    "EmptyMessageError",
    "EngineConfig",
    "EngineOverloadedError",
    "InvalidAgentIdError",
    "InvalidMessageError",
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
    "ToolsUnsupportedError",
    "TurnFailedError",
    "Usage",
]
