"""Tool calls a reply was cut off in (by ``max_tokens``, the context or the KV budget): what
was written of them, read as calls.

A call cut short has no end marker and its arguments stop where the model stopped. The reply
still carries it as a call, as OpenAI's API does (``finish_reason: "length"`` with the partial
arguments), never as markup in its text:

- the call has its name once the model wrote all of it (a call cut inside its name is dropped:
  nothing of it is text either);
- ``ToolCall.arguments`` is the object read from what was written, a last value the model was
  still writing left out (for JSON arguments, the partial parse ``jiter`` does: what the
  Anthropic SDK reads from the streamed pieces);
- ``ToolCall.written`` is the arguments' text as written, left open: in the formats whose
  arguments are JSON, the model's own text (what was streamed); in the others, the JSON of what
  was read without its closing brace. It never parses as complete JSON unless the model
  finished the arguments.

Calls the section held before the cut one come back whole. Transcripts store a cut call as
they store any call (its markup written from its name and arguments), so a client sending it
back says the same as the stored reply.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from pydantic_core import from_json

from agentkv.call_stream import CallStream, StreamedCall
from agentkv.engine.call_formats import call_format
from agentkv.tool_call import ToolCall


class CallFormat(Protocol):
    """What a cut call is read with: a format's markers, its name, and its parser over a
    section's text (``agentkv.tool_calls.ToolFormat``)."""

    start: str
    end: str

    @property
    def style(self) -> str: ...

    def read_body(self, body: str, tools: list[dict[str, Any]] | None) -> list[ToolCall] | None: ...


TRIES = 8
"""Places a cut call is read up to, latest first, before it counts as unreadable."""


def read_cut(form: CallFormat, body: str, tools: list[dict[str, Any]] | None) -> list[ToolCall]:
    """The calls of a section cut short (``body``: its text after the start marker): those it
    completed and the cut one last (``ToolCall.cut``); none when not even a name was written."""
    stream = CallStream.of(form.start, form.end, form.style)
    if stream is not None:  # JSON arguments
        stream.feed(form.start + body)
        return [_streamed(call) for call in stream.calls]
    tags = call_format(form.style).cut
    if tags is None:
        return []
    for keep in range(min(len(form.end), len(body)), 0, -1):  # an end marker cut short
        if form.end.startswith(body[-keep:]):
            body = body[:-keep]
            break
    done = tags.done is not None and re.search(tags.done, body)
    if done and (whole := form.read_body(body, tools)):
        return whole  # every call written, the section's end marker aside
    marks = sorted(re.finditer(tags.marks, body), key=lambda m: m.end(), reverse=True)
    for mark in marks[:TRIES]:
        for closer in tags.closers:
            calls = form.read_body(body[: mark.end()] + closer, tools)
            if calls:
                last = calls[-1]
                written = json.dumps(last.arguments, ensure_ascii=False)[:-1]
                return [*calls[:-1], ToolCall(last.name, last.arguments, written=written, cut=True)]
        if mark["name"]:  # a header the parser reads only with arguments after it
            return [ToolCall(mark["name"].strip(), {}, written="{", cut=True)]
    return []


def _streamed(call: StreamedCall) -> ToolCall:
    """A call of JSON arguments as it was streamed (``agentkv.call_stream``): whole, or as far
    as it was written."""
    if call.complete:
        try:
            return ToolCall(call.name, json.loads(call.arguments), written=call.arguments)
        except ValueError:
            pass
    return ToolCall(call.name, partial_object(call.arguments), written=call.arguments, cut=True)


def partial_object(text: str) -> dict[str, Any]:
    """The object a JSON text cut short holds so far (an incomplete last value left out);
    ``{}`` when it holds none."""
    if not text.strip():
        return {}
    try:
        value = from_json(text, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
