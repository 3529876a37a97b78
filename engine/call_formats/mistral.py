"""Mistral: ``[TOOL_CALLS]NAME[ARGS]`` then one JSON object, no end marker."""

from agentkv.engine.call_formats.call_format import CallFormat, JsonArguments

FORMAT = CallFormat(
    "mistral",
    header=r"(?P<name>[^\s\[]+)\[ARGS\]",
    json_arguments=JsonArguments(head="{name}[ARGS]", tail=""),
)
