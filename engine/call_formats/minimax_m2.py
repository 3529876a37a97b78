"""MiniMax M2: ``<invoke name="NAME">`` and ``<parameter name="KEY">`` tags in one section."""

from agentkv.engine.call_formats.call_format import CallFormat, CutTags, Tagged

FORMAT = CallFormat(
    "minimax_m2",
    tagged=Tagged(
        name='\n<invoke name="{name}">\n',
        key='<parameter name="{key}">',
        value_end="</parameter>\n",
        call_end="</invoke>\n",
    ),
    cut=CutTags(
        r'<invoke name="(?P<name>[^"]+)">|</parameter>',
        ("\n</invoke>\n", "</invoke>"),
        r"</invoke>\s*\Z",
    ),
)
