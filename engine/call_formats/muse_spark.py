"""Muse Spark: ``<atem:invoke name="NAME">`` and ``<atem:parameter name="KEY">`` tags."""

from agentkv.engine.call_formats.call_format import CallFormat, CutTags

FORMAT = CallFormat(
    "muse_spark",
    cut=CutTags(
        r'<atem:invoke name="(?P<name>[^"]+)">|</atem:parameter>',
        ("</atem:invoke>",),
        r"</atem:invoke>\s*\Z",
    ),
)
