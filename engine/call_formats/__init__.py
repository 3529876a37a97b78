"""Tool-call formats as peers (``call_format.CallFormat``), one module each, by the mlx-lm
parser that reads them (and harmony): a new format is a module and a line here."""

from agentkv.engine.call_formats import (
    function_gemma,
    gemma4,
    glm47,
    harmony,
    json_tools,
    kimi_k2,
    kimi_k3,
    longcat,
    minicpm5,
    minimax_m2,
    mistral,
    muse_spark,
    pythonic,
    qwen3_coder,
)
from agentkv.engine.call_formats.call_format import CallFormat, CutTags, JsonArguments, Tagged

FORMATS: dict[str, CallFormat] = {
    f.name: f
    for f in (
        json_tools.FORMAT,
        qwen3_coder.FORMAT,
        glm47.FORMAT,
        longcat.FORMAT,
        minimax_m2.FORMAT,
        mistral.FORMAT,
        kimi_k2.FORMAT,
        kimi_k3.FORMAT,
        gemma4.FORMAT,
        function_gemma.FORMAT,
        minicpm5.FORMAT,
        muse_spark.FORMAT,
        pythonic.FORMAT,
        harmony.FORMAT,
    )
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
    "TOOL_CALL_STYLES",
    "UNKNOWN",
    "CallFormat",
    "CutTags",
    "JsonArguments",
    "Tagged",
    "call_format",
]
