"""The escape scheme of rendered text: control strings in message text, and placeholders.

Rendering swaps each control string (a special token's text) in message text for an escape of
two private-use characters, so that only the chat template's own markers become control tokens
(``agentkv.prompt``); placeholders, escapes no text can produce, stand in for messages' content
where a cache ends or a generated reply is spliced in (``agentkv.document``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# Starts an escape in rendered text: ESC + ESC is a literal ESC, ESC + chr(FIRST + i) the
# i-th control string as text (private-use code points of planes 15 and 16).
ESC = "\U000f0000"
FIRST = 0xF0001
ESCAPE = re.compile(ESC + "(.)", re.DOTALL)
# Placeholders stand in for a message's content while rendering (where a cache ends, a reply
# to splice): templates that trim or rewrite content leave them alone. Placeholder n is ESC +
# chr(LAST - n), an escape no message text can produce: text's own ESC is doubled, and
# controls' codes count up from FIRST, placeholders' down from LAST.
LAST = 0x10FFFF


PLACEHOLDER_CHARS = 2
"""The length of a placeholder in rendered text."""


def is_placeholder(content: Any) -> bool:
    """Whether a message's content is a placeholder (escapes of controls count up from the
    planes' first code point, placeholders down from their last: they never meet halfway)."""
    return (
        isinstance(content, str)
        and len(content) == PLACEHOLDER_CHARS
        and content[0] == ESC
        and ord(content[1]) > (FIRST + LAST) // 2
    )


def placeholder_at(rendered: str, count: int) -> list[int] | None:
    """Where placeholders 0 … count-1 stand in rendered text, in order; None unless each
    stands there once, in order (a template dropped, repeated or moved a message). Escapes
    are read left to right, so a doubled ESC from message text is never half of one."""
    found = [
        (LAST - ord(m.group(1)), m.start())
        for m in ESCAPE.finditer(rendered)
        if LAST - count < ord(m.group(1)) <= LAST
    ]
    if [n for n, _ in found] != list(range(count)):
        return None
    return [at for _, at in found]


def control_pattern(strings: Sequence[str]) -> re.Pattern[str]:
    """A regex matching ESC or any of ``strings``: a trie, so a position costs one lookup per
    character however many strings there are (Gemma 3 has over 6,000 special tokens)."""
    trie: dict[str, Any] = {}
    for s in [ESC, *strings]:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def regex(node: dict[str, Any]) -> str:
        ends = "" in node
        branches = [re.escape(ch) + regex(child) for ch, child in node.items() if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if ends:  # a string ends here and longer ones go on: prefer the longer
            return f"(?:{body})?" if len(branches) == 1 else f"{body}?"
        return body

    return re.compile(regex(trie))
