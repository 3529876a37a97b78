"""The root of agentkv's errors, and the engine's. This module imports nothing, so every
package (the store included) derives its errors from here without importing MLX.

Exception tree (``AgentKVError`` is the root of every error agentkv raises on purpose; the
store's ``StoreError`` and the runtime's errors derive from it too, see ``agents/errors.py``)::

    AgentKVError(Exception)
    ├── CacheUnusableError                                  a stored cache that cannot be used:
    │   │                                                   the agent is rebuilt from its
    │   │                                                   transcript
    │   ├── CacheFormatError (also EngineError, ValueError) undecodable encoded cache data
    │   ├── store.CacheFileError (also StoreError)          missing, truncated, corrupt file
    │   └── agents.caches.StaleCacheError (also ValueError) another model, format or entry
    └── EngineError
        ├── ModelNotFoundError(EngineError, FileNotFoundError)     no tiny model, no local model dir
        ├── UnknownTinyModelError(EngineError, ValueError)         tiny:<name> that is not defined
        ├── UnsupportedModelError(EngineError, ValueError)         unconvertible GGUF; a model
        │                                                          the batch cannot drive
        ├── ModelInstallError(EngineError, RuntimeError)           package not installable
        ├── OutputDirNotEmptyError(EngineError, FileExistsError)   refusing to overwrite a directory
        ├── InvalidCacheError(EngineError, ValueError)             a KV cache that does not fit
        ├── CacheFormatError(EngineError, ValueError)              undecodable encoded cache data
        ├── KVBudgetError(EngineError, ValueError)                 a turn whose KV can never fit
        │                                                          the batch's memory budget
        ├── EngineClosedError(EngineError, RuntimeError)           no new work is accepted
        └── EngineOverloadedError(EngineError, RuntimeError)       admission queue full; retry later

Each class also derives from the builtin a caller without agentkv in mind would catch, so
``except FileNotFoundError`` still sees a missing model.
"""

from __future__ import annotations


class AgentKVError(Exception):
    """Root of every error agentkv raises on purpose: ``except AgentKVError`` catches them all."""


class CacheUnusableError(AgentKVError):
    """A stored KV cache that cannot be used (unreadable, damaged, or not this model's): its
    agent is rebuilt from the transcript instead."""


class EngineError(AgentKVError):
    """Base class of every error the engine raises on purpose."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model spec names no local model directory and no tiny model."""


class UnknownTinyModelError(EngineError, ValueError):
    """A ``tiny:`` spec that is not one of the built-in tiny models."""


class UnsupportedModelError(EngineError, ValueError):
    """A GGUF file whose architecture, tokenizer or tensors import-gguf cannot convert, or a
    model whose layers the batch cannot drive."""


class ModelInstallError(EngineError, RuntimeError):
    """A packaged model (e.g. ``gemma3-270m``) whose package is missing and cannot be installed."""


class OutputDirNotEmptyError(EngineError, FileExistsError):
    """The output directory already holds something other than the requested build."""


class InvalidCacheError(EngineError, ValueError):
    """A KV cache whose layers, shapes or model do not match the loaded model."""


class CacheFormatError(EngineError, CacheUnusableError, ValueError):
    """Encoded cache data that cannot be decoded: missing or misshapen tensors, bad metadata."""


class KVBudgetError(EngineError, ValueError):
    """A turn that needs more KV memory than the batch's whole budget (``kv_budget_bytes``),
    or a budget too small for any turn. The message gives the numbers."""

    def __init__(self, message: str, *, needed_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes


class EngineClosedError(EngineError, RuntimeError):
    """The engine is closing or closed and takes no new work."""


class EngineOverloadedError(EngineError, RuntimeError):
    """The admission queue is full; the caller should retry later."""
