"""Tool calls' arguments as the model writes them, for the APIs that stream them.

In formats whose call is a header naming the function, then its arguments as one JSON object
(Hermes / Qwen's ``<tool_call>`` JSON, Mistral's ``[TOOL_CALLS]NAME[ARGS]``, Kimi K2's calls,
harmony's ``commentary to=functions.NAME`` message: a ``CallFormat.header`` in
``agentkv.engine.call_formats``), :class:`CallStream` reads the calls' markup as it
grows and hands out each call's name once its header is complete, then its arguments' text
piece by piece, up to the object's closing brace. The pieces of a call join into the JSON
text the model wrote; the reply's parsed call (``agentkv.tool_calls``) is the same call. In other
formats a call comes whole once the reply is parsed.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from agentkv.engine.call_formats import call_format

HEADER_CHARS = 1024
"""A header not complete after this many characters is not one: the call comes whole."""


@dataclass(slots=True, frozen=True)
class CallDelta:
    """A piece of a streamed call: its index among the reply's calls, its id, its function's
    name, and the next text of its arguments (``first``: the call's first piece)."""

    index: int
    id: str
    name: str
    arguments: str
    first: bool = False


@dataclass(slots=True)
class StreamedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass(slots=True)
class CallStream:
    """Reads calls' markup (the reply's text from the first call's start marker on) as it
    grows: :meth:`feed` returns the CallDelta pieces it completes."""

    start: str
    end: str
    header: re.Pattern[str]
    calls: list[StreamedCall] = field(default_factory=list)
    _text: str = ""
    _at: int = 0
    _state: str = "start"  # start, header, open (before the '{'), arguments, after, off
    _depth: int = 0
    _string: bool = False
    _escaped: bool = False

    @classmethod
    def of(cls, start: str, end: str, style: str) -> CallStream | None:
        """The stream for a format, or None when its arguments do not stream."""
        form = call_format(style)
        if form.header is None:
            return None
        start, end = form.call_markers or (start, end)
        return cls(start, end, re.compile(form.header))

    def feed(self, more: str) -> list[CallDelta]:
        self._text += more
        out: list[CallDelta] = []
        while self._state != "off" and self._step(out):
            pass
        return out

    def _step(self, out: list[CallDelta]) -> bool:
        """One move of the reader; False when it needs more text."""
        text, state = self._text, self._state
        if state == "start":
            found = text.find(self.start, self._at)
            if found < 0:
                return False
            self._at, self._state = found + len(self.start), "header"
        elif state == "header":
            match = self.header.match(text, self._at)
            if match is None:
                if len(text) - self._at > HEADER_CHARS:
                    self._state = "off"
                return False
            call = StreamedCall(f"call_{uuid.uuid4().hex[:24]}", match["name"])
            self.calls.append(call)
            out.append(CallDelta(len(self.calls) - 1, call.id, call.name, "", first=True))
            self._at, self._state = match.end(), "open"
        elif state == "open":
            rest = text[self._at :].lstrip()
            if not rest:
                return False
            if rest[0] != "{":
                self._state = "off"
                return False
            self._at, self._state = len(text) - len(rest), "arguments"
        elif state == "arguments":
            self._arguments(out)
            return self._state != "arguments"
        elif state == "after":
            if self.end:
                found = text.find(self.end, self._at)
                if found < 0:
                    return False
                self._at = found + len(self.end)
            self._state = "start"
        return True

    def _arguments(self, out: list[CallDelta]) -> None:
        """Read the JSON object's text so far; hand it out up to its closing brace."""
        text, at = self._text, self._at
        end = at
        for end in range(at, len(text) + 1):
            if end == len(text):
                break
            char = text[end]
            if self._string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._string = False
            elif char == '"':
                self._string = True
            elif char == "{":
                self._depth += 1
            elif char == "}":
                self._depth -= 1
                if self._depth == 0:
                    end += 1
                    self._state = "after"
                    break
        piece = text[at:end]
        call = self.calls[-1]
        call.arguments += piece
        call.complete = self._state == "after"
        self._at = end
        if piece:
            out.append(CallDelta(len(self.calls) - 1, call.id, call.name, piece))
