"""A harmony reply (gpt-oss) taken apart while it streams: the analysis and the answer as
they come, the tool calls once the reply is over (``agents.harmony``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class HarmonySplitter:
    """A reply streamed in pieces of text: :meth:`feed` returns ``(is_reasoning, text)``
    pieces of the analysis and the answer as they come; tool calls are held back and handed
    over as markup by :meth:`flush`, once the reply is over (its last token, ``<|call|>``, is
    not in the text). ``encoding``: openai-harmony's; ``controls``: the format's control
    strings, one of which a piece may end halfway through."""

    def __init__(self, encoding: Any, controls: Sequence[str]):
        import openai_harmony as oh

        self.encoding, self.controls = encoding, tuple(controls)
        self.parser = oh.StreamableParser(encoding, oh.Role.ASSISTANT)
        self.broken = False  # the reply left the format: the rest is answer text
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
            delta = parser.last_content_delta
            if delta and not parser.current_recipient:
                out.append((parser.current_channel == "analysis", delta))
        return out

    def flush(self) -> list[tuple[bool, str]]:
        out = self._process(self._held) if self._held else []
        self._held = ""
        if self.broken:
            return out
        try:
            self.parser.process_eos()
        except Exception:  # HarmonyError: cut inside a header
            return out
        encoding = self.encoding
        return out + [
            (False, encoding.decode_utf8(encoding.render(message)))
            for message in self.parser.messages
            if message.recipient
        ]
