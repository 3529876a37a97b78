"""Hermes, Qwen2.5, Qwen3: one JSON object naming the function between ``<tool_call>`` tags."""

from agentkv.engine.call_formats.call_format import CallFormat

FORMAT = CallFormat(
    "json_tools",
    header=r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"arguments"\s*:',
    json_object=True,
)
