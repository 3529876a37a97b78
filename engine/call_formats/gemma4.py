"""Gemma 4: ``call:NAME{key:value,...}``, strings between ``<|"|>``."""

from agentkv.engine.call_formats.call_format import CallFormat, CutTags

FORMAT = CallFormat("gemma4", cut=CutTags(r"\Acall:(?P<name>[^{]+)\{|(?=,)", ("}",), r"\}\s*\Z"))
