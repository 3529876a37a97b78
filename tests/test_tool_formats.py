"""Every tool-call format mlx-lm parses, split out of a reply by ``ToolFormat``: the text
around the call stays text, the call comes back with its name and arguments.

Each sample is a call written as that family's model writes it (``mlx_lm.tool_parsers``
names the markers and reads what is between them). A parser mlx-lm adds without a sample
here fails the test that lists them, so a new format is looked at, not assumed to work.
"""

from __future__ import annotations

import importlib
import json
import pkgutil

import mlx_lm.tool_parsers
import pytest

from agentkv.cut_calls import partial_object
from agentkv.tool_calls import ParsedReply, ToolCall, ToolFormat

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
SAMPLES = {
    "json_tools": '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "qwen3_coder": (
        "<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
        "</tool_call>"
    ),
    "glm47": (
        "<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"
    ),
    "laguna": "<tool_call>weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
    "longcat": (
        "<longcat_tool_call>weather\n<longcat_arg_key>city</longcat_arg_key>\n"
        "<longcat_arg_value>Oslo</longcat_arg_value>\n</longcat_tool_call>"
    ),
    "gemma4": '<|tool_call>call:weather{city:<|"|>Oslo<|"|>}<tool_call|>',
    "function_gemma": (
        "<start_function_call>call:weather{city:<escape>Oslo<escape>}<end_function_call>"
    ),
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    ),
    "kimi_k3": (
        '<|open|>tools<|sep|><|open|>call tool="weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|>"
    ),
    "minimax_m2": (
        '<minimax:tool_call>\n<invoke name="weather">\n<parameter name="city">Oslo</parameter>\n'
        "</invoke>\n</minimax:tool_call>"
    ),
    "minicpm5": '<function name="weather"><param name="city">Oslo</param></function>',
    "mistral": '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}',
    "muse_spark": (
        '<atem:function_calls><atem:invoke name="weather"><atem:parameter name="city">Oslo'
        "</atem:parameter></atem:invoke></atem:function_calls>"
    ),
    "pythonic": '<|tool_call_start|>[weather(city="Oslo")]<|tool_call_end|>',
}


def parsers() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__))


def test_every_parser_mlx_lm_ships_has_a_sample():
    assert parsers() == sorted(SAMPLES)


def test_every_format_mlx_lm_reads_is_a_module_of_the_registry():
    """A format mlx-lm adds is looked at: one module of engine.call_formats and a line in
    its registry (laguna's calls are read by glm47's parser, so it is glm47's format)."""
    import agentkv.engine.call_formats as package
    from agentkv.engine.call_formats import FORMATS, MODULES

    styles = {"glm47" if p == "laguna" else p for p in parsers()}
    assert sorted(FORMATS) == sorted({*styles, "harmony"})
    # Each module of the package is one line of the registry, named as its format.
    modules = {m.name for m in pkgutil.iter_modules(package.__path__)} - {"call_format"}
    assert sorted(MODULES) == sorted(modules) == sorted(FORMATS)
    for name, form in FORMATS.items():
        module = importlib.import_module(f"agentkv.engine.call_formats.{name}")
        assert module.FORMAT is form


@pytest.mark.parametrize("style", sorted(SAMPLES))
def test_a_call_in_each_format_is_parsed_out_of_the_reply(style):
    module = importlib.import_module(f"mlx_lm.tool_parsers.{style}")
    form = ToolFormat(module.tool_call_start, module.tool_call_end, module.parse_tool_call)
    assert form.style == ("glm47" if style == "laguna" else style)  # (laguna: glm47's parser)
    reply = form.parse("Let me check. " + SAMPLES[style], TOOLS)
    assert reply.text == "Let me check. "
    assert reply.tool_calls == (ToolCall("weather", {"city": "Oslo"}),)
    # Two calls in one reply (a format whose calls run to the reply's end writes them in one
    # section).
    if module.tool_call_end:
        twice = form.parse(SAMPLES[style] + SAMPLES[style], TOOLS)
        assert twice.tool_calls == (ToolCall("weather", {"city": "Oslo"}),) * 2
    # A call cut off before its end marker stays text (max_tokens ran out).
    if module.tool_call_end:
        cut = SAMPLES[style][: SAMPLES[style].rindex(module.tool_call_end)]
        assert form.parse(cut, TOOLS) == ParsedReply(cut)


