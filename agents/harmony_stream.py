"""A harmony reply (gpt-oss) taken apart while it streams: the analysis and the answer as
they come, the tool calls once the reply is over (``agentkv.harmony``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CALL_END = "<|call|>"


class HarmonySplitter:
    """A reply streamed in pieces of text: :meth:`feed` returns ``(is_reasoning, text)``
    pieces of the analysis and the answer as they come, and of a tool call its markup (its
    header once complete, its arguments as they come, ``<|call|>`` once it ends: the reply's
    last token, not in its text, closes it in :meth:`flush`). ``encoding``: openai-harmony's;
    ``controls``: the format's control strings, one of which a piece may end halfway
    through."""

    def __init__(self, encoding: Any, controls: Sequence[str]):
        import openai_harmony as oh

        self.encoding, self.controls = encoding, tuple(controls)
        self.parser = oh.StreamableParser(encoding, oh.Role.ASSISTANT)
        self.broken = False  # the reply left the format: the rest is answer text
        self.calling = False  # inside a message addressed to a recipient
        self._held = ""  # what may be the start of a control string cut in two

    def feed(self, text: str) -> list[tuple[bool, str]]:
        if self.broken:
            return [(False, text)]
        text, self._held = self._held + text, ""
        for keep in range(min(len(text), max(map(len, self.controls)) - 1), 0, -1):
            if any(control.startswith(text[-keep:]) for control in self.controls):
                text, self._held = text[:-keep], text[-keep:]
                break
        return self._process(text)

    def _process(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        parser, encoding = self.parser, self.encoding
        tokens = encoding.encode(text, allowed_special="all")
        for i, token in enumerate(tokens):
            try:
                parser.process(token)
            except Exception:  # HarmonyError: the reply left the format, the rest is text
                self.broken = True
                out.append((False, encoding.decode_utf8(tokens[i:])))
                break
            delta, recipient = parser.last_content_delta, parser.current_recipient
            if self.calling and recipient is None:  # the call's message ended
                out.append((False, CALL_END))
                self.calling = False
            if not delta:
                continue
            if recipient and not self.calling:
                out.append((False, self._header()))
                self.calling = True
            out.append((parser.current_channel == "analysis" and not recipient, delta))
        return out

    def _header(self) -> str:
        """The markup that opens the message in progress, as harmony renders it."""
        import openai_harmony as oh

        parser = self.parser
        message = oh.Message.from_role_and_content(oh.Role.ASSISTANT, "")
        message = message.with_channel(parser.current_channel)
        message = message.with_recipient(parser.current_recipient)
        if parser.current_content_type:
            message = message.with_content_type(parser.current_content_type)
        return self.encoding.decode_utf8(self.encoding.render(message)).removesuffix(CALL_END)

    def flush(self) -> list[tuple[bool, str]]:
        out = self._process(self._held) if self._held else []
        self._held = ""
        if self.calling:
            out.append((False, CALL_END))
            self.calling = False
        return out
