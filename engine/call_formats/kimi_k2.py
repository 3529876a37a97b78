"""Kimi K2: a section of calls, each ``<|tool_call_begin|>functions.NAME:N
<|tool_call_argument_begin|>`` then one JSON object and ``<|tool_call_end|>``."""

from agentkv.engine.call_formats.call_format import CallFormat, JsonArguments

FORMAT = CallFormat(
    "kimi_k2",
    header=r"\s*functions\.(?P<name>[^:\s<]+):\d+\s*<\|tool_call_argument_begin\|>",
    call_markers=("<|tool_call_begin|>", "<|tool_call_end|>"),
    json_arguments=JsonArguments(
        head="<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>",
        tail="<|tool_call_end|>",
    ),
)
