"""LongCat: the name, then ``<longcat_arg_key>`` / ``<longcat_arg_value>`` tags."""

from agentkv.engine.call_formats.call_format import CallFormat, CutTags, Tagged

FORMAT = CallFormat(
    "longcat",
    tagged=Tagged(
        name="{name}",
        key="<longcat_arg_key>{key}</longcat_arg_key><longcat_arg_value>",
        value_end="</longcat_arg_value>",
        call_end="",
    ),
    cut=CutTags(r"\A(?P<name>[^\n<]+)(?=[\n<])|</longcat_arg_value>", ("",)),
)
