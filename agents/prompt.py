"""Prompt deltas: render only the new part of a conversation, never re-tokenize history.

A cache's token list is the canonical history. Re-tokenizing a re-rendered transcript does not
reproduce the tokens the model generated (tokenization is not canonical), so a token-prefix
match against the cache would silently miss. Instead we render the conversation as text and
cut it where the cache ends: just after the content of the last assistant reply it covers.

Message text stays text. A control string (one of the tokenizer's special tokens, such as
``<end_of_turn>``) inside a message's content, a tool call's arguments or a tool definition is
tokenized as the characters it is made of, never as the control token, so text from a user, a
tool or a web page cannot open or close turns. Only the chat template's own markers become
control tokens, and, in assistant messages, the model's tool-call and thinking markers
(transcripts store an assistant's tool calls as that markup, and a reasoning model's reply
with its thinking, which templates such as Qwen3's take apart). Rendering swaps each control
string in message text for an escape of two private-use characters; :meth:`ChatRenderer.encode`
turns the escapes back into the string's text tokens.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.engine.models.vision import ImageRule
from agentkv.errors import ChatTemplateError, ContextLengthError, InvalidMessageError, check_text
from agentkv.escapes import (
    ESC,
    ESCAPE,
    FIRST,
    LAST,
    PLACEHOLDER_CHARS,
    control_pattern,
    placeholder_at,
)
from agentkv.images import image_tokens, images_of
from agentkv.messages import Message, checked_template_kwargs, common_prefix, text_chars

HEADS_REMEMBERED = 64
"""System messages and tool sets whose shared heads a renderer remembers (see shared_heads)."""


@dataclass(slots=True)
class ChatRenderer:
    """Renders conversations with the model's chat template."""

    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_context: int | None = None
    """The model's context in tokens: a conversation whose text cannot fit is refused before
    it is escaped or tokenized (None: no check)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template (``enable_thinking``, …; see :meth:`using`)."""
    harmony: Any = None
    """``agentkv.harmony.Harmony`` for a model that speaks OpenAI's harmony (gpt-oss): it
    writes the prompts in place of the chat template."""
    images: ImageRule | None = None
    """How a vision-language model's template writes an image and what it stands for
    (``agentkv.engine.models.vision``); None: the model takes no images."""
    controls: tuple[str, ...] = field(init=False)
    """The tokenizer's special tokens: what message text may not produce."""
    _control_ids: frozenset[int] = field(init=False)
    _index: dict[str, int] = field(init=False)
    _in_text: re.Pattern[str] = field(init=False)
    _in_replies: re.Pattern[str] = field(init=False)
    _as_text: dict[int, list[int]] = field(init=False)
    _max_token_chars: int | None = field(init=False, default=None)
    _heads: dict[bytes, list[int]] = field(init=False)  # see shared_heads
    _openers: dict[str, list[int]] = field(init=False)  # see reply_opener

    def __post_init__(self) -> None:
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        # Special tokens, and the tool-call and thinking markers mlx-lm knows for the model
        # (Qwen's <tool_call> or <think> are added tokens not marked special, matched in text
        # all the same). Other added tokens (runs of spaces, HTML tags) are plain text.
        markers = {getattr(self.tokenizer, a, None) for a in ("tool_call_start", "tool_call_end")}
        thinking = {getattr(self.tokenizer, a, None) for a in ("think_start", "think_end")}
        named = markers | thinking
        if self.harmony is not None:  # a reply's messages, as transcripts store them
            named |= set(self.harmony.controls)
        controls = {
            i: t.content
            for i, t in added.items()
            if getattr(t, "special", False) or t.content in named
        }
        self.controls = tuple(sorted(set(controls.values())))
        if len(self.controls) > LAST - FIRST:
            raise ValueError(
                f"tokenizer: {len(self.controls)} control tokens, too many to escape in text"
            )
        self._control_ids = frozenset(controls)
        self._index = {s: i for i, s in enumerate(self.controls)}
        self._in_text = control_pattern(self.controls)
        self._in_replies = control_pattern([s for s in self.controls if s not in named])
        self._as_text = {}
        self._heads = {}
        self._openers = {}

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        placeholders: Sequence[int] = (),
    ) -> str:
        """The conversation as the template writes it, control strings in message text and
        tools escaped (for :meth:`encode`). ``placeholders``: indices of messages whose
        content is written as placeholder 0, 1, … instead (:func:`placeholder_at`). Raises
        ContextLengthError for text that cannot fit the model's context, ChatTemplateError
        when the template refuses the conversation."""
        self._check_size(messages, tools)
        if len(placeholders) > LAST - FIRST - len(self.controls):
            raise ValueError(f"{len(placeholders)} placeholders: more than escapes can hold")
        escaped = [self._escaped_message(m) for m in messages]
        for n, i in enumerate(placeholders):  # after escaping: no text spells a placeholder
            escaped[i] = {**escaped[i], "content": ESC + chr(LAST - n)}
        return self._apply(
            escaped,
            add_generation_prompt,
            self._escaped(tools, self._in_text) if tools else None,
        )

    def using(self, template_kwargs: dict[str, Any] | None) -> ChatRenderer:
        """This renderer, its template also given ``template_kwargs`` (a request's
        ``chat_template_kwargs``, e.g. ``{"enable_thinking": false}``); it shares this one's
        tables. Raises ChatTemplateError for a name the renderer sets itself or a value that
        is not JSON."""
        if not template_kwargs:
            return self
        template_kwargs = checked_template_kwargs(template_kwargs)
        other = copy.copy(self)
        other.template_kwargs = {**self.template_kwargs, **template_kwargs}
        return other

    def check(self, messages: Sequence[Message]) -> None:
        """Raise ChatTemplateError if the template refuses the conversation (of any length:
        a transcript may be stored longer than the context)."""
        self._apply(list(messages), False, None)

    def _apply(self, messages: list[Message], add_generation_prompt: bool, tools: Any) -> str:
        if self.harmony is not None:
            return self.harmony.render(messages, add_generation_prompt, tools, self.template_kwargs)
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
                **self.template_kwargs,
            )
        except Exception as exc:  # jinja's TemplateError, or the template's raise_exception
            raise ChatTemplateError(
                f"the model's chat template refused the conversation: {exc}"
            ) from exc

    def encode(self, text: str, images: Sequence[dict[str, Any]] = ()) -> list[int]:
        """Tokens of rendered text: control strings the template wrote become control tokens,
        escaped ones (from message text) the tokens of their characters, and the images it
        shows (their parts, in order) their tokens (:func:`agentkv.images.image_tokens`)."""
        if images:
            return image_tokens(self.encode, text, images, self.images)
        # The template writes special tokens (BOS included) itself.
        if ESC not in text:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        tokens: list[int] = []
        start = 0
        for match in ESCAPE.finditer(text):
            code = ord(match.group(1)) - FIRST
            if match.group(1) != ESC and not 0 <= code < len(self.controls):
                continue  # not an escape of ours (a template cut one up): plain text
            tokens += self._plain(text[start : match.start()])
            if match.group(1) == ESC:
                tokens += self._plain(ESC)
            else:
                tokens += self._text_tokens(self.controls[code])
            start = match.end()
        return tokens + self._plain(text[start:])

    def prediction_tokens(self, text: str) -> list[int]:
        """Tokens of a reply's expected text (OpenAI's Predicted Outputs) as the reply would
        hold them. Raises InvalidMessageError for text that is not a string, or that cannot
        fit the model's context."""
        check_text(text, "prediction")
        limit = self.max_context
        # Cheap first (string lengths: no C code scans a huge text holding the GIL).
        if limit is not None and len(text) > limit * self._token_chars():
            raise InvalidMessageError(
                f"prediction: {len(text)} characters cannot fit the model's context "
                f"({limit} tokens)"
            )
        tokens = self._plain(text)
        if limit is not None and len(tokens) >= limit:
            raise InvalidMessageError(
                f"prediction: {len(tokens)} tokens, more than the model's context ({limit})"
            )
        return tokens

    def _token_chars(self) -> int:
        """The most characters a token holds (the vocabulary's longest entry)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1) or 1
        return self._max_token_chars

    def _plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _check_size(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None) -> None:
        """Refuse text that cannot fit the context whatever its tokens: each token holds at
        most the longest vocabulary entry's characters. Cheap (string lengths only), so a
        multi-megabyte message is refused before any C code scans it holding the GIL."""
        if self.max_context is None:
            return
        chars = text_chars(messages) + text_chars(tools)
        if chars <= self.max_context:  # a token is at least one character
            return
        at_least = -(-chars // self._token_chars())
        if at_least >= self.max_context:
            raise ContextLengthError(  # Anthropic's wording: clients parse it to compact
                f"prompt is too long: {at_least} tokens > {self.max_context - 1} maximum (at "
                f"least: the messages hold {chars} characters, a token at most "
                f"{self._token_chars()}; the model's context is {self.max_context} tokens); "
                "shorten the conversation or start a new agent"
            )

    def _text_tokens(self, control: str) -> list[int]:
        """Tokens of a control string's characters (split until no piece is a control)."""
        cached = self._as_text.get(self._index[control])
        if cached is not None:
            return cached

        def split(text: str) -> list[int]:
            tokens = list(self.tokenizer.encode(text, add_special_tokens=False))
            if len(text) < 2 or not self._control_ids.intersection(tokens):
                return tokens
            return split(text[:1]) + split(text[1:])

        tokens = self._as_text[self._index[control]] = split(control)
        return tokens

    def _escaped_message(self, message: Message) -> Message:
        pattern = self._in_replies if message.get("role") == "assistant" else self._in_text
        return {
            key: value
            if key in ("role", "type")
            else self._escaped(value, pattern if key == "content" else self._in_text)
            for key, value in message.items()
        }

    def _escaped(self, value: Any, pattern: re.Pattern[str] | None) -> Any:
        """``value`` (text, or lists and dicts of it) with its control strings escaped."""
        if isinstance(value, str):
            if pattern is None or not pattern.search(value):
                return value
            return pattern.sub(self._escape, value)
        if isinstance(value, dict):
            return {k: self._escaped(v, pattern) for k, v in value.items()}
        if isinstance(value, list):
            return [self._escaped(v, pattern) for v in value]
        return value

    def _escape(self, match: re.Match[str]) -> str:
        text = match.group()
        return ESC + (ESC if text == ESC else chr(FIRST + self._index[text]))

    def full_prompt(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Tokens of the whole conversation, ready for the assistant to answer."""
        text = self.render(messages, add_generation_prompt=True, tools=tools)
        return self.encode(text, images_of(messages))

    def shared_heads(
        self,
        messages: Sequence[Message],
        tokens: Sequence[int],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Where the leading ``tokens`` (the conversation's full prompt) stop depending only on
        what other conversations share, ascending: the end of the tool definitions when the
        template renders them before the system prompt's text (conversations with the same
        tools and another system prompt share them), then the end of the system message and
        tools (every conversation with the same ones starts with them). Empty when there is
        neither, or the template refuses the probe conversations.

        Rendering the probes grows with the tools (tens of thousands of tokens for Claude
        Code): the points are remembered per system message and tools."""
        first = 1 if messages and messages[0]["role"] == "system" else 0
        if not first and not tools:
            return []
        key = hashlib.blake2b(
            json.dumps(
                [messages[:first], tools, self.template_kwargs], sort_keys=True, default=str
            ).encode(),
            digest_size=16,
        ).digest()
        if (known := self._heads.get(key)) is not None:
            return [n for n in known if n <= len(tokens)]
        head = messages[:first]
        probes = [[*head, {"role": "user", "content": text}] for text in ("0", "1")]
        if first and tools:  # another system prompt, the same tools
            other = [{**head[0], "content": text} for text in ("0", "1")]
            probes += [[system, {"role": "user", "content": "0"}] for system in other]
        ends = []
        try:
            for pair in (probes[:2], probes[2:]):  # two probes: either text may follow
                if pair:
                    ends.append(
                        min(common_prefix(tokens, self.full_prompt(m, tools)) for m in pair)
                    )
        except ChatTemplateError:
            return []
        points = sorted(set(ends))
        if len(self._heads) >= HEADS_REMEMBERED:  # (worker threads race here: harmless)
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                self._heads.pop(next(iter(self._heads)))
        self._heads[key] = points
        return points

    def generation_prompt(self) -> list[int]:
        """The tokens the template ends a prompt with to have the model reply (ChatML's
        ``<|im_start|>assistant\n``): what follows a conversation's history in its prompt.
        Empty when the template writes none apart from the history."""
        key = "generation:" + json.dumps(self.template_kwargs, sort_keys=True, default=str)
        if (known := self._openers.get(key)) is not None:
            return known
        probe = [{"role": "user", "content": "x"}]
        try:
            opened = self.render(probe, add_generation_prompt=True)
            closed = self.render(probe, add_generation_prompt=False)
        except ChatTemplateError:
            opened = closed = ""
        tokens = self.encode(opened[len(closed) :]) if opened.startswith(closed) else []
        self._openers[key] = tokens
        return tokens

    def reply_opener(self) -> list[int]:
        """The tokens the generation prompt ends with that the template does not write in
        front of the same reply once it is history: a reasoning block it closes at once
        (``enable_thinking=False``) or opens for the reply (DeepSeek-R1's, Qwen3-Thinking's
        ``<think>``). The model saw them before its reply, so a reply spliced back into a
        resent conversation carries them (``agentkv.document``). Empty for most templates."""
        key = json.dumps(self.template_kwargs, sort_keys=True, default=str)
        if (known := self._openers.get(key)) is not None:
            return known
        first, later = {"role": "user", "content": "x"}, {"role": "user", "content": "y"}
        reply = {"role": "assistant", "content": "z"}
        opener: list[int] = []
        try:
            prompt = self.render([first], add_generation_prompt=True)
            history = self.render([first, reply, later], False, placeholders=[1])
        except ChatTemplateError:
            history = prompt = ""
        cut = placeholder_at(history, 1)
        if cut is not None and prompt.startswith(before := history[: cut[0]]):
            opener = self.encode(prompt[len(before) :])
        self._openers[key] = opener
        return opener

    def delta(
        self, messages: Sequence[Message], covered: int, last_cached_token: int
    ) -> list[int] | None:
        """Tokens that follow a cache covering ``messages[:covered]``.

        The cache ends inside the rendering of ``messages[covered - 1]``, an assistant reply:
        after its generated content and, if generation stopped on it, an end-of-turn token.
        Returns None when the template does not render that reply where the cache expects it
        (then the caller re-prefills). A template may render less of the generation prompt
        in front of a reply in history than it gave the model (an empty reasoning block,
        ``enable_thinking=False``): the cache holds what the model saw.
        """
        if not 0 < covered < len(messages) or messages[covered - 1]["role"] != "assistant":
            return None
        if self.harmony is not None:  # the reply follows the generation prompt, not a header
            return self.harmony.delta(self, messages, covered, last_cached_token)
        rendered = self.render(messages, add_generation_prompt=True, placeholders=[covered - 1])
        head = self.render(messages[: covered - 1], add_generation_prompt=True)
        cuts = placeholder_at(rendered, 1)
        if cuts is None or not head.startswith(before := rendered[: cuts[0]]):
            return None
        if len(before) < len(self.render(messages[: covered - 1], add_generation_prompt=False)):
            return None  # the reply is not where the generation prompt was
        tail = rendered[cuts[0] + PLACEHOLDER_CHARS :]
        if last_cached_token in self.eos_token_ids:
            eos_text = self.tokenizer.decode([last_cached_token])
            if tail.startswith(eos_text):
                tail = tail[len(eos_text) :]
        tokens = self.encode(tail, images_of(messages[covered:]))
        return tokens or None
