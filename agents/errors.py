"""Errors raised by AgentRuntime.

    AgentKVError
    ├── EmptyMessageError (also ValueError)     a turn with no text
    ├── ContextLengthError (also ValueError)    the turn would not fit the model's context
    ├── ChatTemplateError (also ValueError)     the model's chat template refused the messages
    ├── ToolsUnsupportedError (also ValueError) tools sent to a model that cannot call them
    ├── TurnFailedError                         generation failed; the turn was rolled back
    └── RuntimeClosedError                      the runtime was used after close()

Also raised through the runtime, from the packages below it:
``store.AgentNotFoundError`` (unknown agent), ``store.AgentExistsError``,
``store.InvalidAgentIdError`` (an id that could not be a file name), and
``engine.errors.EngineOverloadedError`` (the admission queue is full; retry later).
"""

from __future__ import annotations


class AgentKVError(Exception):
    """Base class of the runtime's own errors."""


class EmptyMessageError(AgentKVError, ValueError):
    """The message is empty or only whitespace."""


class ContextLengthError(AgentKVError, ValueError):
    """History + new turn + max_tokens exceeds the model's context window."""


class ChatTemplateError(AgentKVError, ValueError):
    """The model's chat template cannot render the conversation (e.g. roles must alternate)."""


class ToolsUnsupportedError(AgentKVError, ValueError):
    """The model has no tool-call format mlx-lm knows, so a turn with tools cannot be served."""


class TurnFailedError(AgentKVError):
    """Generation failed. Nothing of the turn was stored; the agent is as it was before."""


class RuntimeClosedError(AgentKVError):
    """The runtime is closed."""
