"""The tool-call formats a call can be forced in (``tool_choice``), by the mlx-lm parser that
reads each: what ``engine.grammar`` writes around a forced call's name and arguments."""

TAGGED = {
    # Qwen3-Coder's XML (Qwen 3.5, Qwen3-Coder, Qwen3-Next).
    "qwen3_coder": {
        "name": "\n<function={name}>\n",
        "key": "<parameter={key}>\n",
        "value_end": "\n</parameter>\n",
        "call_end": "</function>\n",
    },
    # GLM-4.5 to 4.7 (and Poolside Laguna, which mlx-lm reads with the same parser).
    "glm47": {
        "name": "{name}",
        "key": "<arg_key>{key}</arg_key><arg_value>",
        "value_end": "</arg_value>",
        "call_end": "",
    },
    "longcat": {
        "name": "{name}",
        "key": "<longcat_arg_key>{key}</longcat_arg_key><longcat_arg_value>",
        "value_end": "</longcat_arg_value>",
        "call_end": "",
    },
    "minimax_m2": {
        "name": '\n<invoke name="{name}">\n',
        "key": '<parameter name="{key}">',
        "value_end": "</parameter>\n",
        "call_end": "</invoke>\n",
    },
}
"""Formats that write a call's name, then each argument's key and value in tags (the texts
around the name, a key, after a value, and after the call), as their chat templates do."""
JSON_ARGUMENTS = {
    "mistral": {"head": "{name}[ARGS]", "tail": ""},
    "kimi_k2": {
        "head": "<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>",
        "tail": "<|tool_call_end|>",
    },
    # OpenAI's harmony (gpt-oss): the whole reply, its analysis message first if it reasons.
    "harmony": {
        "head": "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
        "tail": "<|call|>",
        "thinking": "<|channel|>analysis<|message|>",
        "thought": "<|end|><|start|>assistant",
        "final": "<|channel|>final<|message|>",  # a JSON reply (response_format)
    },
}
"""Formats that write a call's name in a header, then its arguments as one JSON object (and,
in a format whose reasoning is a message of its own, that message before it)."""
TOOL_CALL_STYLES = ("json_tools", *TAGGED, *JSON_ARGUMENTS)
"""The tool-call formats a call can be forced in, by the mlx-lm parser that reads them."""

__all__ = ["JSON_ARGUMENTS", "TAGGED", "TOOL_CALL_STYLES"]
