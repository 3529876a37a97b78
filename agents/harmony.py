"""OpenAI's harmony format (gpt-oss): prompts written and replies read with ``openai-harmony``.

A harmony model answers in messages on channels: its reasoning on ``analysis``, its answer on
``final``, a tool call on ``commentary`` addressed to ``functions.<name>`` (JSON arguments),
each message opened by ``<|start|>`` and a header and closed by ``<|end|>`` (``<|call|>`` after a
call, ``<|return|>`` after the answer). :class:`Harmony` renders conversations (system and
developer messages, tools as a TypeScript namespace, earlier reasoning dropped after a later
answer, as the format asks) and takes replies apart: it plays the part of the reasoning markers
(``agentkv.reasoning``) and of the tool-call format (``agentkv.tool_calls``) for such a model.

Transcripts store a reply as the model wrote it; an assistant message whose text carries the
format's markup is read back into its messages when rendered, plain text is a ``final`` message.

``openai-harmony`` reads the o200k vocabulary (``o200k_base.tiktoken``) from the folder
``TIKTOKEN_ENCODINGS_BASE`` names, else downloads it. A gpt-oss tokenizer holds that vocabulary
whole: unless the variable is set, it is written from the model's own tokenizer (checked against
the file's published SHA-256) into ``<data_dir>/tiktoken``, so no download is needed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentkv.call_stream import CallStream
from agentkv.cut_calls import partial_object
from agentkv.engine.errors import UnsupportedModelError
from agentkv.engine.models.o200k import VOCAB_ENV, VOCAB_FILE, ids_of, write_vocab
from agentkv.errors import ChatTemplateError
from agentkv.escapes import is_placeholder
from agentkv.harmony_stream import HarmonySplitter
from agentkv.tool_calls import ParsedReply, ToolCall

CONTROLS = {
    "<|return|>": 200002,
    "<|constrain|>": 200003,
    "<|channel|>": 200005,
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|call|>": 200012,
}
"""The format's control tokens and their ids in o200k_harmony."""
EFFORTS = ("low", "medium", "high")
TEMPLATE_KWARGS = ("reasoning_effort", "enable_thinking", "model_identity")
"""Chat template variables a harmony prompt takes (``enable_thinking=False``: low effort; the
model always reasons)."""
FUNCTIONS = "functions."
LAST_CALL = ""  # (in the names of calls by id: the latest call's, ids are never empty)
JSON_TYPE = "<|constrain|>json"


_WRITTEN: set[str] = set()  # the folders this process named in VOCAB_ENV itself


def speaks_harmony(tokenizer: Any) -> bool:
    """Whether an mlx-lm TokenizerWrapper's vocabulary is o200k_harmony's (gpt-oss)."""
    return ids_of(tokenizer, list(CONTROLS)) == list(CONTROLS.values())


