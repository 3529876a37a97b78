"""GLM-4.5 to 4.7 (and Poolside Laguna, which mlx-lm reads with the same parser): the name,
then ``<arg_key>`` / ``<arg_value>`` tags."""

from agentkv.engine.call_formats.call_format import CallFormat, CutTags, Tagged

FORMAT = CallFormat(
    "glm47",
    tagged=Tagged(
        name="{name}",
        key="<arg_key>{key}</arg_key><arg_value>",
        value_end="</arg_value>",
        call_end="",
    ),
    cut=CutTags(r"\A(?P<name>[^\n<]+)(?=[\n<])|</arg_value>", ("",)),
)
