"""FunctionGemma: ``call:NAME{key:value,...}``, strings between ``<escape>``."""

from agentkv.engine.call_formats.call_format import CallFormat, CutTags

FORMAT = CallFormat(
    "function_gemma", cut=CutTags(r"\Acall:(?P<name>[^{]+)\{|(?=,)", ("}",), r"\}\s*\Z")
)
