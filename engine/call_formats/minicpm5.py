"""MiniCPM 5: ``<function name="NAME">`` with ``<param name="KEY">`` tags."""

from agentkv.engine.call_formats.call_format import CallFormat, CutTags

FORMAT = CallFormat("minicpm5", cut=CutTags(r'\A"(?P<name>[^"]+)">|</param>', ("",)))
