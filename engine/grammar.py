"""Constrained decoding: a request's reply held to a JSON Schema, token by token.

`llguidance <https://github.com/guidance-ai/llguidance>`_ compiles the schema against the
model's tokenizer; at each step of a constrained sequence its matcher says which tokens may
come next, and every other token's logit is set to -inf before sampling (greedy or not). The
model's end-of-sequence tokens are allowed only once the value is complete, so the reply is
exactly one valid JSON value, written compactly (no whitespace between tokens: a model cannot
stall in blank space). Unconstrained sequences in the same batch are not touched.

:meth:`Grammars.json_schema` compiles and checks a schema (in a worker thread: large schemas
take milliseconds); what it cannot compile raises :class:`GrammarError` naming the problem.
The matcher itself is made on the generation thread, on the sequence's first step. The
tokenizer's index the library needs is made once, in a background thread when the engine
opens (``agentkv.engine.token_index``: built and saved on a tokenizer's first start, read back
on later ones).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentkv.engine.call_formats import TOOL_CALL_STYLES, JsonArguments, Tagged, call_format
from agentkv.engine.thinking import ThinkingMarkers, ThinkingState
from agentkv.engine.token_index import token_index

_COMPACT = {"x-guidance": {"whitespace_flexible": False}}

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A schema the grammar library cannot compile (the message says why)."""


@dataclass(slots=True, frozen=True)
class Grammar:
    """A compiled grammar (llguidance's JSON form), checked against the model's tokenizer."""

    source: str


