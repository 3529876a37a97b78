"""agentkv's public API: persistent LLM agents over a continuously batched MLX engine.

    from agentkv import AgentRuntime, RuntimeConfig, SamplingParams

The package's folders: ``agents/`` is this package (the runtime), ``engine/``, ``store/``,
``server/`` and ``migrations/`` its subpackages ``agentkv.engine`` and so on.
"""

import importlib
from typing import TYPE_CHECKING, Any

import agentkv.engine  # noqa: F401  (only the OpenBLAS preload hook: mlx loads it when imported)

if TYPE_CHECKING:
    from agentkv.caches.tiers import CacheInfo
    from agentkv.config import RuntimeConfig
    from agentkv.engine.config import EngineConfig, Policy
    from agentkv.engine.errors import (
        CacheUnusableError,
        EngineOverloadedError,
        KVBudgetError,
        ModelInstallError,
        ModelNotFoundError,
        OutputDirNotEmptyError,
        UnknownTinyModelError,
        UnsupportedModelError,
    )
    from agentkv.engine.request import MAX_TOP_LOGPROBS, TokenLogprob
    from agentkv.engine.sampling import SamplingParams
    from agentkv.errors import (
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
    from agentkv.runtime import AgentRuntime
    from agentkv.store import (
        AgentChangedError,
        AgentExistsError,
        AgentNotFoundError,
        AgentRecord,
        InvalidAgentIdError,
        MessageRecord,
        RegistryStorageError,
        StoreError,
    )
    from agentkv.types import ReasoningDelta, Reply, TextDelta, Timings, Usage

# Every name is imported when first used: ``import agentkv.store`` (which runs this file first)
# loads only the store, and ``from agentkv import RuntimeConfig`` no MLX.
_LAZY = {
    "AgentRuntime": "agentkv.runtime",
    "CacheInfo": "agentkv.caches.tiers",
    "Reply": "agentkv.types",
    "ReasoningDelta": "agentkv.types",
    "TextDelta": "agentkv.types",
    "Timings": "agentkv.types",
    "Usage": "agentkv.types",
    "SamplingParams": "agentkv.engine.sampling",
    "TokenLogprob": "agentkv.engine.request",
    "MAX_TOP_LOGPROBS": "agentkv.engine.request",
    "RuntimeConfig": "agentkv.config",
    "EngineConfig": "agentkv.engine.config",
    "Policy": "agentkv.engine.config",
    **dict.fromkeys(
        [
            "CacheUnusableError",
            "EngineOverloadedError",
            "KVBudgetError",
            "ModelInstallError",
            "ModelNotFoundError",
            "OutputDirNotEmptyError",
            "UnknownTinyModelError",
            "UnsupportedModelError",
        ],
        "agentkv.engine.errors",
    ),
    **dict.fromkeys(
        [
            "AgentKVError",
            "ChatTemplateError",
            "ContextLengthError",
            "EmptyMessageError",
            "InvalidMessageError",
            "InvalidResponseFormatError",
            "RuntimeClosedError",
            "ToolsUnsupportedError",
            "TurnFailedError",
            "WorkerIdInUseError",
        ],
        "agentkv.errors",
    ),
    **dict.fromkeys(
        [
            "AgentChangedError",
            "AgentExistsError",
            "AgentNotFoundError",
            "AgentRecord",
            "InvalidAgentIdError",
            "MessageRecord",
            "RegistryStorageError",
            "StoreError",
        ],
        "agentkv.store",
    ),
}


def __dir__() -> list[str]:
    return sorted(globals().keys() | _LAZY.keys())


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "MAX_TOP_LOGPROBS",
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
    "ModelInstallError",
    "ModelNotFoundError",
    "OutputDirNotEmptyError",
    "Policy",
    "ReasoningDelta",
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
    "UnknownTinyModelError",
    "UnsupportedModelError",
    "Usage",
    "WorkerIdInUseError",
]