# Each forcible format's call as its grammar writes it (compact JSON, no blank between tags).
FORCED = {
    "json_tools": '<tool_call>\n{"name":"weather","arguments":{"city":"Oslo"}}\n</tool_call>',
    "qwen3_coder": SAMPLES["qwen3_coder"],
    "glm47": "<tool_call>weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
    "longcat": (
        "<longcat_tool_call>weather<longcat_arg_key>city</longcat_arg_key>"
        "<longcat_arg_value>Oslo</longcat_arg_value></longcat_tool_call>"
    ),
    "minimax_m2": SAMPLES["minimax_m2"],
    "mistral": '[TOOL_CALLS]weather[ARGS]{"city":"Oslo"}',
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0"
        '<|tool_call_argument_begin|>{"city":"Oslo"}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    ),
}


@pytest.fixture(scope="module")
def grammars():
    from mlx_lm.utils import load_tokenizer

    from agentkv.engine.grammar import Grammars
    from agentkv.models.tiny import tiny_model_dir

    tokenizer = load_tokenizer(tiny_model_dir("tiny:thinking"))
    return tokenizer, Grammars(tokenizer, tokenizer.vocab_size)


def test_every_forcible_format_has_a_sample():
    from agentkv.engine.call_formats import TOOL_CALL_STYLES

    # (harmony is no mlx-lm parser's: tests/test_harmony.py forces its calls)
    assert sorted(set(TOOL_CALL_STYLES) - {"harmony"}) == sorted(FORCED)


@pytest.mark.parametrize("style", sorted(FORCED))
def test_a_forced_call_in_each_format_is_what_its_parser_reads(grammars, style):
    import llguidance

    tokenizer, made = grammars
    module = importlib.import_module(f"mlx_lm.tool_parsers.{style}")
    start, end = module.tool_call_start, module.tool_call_end
    tools = [*TOOLS, {"type": "function", "function": {"name": "other", "parameters": {}}}]
    grammar = made.tool_call(start, end, tools, "weather", style)
    tokens = tokenizer.encode(FORCED[style], add_special_tokens=False)
    matcher = llguidance.LLMatcher(made._ll_tokenizer(), grammar.source)
    assert matcher.consume_tokens(tokens), matcher.get_error()
    assert matcher.is_accepting()
    # Another function's name is not the forced one's.
    other = FORCED[style].replace("weather", "other")
    wrong = llguidance.LLMatcher(made._ll_tokenizer(), grammar.source)
    assert not wrong.consume_tokens(tokenizer.encode(other, add_special_tokens=False))
    form = ToolFormat(start, end, module.parse_tool_call)
    assert form.parse(FORCED[style], TOOLS).tool_calls == (ToolCall("weather", {"city": "Oslo"}),)