class Harmony:
    """A harmony model's prompts and replies (see the module docstring)."""

    style = "harmony"
    forcible = True  # engine.grammar writes a forced call's grammar (engine.call_formats)
    start = "<|start|>"
    end = "<|call|>"
    controls = tuple(CONTROLS)
    stops = (CONTROLS["<|return|>"], CONTROLS["<|call|>"])

    def __init__(self, encoding: Any):
        self.encoding = encoding

    @classmethod
    def of(cls, tokenizer: Any, model: str, data_dir: Path) -> Harmony | None:
        """The format of a model whose tokenizer speaks harmony, else None. Raises
        UnsupportedModelError when ``openai-harmony`` or its vocabulary cannot be had."""
        if not speaks_harmony(tokenizer):
            return None
        try:
            import openai_harmony as oh
        except ImportError as exc:
            raise UnsupportedModelError(
                f"model {model!r} speaks OpenAI's harmony format, which needs the "
                "openai-harmony package (pip install openai-harmony)"
            ) from exc
        given = os.environ.get(VOCAB_ENV)
        if not given or (given in _WRITTEN and not (Path(given) / VOCAB_FILE).exists()):
            folder = (data_dir / "tiktoken").resolve()
            if (folder / VOCAB_FILE).exists() or write_vocab(tokenizer, folder):
                os.environ[VOCAB_ENV] = str(folder)
                _WRITTEN.add(str(folder))
        try:
            encoding = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as exc:  # HarmonyError: the vocabulary could not be read or fetched
            raise UnsupportedModelError(
                f"model {model!r} speaks OpenAI's harmony format, but openai-harmony could not "
                f"load the o200k vocabulary ({exc}); put {VOCAB_FILE} in a folder and name it "
                f"in {VOCAB_ENV}"
            ) from exc
        return cls(encoding)

    # ---- prompts -----------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> str:
        """The conversation in harmony, as text (control tokens spelled out). Raises
        ChatTemplateError for a conversation or variables the format cannot take."""
        import openai_harmony as oh

        rest = list(messages)
        instructions = ""
        if rest and rest[0].get("role") in ("system", "developer"):
            instructions = _text(rest.pop(0).get("content"))
        conversation = [oh.Message.from_role_and_content(oh.Role.SYSTEM, _system(kwargs))]
        if instructions or tools:
            developer = oh.DeveloperContent.new()
            if instructions:
                developer = developer.with_instructions(instructions)
            if tools:
                developer = developer.with_function_tools(_tool_descriptions(tools))
            conversation.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
        names: dict[str, str] = {}  # tool call ids → function names
        placeholders = []
        for message in rest:
            if message.get("role") == "assistant" and is_placeholder(message.get("content")):
                placeholders.append(message["content"])
            conversation += self._messages(message, names)
        try:
            convo = oh.Conversation.from_messages(conversation)
            if add_generation_prompt:
                tokens = self.encoding.render_conversation_for_completion(convo, oh.Role.ASSISTANT)
            else:
                tokens = self.encoding.render_conversation(convo)
            text = self.encoding.decode_utf8(tokens)
        except Exception as exc:  # HarmonyError
            raise ChatTemplateError(f"harmony cannot render the conversation: {exc}") from exc
        # A reply's tokens (a placeholder's) follow the generation prompt as the model wrote
        # them: its own headers and its last token (``<|return|>``, ``<|call|>``) included.
        for held in placeholders:
            for close in ("<|end|>", "<|return|>"):
                text = text.replace(
                    f"{self.start}assistant<|channel|>final<|message|>{held}{close}",
                    f"{self.start}assistant{held}",
                )
        return text

    def _messages(self, message: dict[str, Any], names: dict[str, str]) -> list[Any]:
        import openai_harmony as oh

        role, text = message.get("role"), _text(message.get("content"))
        if role == "user":
            return [oh.Message.from_role_and_content(oh.Role.USER, text)]
        if role in ("system", "developer"):
            return [oh.Message.from_role_and_content(oh.Role.DEVELOPER, text)]
        if role == "tool":  # by its call's id, its name, else the last call's (as stored)
            name = names.get(message.get("tool_call_id") or "") or message.get("name")
            if not (name := name or names.get(LAST_CALL)):
                raise ChatTemplateError("harmony: a tool message must answer a call before it")
            author = oh.Author.new(oh.Role.TOOL, FUNCTIONS + name)
            reply = oh.Message.from_author_and_content(author, text)
            return [reply.with_channel("commentary").with_recipient("assistant")]
        if role != "assistant":
            raise ChatTemplateError(f"harmony: no role {role!r}")
        calls = message.get("tool_calls") or []
        for call in calls:
            names[call.get("id") or ""] = names[LAST_CALL] = (call.get("function") or call)["name"]
        if is_placeholder(text):  # a generated reply, its calls included (see render)
            return [_assistant(text, "final")]
        out = []
        if thinking := message.get("reasoning_content"):
            out.append(_assistant(str(thinking), "analysis"))
        out += self.read(text, plain="final") if text else []
        for call in calls:
            function = call.get("function") or call
            arguments = function.get("arguments")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            out.append(_call(function["name"], arguments))
        for made in out:  # calls stored as markup in the text too
            if (made.recipient or "").startswith(FUNCTIONS):
                names[LAST_CALL] = made.recipient[len(FUNCTIONS) :]
        return out

    def delta(
        self, renderer: Any, messages: Sequence[dict[str, Any]], covered: int, last: int
    ) -> list[int] | None:
        """Tokens that follow a cache covering ``messages[:covered]`` (``renderer``: the
        ``ChatRenderer``), whose last token ``last`` ended the reply ``messages[covered - 1]``:
        the later messages and the generation prompt. The reply's own tokens are what the model
        wrote (its reasoning kept; ``<|return|>`` where the history would close with
        ``<|end|>``); a reply cut short (``max_tokens``) is closed with ``<|end|>``, as the
        history closes it."""
        if not 0 < covered < len(messages):
            return None
        head = renderer.render(messages[:covered], add_generation_prompt=False)
        whole = renderer.render(messages, add_generation_prompt=True)
        if not whole.startswith(head):
            return None
        closing = "" if last in self.stops else "<|end|>"
        return renderer.encode(closing + whole[len(head) :]) or None

    # ---- replies -----------------------------------------------------------------------------

    def read(self, text: str, plain: str | None = None) -> list[Any]:
        """The messages of a reply's text (as generated after ``<|start|>assistant``, or plain
        text followed by markup, as transcripts store a reply with tool calls). Text that is
        not harmony is one message on channel ``plain``, or none without one."""
        import openai_harmony as oh

        generated = text.startswith("<|channel|>")  # the header's role is the prompt's
        at = 0 if generated else text.find(self.start)
        head, markup = (text, "") if at < 0 else (text[:at], text[at:])
        out = [_assistant(head, plain)] if head and plain else []
        if not markup:
            return out
        parser = oh.StreamableParser(self.encoding, oh.Role.ASSISTANT if generated else None)
        try:
            for token in self.encoding.encode(markup, allowed_special="all"):
                parser.process(token)
            parser.process_eos()
        except Exception:  # HarmonyError: not the format after all
            return [*out, _assistant(markup, plain)] if plain else out
        return [*out, *parser.messages]

    def split(self, text: str, opened: bool = False) -> tuple[str, str]:
        """A whole reply's (reasoning, answer): the analysis messages, and the rest (final
        and commentary text, then tool calls as their markup)."""
        reasoning, answer, calls = [], [], []
        for message in self.read(text, plain="final"):
            if message.channel == "analysis":
                reasoning.append(_text_of(message))
            elif message.recipient:
                calls.append(self.encoding.decode_utf8(self.encoding.render(message)))
            else:
                answer.append(_text_of(message))
        return "\n\n".join(reasoning), "".join(answer) + "".join(calls)

    def tokens_of(self, reply: Sequence[int], opened: bool = False) -> int:
        """How many of a reply's tokens are reasoning (the analysis messages' text)."""
        import openai_harmony as oh

        parser = oh.StreamableParser(self.encoding, oh.Role.ASSISTANT)
        count = 0
        try:
            for token in reply:
                parser.process(token)
                if parser.current_channel == "analysis" and parser.last_content_delta:
                    count += 1
        except Exception:  # HarmonyError: the reply left the format
            pass
        return count

    def opened(self, prompt: Sequence[int]) -> bool:
        return False  # a harmony prompt leaves no message open: the reply writes its header

    def splitter(self, opened: bool = False) -> HarmonySplitter:
        return HarmonySplitter(self.encoding, self.controls)

    def call_stream(self) -> CallStream | None:
        return CallStream.of(self.start, self.end, self.style)

    def parse(
        self, text: str, tools: list[dict[str, Any]] | None = None, cut: bool = False
    ) -> ParsedReply:
        """An answer (:meth:`split`'s) as plain text and tool calls; a call to something
        other than a function, or whose arguments are not a JSON object, stays text. With
        ``cut`` (the reply was cut short), a last call is read as far as it was written, and a
        message whose header was cut is dropped (``agentkv.cut_calls``)."""
        plain, calls, cut_call = [], [], False
        messages = self.read(text, plain="final")
        for i, message in enumerate(messages):
            body = _text_of(message)
            if message.recipient and message.recipient.startswith(FUNCTIONS):
                name = message.recipient[len(FUNCTIONS) :]
                try:
                    arguments = json.loads(body)
                except ValueError:
                    arguments = None
                if isinstance(arguments, dict):
                    calls.append(ToolCall(name, arguments))
                    continue
                if cut and i == len(messages) - 1:
                    calls.append(ToolCall(name, partial_object(body), written=body, cut=True))
                    cut_call = True
                    continue
            if message.recipient:  # kept as written
                plain.append(self.encoding.decode_utf8(self.encoding.render(message)))
            elif message.channel != "analysis":
                plain.append(body)
        answer = "".join(plain)
        if cut and not cut_call and (at := answer.find(self.start)) >= 0:
            answer = answer[:at]  # a message whose header was cut
        return ParsedReply(answer, tuple(calls))

    def markup(self, calls: list[ToolCall]) -> str:
        """Calls as harmony writes them (how transcripts store them)."""
        rendered = (self.encoding.render(_call(c.name, json.dumps(c.arguments))) for c in calls)
        return "".join(self.encoding.decode_utf8(tokens) for tokens in rendered)

    def streaming_split(self, text: str) -> int:
        """How much of a growing answer is plain text: all of it up to a call's markup."""
        found = text.find(self.start)
        return len(text) if found < 0 else found


