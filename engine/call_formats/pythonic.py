"""Pythonic calls (LFM2 and others): ``[NAME(key=value, ...)]``."""

from agentkv.engine.call_formats.call_format import CallFormat, CutTags

FORMAT = CallFormat(
    "pythonic", cut=CutTags(r"\A\s*\[\s*(?P<name>[\w.]+)\(|(?=,)", (")]",), r"\)\s*\]\s*\Z")
)