@pytest.mark.parametrize("style", sorted(SAMPLES))
def test_a_call_cut_short_anywhere_comes_back_as_a_call_never_as_text(style):
    """A reply cut (max_tokens) at every point of a call: the text before the call stays
    text and nothing of the markup joins it; from the end of the function's name on the
    reply carries the call, its arguments what was written (a value being written left out),
    its written arguments never complete JSON until the model finished them."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{style}")
    start, end = module.tool_call_start, module.tool_call_end
    form = ToolFormat(start, end, module.parse_tool_call)
    sample = SAMPLES[style]
    done = sample.rindex("Oslo") + len("Oslo")
    reads = []
    for n in range(len(start), len(sample) + 1):
        reply = form.parse("Let me check. " + sample[:n], TOOLS, cut=True)
        assert reply.text == "Let me check. "
        assert len(reply.tool_calls) <= 1
        reads.append(reply.tool_calls[0] if reply.tool_calls else None)
        if n >= sample.index("Oslo"):
            call = reads[-1]
            assert call is not None and call.name == "weather"
            assert call.arguments in ({}, {"city": "Oslo"})
            if call.cut:
                with pytest.raises(ValueError):
                    json.loads(call.written)
                assert partial_object(call.written) == call.arguments
    # Once read, a call stays read, and once a value is read it stays.
    first = next(i for i, r in enumerate(reads) if r is not None)
    assert all(r is not None for r in reads[first:])
    oslo = [r.arguments == {"city": "Oslo"} for r in reads[first:]]
    assert oslo == sorted(oslo) and oslo[-1]
    assert not reads[-1].cut  # the whole call: read as it is without cut
    assert first + len(start) <= done


@pytest.mark.parametrize("style", ["json_tools", "kimi_k2", "minimax_m2", "qwen3_coder"])
def test_the_calls_before_a_cut_one_come_back_whole(style):
    module = importlib.import_module(f"mlx_lm.tool_parsers.{style}")
    form = ToolFormat(module.tool_call_start, module.tool_call_end, module.parse_tool_call)
    sample = SAMPLES[style]
    if style == "kimi_k2":  # two calls in one section
        call = sample[
            sample.index("<|tool_call_begin|>") : sample.index("<|tool_calls_section_end|>")
        ]
        text = sample.replace(call, call + call.replace("Oslo", "Bergen"))
    elif style == "minimax_m2":
        invoke = sample[sample.index("<invoke") : sample.index("</minimax")]
        text = sample.replace(invoke, invoke + invoke.replace("Oslo", "Bergen"))
    else:
        text = sample + sample.replace("Oslo", "Bergen")
    cut = text[: text.index("Bergen") + 3]
    reply = form.parse(cut, TOOLS, cut=True)
    assert reply.text == ""
    assert reply.tool_calls == (ToolCall("weather", {"city": "Oslo"}), ToolCall("weather", {}))
    assert [c.cut for c in reply.tool_calls] == [False, True]


@pytest.mark.parametrize("style", ["json_tools", "mistral", "kimi_k2"])
def test_a_calls_arguments_stream_as_they_are_written(style):
    from agentkv.call_stream import CallStream

    module = importlib.import_module(f"mlx_lm.tool_parsers.{style}")
    start, end = module.tool_call_start, module.tool_call_end
    reply = "Let me look. " + SAMPLES[style] + SAMPLES[style].replace("Oslo", "Bergen")
    stream = CallStream.of(start, end, style)
    at = reply.find(start)
    pieces = [d for i in range(at, len(reply), 3) for d in stream.feed(reply[i : i + 3])]
    firsts = [p for p in pieces if p.first]
    assert [(p.index, p.name) for p in firsts] == [(0, "weather"), (1, "weather")]
    for index, city in enumerate(("Oslo", "Bergen")):
        written = "".join(p.arguments for p in pieces if p.index == index)
        assert json.loads(written) == {"city": city} and stream.calls[index].complete
        assert len([p for p in pieces if p.index == index]) > 3  # piece by piece
        assert {p.id for p in pieces if p.index == index} == {stream.calls[index].id}
    # A format whose calls are not one JSON object after a header comes whole.
    assert CallStream.of("<tool_call>", "</tool_call>", "qwen3_coder") is None
    # Braces and quotes inside strings do not end the arguments early.
    tricky = '<tool_call>\n{"name": "w", "arguments": {"a": "}\\"{", "b": {"c": 1}}}\n</tool_call>'
    stream = CallStream.of("<tool_call>", "</tool_call>", "json_tools")
    pieces = [d for ch in tricky for d in stream.feed(ch)]
    assert json.loads("".join(p.arguments for p in pieces)) == {"a": '}"{', "b": {"c": 1}}