class Grammars:
    """Compiles grammars for one model's tokenizer and makes their logits processors."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        """``tokenizer``: mlx-lm's TokenizerWrapper; ``vocab_size``: the model's logits."""
        self._wrapper = tokenizer
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def warm(self) -> None:
        """Build the tokenizer's index now (seconds for a 262K vocabulary, once per process),
        so the first constrained request does not wait for it."""
        try:
            self._ll_tokenizer()
        except Exception:  # reported again, as a GrammarError, to the request that needs it
            log.exception("preparing the tokenizer for constrained decoding failed")

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = token_index(self._hf)
            return self._tokenizer

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The bytes of each token (a special token: its name), from the tokenizer's index
        (built first if need be: call it off the event loop)."""
        tokenizer = self._ll_tokenizer()
        return [tokenizer.decode_bytes([token]) for token in token_ids]

    @property
    def _hf(self) -> Any:
        """The Hugging Face tokenizer inside mlx-lm's wrapper."""
        return getattr(self._wrapper, "_tokenizer", self._wrapper)

    def _checked(self, source: str) -> Grammar:
        """``source`` as a Grammar, once the library has checked it against the tokenizer."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(source, self._ll_tokenizer())
        if error and not error.startswith("WARNING"):
            raise GrammarError(error)
        return Grammar(source)

    def json_schema(self, schema: dict[str, Any] | None, style: str | None = None) -> Grammar:
        """The grammar of JSON values ``schema`` accepts (None: any JSON object); in
        ``harmony`` (gpt-oss), the reply's final message holding one, its analysis first if
        it reasons. Raises GrammarError for a schema that cannot be compiled."""
        import llguidance

        if schema is not None and not isinstance(schema, dict):
            raise GrammarError(f"a JSON Schema must be an object, got {type(schema).__name__}")
        form = call_format(style).json_arguments if style else None
        if form is not None and form.final is not None:  # the reply is all the format's
            value = json.dumps((schema or {"type": "object"}) | _COMPACT)
            final = self._text(form.final)
            lark = f"start: t? {final} a\na: %json {value}\n{self._thought(form)}\n"
            return self._checked(llguidance.LLMatcher.grammar_from_lark(lark))
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"} if schema is None else json.dumps(schema),
                defaults={"whitespace_flexible": False},  # compact: no runs of blank space
            )
        except (ValueError, TypeError) as exc:
            raise GrammarError(str(exc)) from None
        return self._checked(source)

    def tool_call(
        self,
        start: str,
        end: str,
        tools: list[dict[str, Any]],
        name: str | None,
        style: str = "json_tools",
    ) -> Grammar:
        """The grammar of one tool call between the markers ``start`` and ``end``, in the
        model's format (``style``, the mlx-lm tool parser that reads it; see
        :data:`TOOL_CALL_STYLES`): a call of ``name``, or (None) of any of ``tools`` (OpenAI
        function shape), its arguments held to the tool's parameters schema. Raises
        GrammarError for a name that is not among the tools, a style without a grammar, or a
        parameters schema that cannot compile."""
        import llguidance

        functions = [t.get("function", t) for t in tools]
        chosen = [f for f in functions if name is None or f.get("name") == name]
        if not chosen:
            known = ", ".join(repr(f.get("name")) for f in functions)
            raise GrammarError(f"{name!r} is not among the tools ({known})")
        form = call_format(style)
        if form.tagged is not None:
            lark = self._tagged(start, end, chosen, form.tagged)
            return self._checked(llguidance.LLMatcher.grammar_from_lark(lark))
        if form.json_arguments is not None:
            lark = self._json_arguments(start, end, chosen, form.json_arguments)
            return self._checked(llguidance.LLMatcher.grammar_from_lark(lark))
        if not form.json_object:
            raise GrammarError(
                f"no grammar for the {style!r} tool-call format (one of {TOOL_CALL_STYLES})"
            )

        def call(function: dict[str, Any]) -> dict[str, Any]:
            return {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    "arguments": function.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }

        schema = call(chosen[0]) if len(chosen) == 1 else {"anyOf": [call(f) for f in chosen]}
        schema["x-guidance"] = {"whitespace_flexible": False}
        lark = (
            f'start: {self._literal(start)} "\\n" call "\\n" {self._literal(end)}\n'
            f"call: %json {json.dumps(schema)}\n"
        )
        return self._checked(llguidance.LLMatcher.grammar_from_lark(lark))

    def _tagged(self, start: str, end: str, functions: list[dict[str, Any]], form: Tagged) -> str:
        """Lark for one call in a :class:`Tagged` format: the function's name, then
        the parameters the schema lists, in its order (the required ones always), each its
        key and value in the format's tags; a string's value any text up to the closing tag,
        an enum one of its values, any other type JSON held to its schema."""
        rules, calls = [], []
        for f, function in enumerate(functions):
            schema = function.get("parameters") or {}
            properties = schema.get("properties") or {}
            required = set(schema.get("required") or ())
            parts = [self._text(form.name.format(name=function["name"]))]
            for p, (key, spec) in enumerate(properties.items()):
                value = f"v{f}_{p}"
                opening = self._text(form.key.format(key=key))
                closing = form.value_end
                spec = spec if isinstance(spec, dict) else {}
                if isinstance(spec.get("enum"), list) and spec["enum"]:
                    written = [v if isinstance(v, str) else json.dumps(v) for v in spec["enum"]]
                    rules.append(f"{value}: " + " | ".join(json.dumps(v) for v in written))
                    param = f"{opening} {value} {self._text(closing)}"
                elif spec.get("type") in (None, "string"):  # up to the closing tag, which
                    stop = closing.rstrip("\n")  # the rule consumes
                    rules.append(f"{value}[stop={json.dumps(stop)}]: /(.|\\n)*/")
                    rest = closing[len(stop) :]
                    param = f"{opening} {value}" + (f" {self._text(rest)}" if rest else "")
                else:
                    rules.append(f"{value}: %json {json.dumps(spec)}")
                    param = f"{opening} {value} {self._text(closing)}"
                rules.append(f"p{f}_{p}: {param}")
                parts.append(f"p{f}_{p}" + ("" if key in required else "?"))
            parts.append(self._text(form.call_end))
            rules.append(f"f{f}: " + " ".join(part for part in parts if part))
            calls.append(f"f{f}")
        head = f"start: {self._literal(start)} ({' | '.join(calls)})"
        if end:
            head += f" {self._literal(end)}"
        return "\n".join([head, *rules]) + "\n"

    def _json_arguments(
        self, start: str, end: str, functions: list[dict[str, Any]], form: JsonArguments
    ) -> str:
        """Lark for one call in a :class:`JsonArguments` format: the function's name in the
        format's header, then its arguments as one JSON object held to its schema."""
        rules, calls = [], []
        for f, function in enumerate(functions):
            schema = function.get("parameters") or {"type": "object"}
            head = self._text(form.head.format(name=function["name"]))
            rules.append(f"a{f}: %json {json.dumps(schema | _COMPACT)}")
            rules.append(" ".join(filter(None, (f"f{f}:", head, f"a{f}", self._text(form.tail)))))
            calls.append(f"f{f}")
        if form.thinking is not None:  # the markers are the format's own: the reply is all grammar
            rules.append(self._thought(form))
            return "\n".join([f"start: t? ({' | '.join(calls)})", *rules]) + "\n"
        head = f"start: {self._literal(start)} ({' | '.join(calls)})"
        if end:
            head += f" {self._literal(end)}"
        return "\n".join([head, *rules]) + "\n"

    def _thought(self, form: JsonArguments) -> str:
        """Lark rule ``t``: a format's reasoning message (any text between its markers)."""
        return f"t: {self._text(form.thinking)} /(.|\\n)*/ {self._text(form.thought)}"

    def _text(self, text: str) -> str:
        """Lark for fixed text: its special tokens as tokens (``<[id]>``), the rest as text
        ("" when it is empty)."""
        hf, pieces, at = self._hf, [], 0
        specials = sorted(
            (t for t in hf.all_special_tokens + list(hf.get_added_vocab()) if t and t in text),
            key=len,
            reverse=True,
        )
        while at < len(text):
            token = next((t for t in specials if text.startswith(t, at)), None)
            if token is not None:
                pieces.append(self._literal(token))
                at += len(token)
                continue
            nxt = min((i for t in specials if (i := text.find(t, at)) >= 0), default=len(text))
            pieces.append(json.dumps(text[at:nxt]))
            at = nxt
        return " ".join(pieces)

    def _literal(self, marker: str) -> str:
        """A marker in the grammar: its token (``<[id]>``) when it is one, else its text."""
        hf = self._hf
        token = hf.convert_tokens_to_ids(marker)
        if isinstance(token, int) and token != hf.unk_token_id and hf.decode([token]) == marker:
            return f"<[{token}]>"
        return json.dumps(marker)

    def processor(
        self,
        grammar: Grammar,
        eos_token_ids: frozenset[int],
        thinking: ThinkingMarkers | None = None,
    ) -> GrammarProcessor:
        """The processor holding one reply to ``grammar``; with a reasoning model's
        ``thinking`` markers, the answer after its thinking (see :class:`GrammarProcessor`)."""
        state = None if thinking is None else ThinkingState(thinking)
        return GrammarProcessor(self, grammar, eos_token_ids, self._vocab_size, state)


