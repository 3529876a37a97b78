"""Stop strings enforced on the detokenized text, never leaking a partial match to the caller."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Finds the first stop string in a stream of text deltas.

    Text that could still be the start of a stop string is held back until the next delta
    decides it, so the caller never receives any part of the stop text.
    """

    __slots__ = ("_buffer", "_stops", "matched")

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._buffer = ""
        self.matched: str | None = None  # the stop string that ended the text, once one has

    def __bool__(self) -> bool:
        return bool(self._stops)

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta. Returns (text safe to emit, whether a stop string was found)."""
        if not self._stops:
            return delta, False
        buffer = self._buffer + delta
        hits = [(i, s) for s in self._stops if (i := buffer.find(s)) >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda hit: hit[0])
            self._buffer = ""
            return buffer[:cut], True
        held = self._longest_partial_suffix(buffer)
        self._buffer = buffer[len(buffer) - held :]
        return buffer[: len(buffer) - held], False

    def flush(self) -> str:
        """The held-back text, at the end of the stream (it turned out not to be a stop)."""
        text, self._buffer = self._buffer, ""
        return text

    def _longest_partial_suffix(self, text: str) -> int:
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if stop.startswith(text[-k:]):
                    best = k
                    break
        return best
