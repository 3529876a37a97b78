"""Kimi K3: ``<|open|>call tool="NAME"`` and ``<|open|>argument key="KEY"`` blocks."""

from agentkv.engine.call_formats.call_format import CallFormat, CutTags

FORMAT = CallFormat(
    "kimi_k3",
    cut=CutTags(
        r'<\|open\|>call tool="(?P<name>[^"]+)"[^<]*<\|sep\|>|<\|close\|>argument<\|sep\|>',
        ("<|close|>call<|sep|>",),
        r"<\|close\|>call<\|sep\|>\s*\Z",
    ),
)