def _system(kwargs: dict[str, Any]) -> Any:
    import openai_harmony as oh

    unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise ChatTemplateError(
            f"chat_template_kwargs: {', '.join(unknown)} not taken by a harmony model "
            f"(it takes {', '.join(TEMPLATE_KWARGS)})"
        )
    effort = kwargs.get("reasoning_effort")
    if effort is None:
        effort = "low" if kwargs.get("enable_thinking") is False else "medium"
    if effort not in EFFORTS:
        raise ChatTemplateError(
            f"reasoning_effort: {effort!r} is not one of {', '.join(EFFORTS)} for a harmony model"
        )
    system = oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort(effort.title()))
    if identity := kwargs.get("model_identity"):
        system = system.with_model_identity(str(identity))
    return system


def _tool_descriptions(tools: list[dict[str, Any]]) -> list[Any]:
    import openai_harmony as oh

    out = []
    for tool in tools:
        function = tool.get("function") or tool
        out.append(
            oh.ToolDescription.new(
                function["name"], function.get("description") or "", function.get("parameters")
            )
        )
    return out


def _assistant(text: str, channel: str | None) -> Any:
    import openai_harmony as oh

    message = oh.Message.from_role_and_content(oh.Role.ASSISTANT, text)
    return message.with_channel(channel) if channel else message


def _call(name: str, arguments: str) -> Any:
    call = _assistant(arguments, "commentary").with_recipient(FUNCTIONS + name)
    return call.with_content_type(JSON_TYPE)


def _text(content: Any) -> str:
    """A message's text: a string, or OpenAI-style text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _text_of(message: Any) -> str:
    return "".join(getattr(part, "text", "") for part in message.content)
