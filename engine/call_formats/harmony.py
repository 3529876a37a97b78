"""OpenAI's harmony (gpt-oss): a call is a ``commentary`` message to ``functions.NAME`` whose
text is one JSON object; the whole reply is the format's, its analysis message first if it
reasons (``agentkv.harmony`` reads it with openai-harmony)."""

from agentkv.engine.call_formats.call_format import CallFormat, JsonArguments

FORMAT = CallFormat(
    "harmony",
    header=(
        r"assistant to=functions\.(?P<name>[^<\s]+)<\|channel\|>commentary"
        r"(?: <\|constrain\|>json| json)?<\|message\|>"
    ),
    json_arguments=JsonArguments(
        head="<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
        tail="<|call|>",
        thinking="<|channel|>analysis<|message|>",
        thought="<|end|><|start|>assistant",
        final="<|channel|>final<|message|>",
    ),
)
