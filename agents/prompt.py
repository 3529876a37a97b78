"""Prompt deltas: render only the new part of a conversation, never re-tokenize history.

A cache's token list is the canonical history. Re-tokenizing a re-rendered transcript does not
reproduce the tokens the model generated (tokenization is not canonical), so a token-prefix
match against the cache would silently miss. Instead we render the conversation as text and
cut it where the cache ends: just after the content of the last assistant reply it covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agents.errors import ChatTemplateError, InvalidMessageError, check_text

Message = dict[str, Any]
"""A chat message as templates read it: ``role``, ``content`` and, for tool calling,
``tool_calls`` (assistant) or role ``tool``."""
# Stands in for the reply's content while rendering: templates that trim or rewrite content
# leave a token like this alone, so the text after it is exactly what follows the reply.
_CUT = "\u27e6agentkv-cache-ends-here\u27e7"


@dataclass(slots=True)
class ChatRenderer:
    """Renders conversations with the model's chat template."""

    tokenizer: Any
    eos_token_ids: frozenset[int]

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
            )
        except Exception as exc:  # jinja's TemplateError, or the template's raise_exception
            raise ChatTemplateError(
                f"the model's chat template refused the conversation: {exc}"
            ) from exc

    def encode(self, text: str) -> list[int]:
        # The template writes special tokens (BOS included) itself.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def full_prompt(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Tokens of the whole conversation, ready for the assistant to answer."""
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def shared_head(
        self,
        messages: Sequence[Message],
        tokens: Sequence[int],
        tools: list[dict[str, Any]] | None = None,
    ) -> int:
        """How many leading ``tokens`` (the conversation's full prompt) depend only on its
        system message and tools: what every conversation with the same ones starts with.
        0 when there is neither, or the template refuses the probe conversations."""
        first = 1 if messages and messages[0]["role"] == "system" else 0
        if not first and not tools:
            return 0
        shared = len(tokens)
        for probe in ("0", "1"):  # two probes: a conversation may start with either text
            try:
                other = self.full_prompt(
                    [*messages[:first], {"role": "user", "content": probe}], tools
                )
            except ChatTemplateError:
                return 0
            shared = min(shared, _common_prefix(tokens, other))
        return shared

    def delta(
        self, messages: Sequence[Message], covered: int, last_cached_token: int
    ) -> list[int] | None:
        """Tokens that follow a cache covering ``messages[:covered]``.

        The cache ends inside the rendering of ``messages[covered - 1]``, an assistant reply:
        after its generated content and, if generation stopped on it, an end-of-turn token.
        Returns None when the template does not render that reply where the cache expects it
        (then the caller re-prefills).
        """
        if not 0 < covered < len(messages) or messages[covered - 1]["role"] != "assistant":
            return None
        probe = [*messages[: covered - 1], {**messages[covered - 1], "content": _CUT}]
        rendered = self.render([*probe, *messages[covered:]], add_generation_prompt=True)
        head = self.render(messages[: covered - 1], add_generation_prompt=True)
        if not rendered.startswith(head) or rendered.count(_CUT) != 1:
            return None
        tail = rendered[rendered.index(_CUT) + len(_CUT) :]
        if last_cached_token in self.eos_token_ids:
            eos_text = self.tokenizer.decode([last_cached_token])
            if tail.startswith(eos_text):
                tail = tail[len(eos_text) :]
        tokens = self.encode(tail)
        return tokens or None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def checked_texts(messages: Sequence[Message]) -> list[Message]:
    """Chat-template messages whose text content UTF-8 can encode (else InvalidMessageError
    naming the message)."""
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), str):
            check_text(m["content"], f"messages[{i}].content")
    return list(messages)


def checked_history(messages: Sequence[Message]) -> list[Message]:
    """Copies of user/assistant message dicts whose content is usable text."""
    checked = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise InvalidMessageError(
                f"messages[{i}]: role must be 'user' or 'assistant', got {role!r}"
            )
        checked.append({"role": role, "content": check_text(content, f"messages[{i}].content")})
    return checked
