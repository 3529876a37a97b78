"""Tool calls in model output, through mlx-lm's own tool-call support.

mlx-lm's tokenizer wrapper knows, per model family, the markers around a tool call
(``tool_call_start`` / ``tool_call_end``, e.g. ``<tool_call>`` … ``</tool_call>``) and a parser
for the text between them (``mlx_lm.tool_parsers``). A model without them cannot call tools.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentkv.call_stream import CallStream
from agentkv.cut_calls import read_cut
from agentkv.engine.call_formats import call_format
from agentkv.tool_call import ParsedReply, ToolCall

__all__ = ["MARKUPS_KEPT", "ParsedReply", "ToolCall", "ToolFormat"]

MARKUPS_KEPT = 4096
"""Tool calls whose rendered markup a format remembers (conversations resend the same ones)."""


@dataclass(slots=True)
class ToolFormat:
    """A model's tool-call markers and parser (``tokenizer``: the mlx-lm TokenizerWrapper whose
    chat template writes calls in formats other than JSON, see :meth:`markup`)."""

    start: str
    end: str
    parser: Callable[[str, Any], Any]
    tokenizer: Any = None
    _markups: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, tokenizer: Any) -> ToolFormat | None:
        """The format of an mlx-lm TokenizerWrapper, or None when the model has none."""
        if not getattr(tokenizer, "has_tool_calling", False) or tokenizer.tool_parser is None:
            return None
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        return cls(start, end, tokenizer.tool_parser, tokenizer)

    @property
    def style(self) -> str:
        """The format's name: the mlx-lm parser that reads it (``json_tools``,
        ``qwen3_coder``, ``glm47``, …)."""
        return getattr(self.parser, "__module__", "").rsplit(".", 1)[-1]

    @property
    def forcible(self) -> bool:
        """Whether a call can be forced (``tool_choice``): a format ``agentkv.engine.grammar``
        writes a grammar for (``CallFormat.forcible``)."""
        return call_format(self.style).forcible

    def call_stream(self) -> CallStream | None:
        """A reader of calls' arguments as they are written, where the format allows."""
        return CallStream.of(self.start, self.end, self.style)

    def parse(
        self, text: str, tools: list[dict[str, Any]] | None = None, cut: bool = False
    ) -> ParsedReply:
        """Split generated text into plain text and tool calls.

        A call the parser cannot read stays in the text. A format without an end marker
        (Mistral's ``[TOOL_CALLS]``) runs to the reply's end. With ``cut`` (the reply was cut
        short: max_tokens, the context), a call section left open at the end is read as far
        as it was written (``agentkv.cut_calls``), never left as text.
        """
        plain, calls, rest = [], [], text
        while (start := rest.find(self.start)) >= 0:
            end = rest.find(self.end, start + len(self.start)) if self.end else len(rest)
            if end < 0:
                break
            body = rest[start + len(self.start) : end]
            parsed = self.read_body(body, tools)
            if parsed is None and cut and not self.end:
                break  # the section the reply was cut in
            if parsed is None:
                plain.append(rest[: end + len(self.end)])
            else:
                plain.append(rest[:start])
                calls.extend(parsed)
            rest = rest[end + len(self.end) :]
        if cut and (start := rest.find(self.start)) >= 0:
            read = read_cut(self, rest[start + len(self.start) :], tools)
            plain.append(rest[:start])
            return ParsedReply("".join(plain), (*calls, *read))
        plain.append(rest)
        return ParsedReply("".join(plain), tuple(calls))

    def read_body(self, body: str, tools: list[dict[str, Any]] | None) -> list[ToolCall] | None:
        """The calls of a section's text between its markers, or None when the format's parser
        cannot read it."""
        try:
            parsed = self.parser(body, tools)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None
        calls = []
        for item in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            arguments = item.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return None
            if not isinstance(arguments, dict):
                return None
            calls.append(ToolCall(item["name"], arguments))
        return calls

    def markup(self, calls: list[ToolCall]) -> str:
        """Calls written out as the model writes them (how transcripts store them): JSON
        between the markers, or, in another format, as the chat template renders them."""
        if not calls:
            return ""
        if not call_format(self.style).json_object and self.tokenizer is not None:
            key = json.dumps([[c.name, c.arguments] for c in calls], sort_keys=True)
            if (known := self._markups.get(key)) is None:
                known = self._rendered(calls)
                if len(self._markups) >= MARKUPS_KEPT:
                    self._markups.clear()
                self._markups[key] = known
            if known:
                return known
        return "".join(
            f"{self.start}\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n{self.end}"
            for c in calls
        )

    def _rendered(self, calls: list[ToolCall]) -> str:
        """The calls as the chat template writes them in an assistant turn ("" when it does
        not write them between the markers)."""
        probe = [{"role": "user", "content": "x"}]
        reply = {"role": "assistant", "content": "", "tool_calls": [c.as_template() for c in calls]}
        try:
            whole = self.tokenizer.apply_chat_template(
                [*probe, reply], tokenize=False, add_generation_prompt=False
            )
        except Exception:  # a template that refuses the probe: JSON markup then
            return ""
        first, last = whole.find(self.start), whole.rfind(self.end)
        if first < 0 or last < first:
            return ""
        return whole[first : last + len(self.end)]

    def streaming_split(self, text: str) -> int:
        """How much of ``text`` (a growing reply) can be shown as plain text now: everything
        before a tool call's start marker, or before a partial marker at the very end."""
        found = text.find(self.start)
        if found >= 0:
            return found
        for keep in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)
