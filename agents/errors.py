"""Errors raised by AgentRuntime, and the one root every agentkv error derives from.

``except AgentKVError`` catches every error agentkv raises on purpose, whichever package it
comes from::

    AgentKVError
    ├── InvalidMessageError (also ValueError)   a message's text cannot be used (lone UTF-16
    │   │                                       surrogates, not a string)
    │   ├── EmptyMessageError                   a turn with no text
    │   └── InvalidImageError                   an image that cannot be read, or too large
    ├── ContextLengthError (also ValueError)    the turn would not fit the model's context
    ├── ChatTemplateError (also ValueError)     the model's chat template refused the messages
    ├── ToolsUnsupportedError (also ValueError) tools sent to a model that cannot call them
    ├── TurnFailedError                         generation failed; the turn was rolled back
    ├── RuntimeClosedError                      the runtime was used after close()
    ├── WorkerIdInUseError (also ValueError)    another live process runs as this worker id
    ├── engine.errors.CacheUnusableError        a stored cache that cannot be used (the agent
    │                                           is rebuilt): CacheFormatError, CacheFileError,
    │                                           StaleCacheError
    ├── store.StoreError                        the registry and cache files: AgentNotFoundError,
    │                                           AgentExistsError, InvalidAgentIdError,
    │                                           RegistryStorageError (disk full, read-only), ...
    └── engine.errors.EngineError               EngineOverloadedError (queue full; retry later),
                                                KVBudgetError (the turn's history + max_tokens
                                                can never fit the batch's KV budget),
                                                ModelNotFoundError, CacheFormatError, ...
"""

from __future__ import annotations

from agentkv.engine.errors import AgentKVError

__all__ = [
    "AgentKVError",
    "ChatTemplateError",
    "ContextLengthError",
    "EmptyMessageError",
    "InvalidImageError",
    "InvalidMessageError",
    "RuntimeClosedError",
    "ToolsUnsupportedError",
    "TurnFailedError",
    "WorkerIdInUseError",
]


class InvalidMessageError(AgentKVError, ValueError):
    """A message's text cannot be stored or tokenized (e.g. it holds a lone UTF-16 surrogate)."""


class EmptyMessageError(InvalidMessageError):
    """The message is empty or only whitespace."""


class InvalidImageError(InvalidMessageError):
    """An image that is not a PNG, JPEG, WebP or GIF, cannot be decoded, or is too large
    (bytes, pixels, images in one message). The message names which and why."""


class ContextLengthError(AgentKVError, ValueError):
    """History + new turn + max_tokens exceeds the model's context window."""


class ChatTemplateError(AgentKVError, ValueError):
    """The model's chat template cannot render the conversation (e.g. roles must alternate)."""


class ToolsUnsupportedError(AgentKVError, ValueError):
    """The model has no tool-call format mlx-lm knows, so a turn with tools cannot be served."""


class InvalidResponseFormatError(AgentKVError, ValueError):
    """A ``response_format`` (or forced ``tool_choice``) that is malformed, or whose JSON Schema
    cannot be compiled. The message starts with the field it names and a colon."""

    @property
    def field(self) -> str:
        """The field the message names, e.g. ``response_format.json_schema.schema``."""
        return str(self).partition(": ")[0]


class TurnFailedError(AgentKVError):
    """Generation failed. Nothing of the turn was stored; the agent is as it was before."""


class RuntimeClosedError(AgentKVError):
    """The runtime is closed."""


def check_text(text: object, where: str) -> str:
    """``text`` if it is a string that UTF-8 can encode, else InvalidMessageError naming ``where``.

    JSON allows ``"\\ud800"`` escapes that decode to lone surrogates, which neither SQLite's
    UTF-8 nor the tokenizer can take.
    """
    if not isinstance(text, str):
        raise InvalidMessageError(f"{where} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(
            f"{where} is not valid Unicode text: a lone surrogate {text[exc.start]!r} at "
            f"character {exc.start}; send UTF-8 text (pair or drop the surrogate)"
        ) from None
    return text


class WorkerIdInUseError(AgentKVError, ValueError):
    """Another live process on this data directory runs as the worker id asked for."""