class GrammarProcessor:
    """An mlx-lm logits processor (``(tokens, logits) -> logits``) for one sequence.

    Its first call sees the prompt (everything the cache holds); each later call, the token
    sampled since, which it feeds to the matcher before masking the next step's logits.

    With a reasoning model's ``thinking`` state, the grammar holds the answer only: while the
    model thinks (the prompt left its thinking open, or the reply's first token opened it:
    unless the template closed it, switched off) any token but an end of the reply or another
    start marker may come, and the grammar starts after the end marker.
    """

    __slots__ = (
        "_eos",
        "_grammar",
        "_grammars",
        "_ll_vocab",
        "_matcher",
        "_seen",
        "_thinking",
        "_vocab_size",
    )

    def __init__(
        self,
        grammars: Grammars,
        grammar: Grammar,
        eos_token_ids: frozenset[int],
        vocab: int,
        thinking: ThinkingState | None = None,
    ):
        self._grammars = grammars
        self._grammar = grammar
        self._eos = [t for t in sorted(eos_token_ids) if t < vocab]
        self._vocab_size = vocab
        self._matcher: Any = None
        self._ll_vocab = 0
        self._seen = 0
        self._thinking = thinking

    def __call__(self, tokens: Any, logits: Any) -> Any:
        """The logits with what the grammar forbids next at -inf. Never raises: an error in
        the grammar library, or a token the grammar did not allow, ends this reply (only end
        tokens left) instead of failing the batch it shares a step with."""
        try:
            allowed = self._allowed(tokens)
        except Exception:
            log.exception("constrained decoding failed; ending the reply")
            allowed = None
        if allowed is None:
            allowed = np.zeros(self._vocab_size, dtype=bool)
            allowed[self._eos] = True
        import mlx.core as mx

        return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), dtype=logits.dtype))

    def _allowed(self, tokens: Any) -> np.ndarray | None:
        """Which tokens may come next (None: only end tokens, the reply left its grammar)."""
        import llguidance
        import llguidance.numpy

        thinking, opening = self._thinking, None
        if thinking is not None:
            new = thinking.update(tokens)
            if thinking.inside:  # the answer, and its grammar, come after the thinking
                self._matcher = None
                allowed = np.ones(self._vocab_size, dtype=bool)
                allowed[self._eos] = False
                if thinking.markers.start < self._vocab_size:
                    allowed[thinking.markers.start] = False  # (thinking does not nest)
                return allowed
            if thinking.markers.end in new:
                self._matcher = None  # the thinking ended: the grammar starts here
            elif thinking.replied == 0 and not thinking.closed:
                opening = thinking.markers.start  # the reply may open its thinking first
        if self._matcher is None:
            ll = self._grammars._ll_tokenizer()
            self._matcher = llguidance.LLMatcher(ll, self._grammar.source)
            self._ll_vocab = ll.vocab_size
            self._seen = tokens.size
        elif not self._matcher.is_stopped():  # (stopped: only an end token can follow, and
            new = tokens[self._seen :].tolist()  # the step built after it is never sampled)
            self._seen = tokens.size
            if not self._matcher.consume_tokens(new):
                log.warning("constrained reply left its grammar: %s", self._matcher.get_error())
                return None
        matcher, ll_vocab = self._matcher, self._ll_vocab
        mask = llguidance.numpy.allocate_token_bitmask(1, ll_vocab)
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:ll_vocab]
        allowed = np.zeros(self._vocab_size, dtype=bool)
        n = min(ll_vocab, self._vocab_size)
        allowed[:n] = bits[:n].astype(bool)
        if matcher.is_accepting() or matcher.is_stopped():
            allowed[self._eos] = True
        if opening is not None and opening < self._vocab_size:
            allowed[opening] = True
        return allowed
