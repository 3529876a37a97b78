"""Tool-call formats as peers (``call_format.CallFormat``), one module each, by the mlx-lm
parser that reads them (and harmony): a new format is a module and a line in ``MODULES``."""

import importlib

from agentkv.engine.call_formats.call_format import CallFormat, CutTags, JsonArguments, Tagged

MODULES = (  # the registry: a format's module, a line each
    "json_tools",
    "qwen3_coder",
    "glm47",
    "longcat",
    "minimax_m2",
    "mistral",
    "kimi_k2",
    "kimi_k3",
    "gemma4",
    "function_gemma",
    "minicpm5",
    "muse_spark",
    "pythonic",
    "harmony",
)
FORMATS: dict[str, CallFormat] = {
    form.name: form for form in (importlib.import_module(f"{__name__}.{m}").FORMAT for m in MODULES)
}
"""Every format agentkv knows, by name (``ToolFormat.style``)."""
UNKNOWN = CallFormat("unknown")
"""A format no module describes: its calls are parsed, not streamed, forced or read cut."""
TOOL_CALL_STYLES = tuple(name for name, f in FORMATS.items() if f.forcible)
"""The formats a call can be forced in."""


def call_format(name: str) -> CallFormat:
    """The format of that name (:data:`UNKNOWN` for one no module describes)."""
    return FORMATS.get(name, UNKNOWN)


__all__ = [
    "FORMATS",
    "MODULES",
    "TOOL_CALL_STYLES",
    "UNKNOWN",
    "CallFormat",
    "CutTags",
    "JsonArguments",
    "Tagged",
    "call_format",
]
