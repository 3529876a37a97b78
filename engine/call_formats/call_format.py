"""One tool-call format: what agentkv needs of it beyond mlx-lm's parser (which reads a
call's text between the markers), as one small protocol its peers share.

- streaming: the regex of a call's header (after its start marker, up to its arguments) where
  the arguments are one JSON object, so they stream as they are written
  (``agentkv.call_stream``);
- forcing: the texts around a forced call's parts, for the grammar that holds a reply to one
  call (``agentkv.engine.grammar``): tags around each argument (:class:`Tagged`), a header before
  one JSON object (:class:`JsonArguments`), or one JSON object naming the function
  (``json_object``);
- a call cut short: where its text may be read up to and what closes it there for the parser
  (:class:`CutTags`, ``agentkv.cut_calls``; formats of JSON arguments read theirs as streamed).

A new format is a module of this package with one :class:`CallFormat` and a line in the
registry (``agentkv.engine.call_formats.MODULES``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tagged:
    """A call written as its name, then each argument's key and value in tags: the texts
    around the name, a key (``{name}``, ``{key}`` filled in), after a value and after the
    call, as the format's chat templates write them."""

    name: str
    key: str
    value_end: str
    call_end: str


@dataclass(frozen=True, slots=True)
class JsonArguments:
    """A call written as a header naming the function (``head``, ``{name}`` filled in), its
    arguments as one JSON object, then ``tail``; in a format whose reasoning is a message of
    its own, that message's opening and closing (``thinking``, ``thought``) and the opening of
    the final message a JSON reply is written in (``final``)."""

    head: str
    tail: str
    thinking: str | None = None
    thought: str | None = None
    final: str | None = None


@dataclass(frozen=True, slots=True)
class CutTags:
    """Where a call cut short may be read up to: the ends of ``marks``' matches (a header
    naming the call, group ``name``, and its complete values), latest first; what closes the
    call there for the parser (``closers``, tried in order); and what ends a section whose
    calls were all written (``done``; None: the end marker ends the call)."""

    marks: str
    closers: tuple[str, ...]
    done: str | None = None


@dataclass(frozen=True, slots=True)
class CallFormat:
    """A tool-call format, by the mlx-lm parser that reads it (``name``), or harmony."""

    name: str
    header: str | None = None
    """Regex of what follows a call's start marker up to its arguments (group ``name``), when
    the arguments are one JSON object: they stream as they are written."""
    call_markers: tuple[str, str] | None = None
    """A call's own markers, in a format whose section (between the model's start and end
    markers) holds several calls."""
    json_object: bool = False
    """A call is one JSON object ``{"name": ..., "arguments": ...}`` between the markers."""
    tagged: Tagged | None = None
    json_arguments: JsonArguments | None = None
    cut: CutTags | None = None

    @property
    def forcible(self) -> bool:
        """Whether a call can be forced (``tool_choice``): ``agentkv.engine.grammar`` writes its
        grammar."""
        return self.json_object or self.tagged is not None or self.json_arguments is not None
