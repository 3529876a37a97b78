"""Qwen3-Coder's XML (Qwen 3.5, Qwen3-Coder, Qwen3-Next): ``<function=NAME>`` and
``<parameter=KEY>`` tags."""

from agentkv.engine.call_formats.call_format import CallFormat, CutTags, Tagged

FORMAT = CallFormat(
    "qwen3_coder",
    tagged=Tagged(
        name="\n<function={name}>\n",
        key="<parameter={key}>\n",
        value_end="\n</parameter>\n",
        call_end="</function>\n",
    ),
    cut=CutTags(
        r"<function=(?P<name>[^>\n]+)>|</parameter>",
        ("\n</function>\n", "</function>"),
        r"</function>\s*\Z",
    ),
)
