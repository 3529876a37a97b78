"""A Responses API request's input, instructions and tools, as a conversation to answer.

``input`` is a string (one user message) or a list of items: messages (roles ``user``,
``assistant``, ``system``, ``developer``; content a string or ``input_text`` / ``output_text``
parts), ``function_call`` (an assistant's call: ``call_id``, ``name``, JSON ``arguments``) and
``function_call_output`` (its result, answering a call of the assistant turn before it by
``call_id``). ``instructions`` and the system and developer messages before the first other
item are the system prompt; later ones are rendered where they are. A ``reasoning`` item's
text (its ``reasoning_text`` content, else its summary) becomes the ``reasoning_content`` of the
assistant turn after it, which the chat template renders where it keeps earlier reasoning; one
with only encrypted content (another server's) is left out. ``input_image`` parts (data URLs)
of user messages and function outputs are images. Anything else (files, item references) is
refused, naming the item.

Function tools (and the functions inside a ``namespace`` tool, whose calls come back with the
namespace's name) are offered to the model; other tool types (``web_search``, ``file_search``,
MCP, custom) are hosted tools this server does not run: they are left out and logged, not
refused, since clients such as Codex always send some.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.prompt import Message
from agentkv.server.api.image_blocks import joined, responses_image
from agentkv.server.bodies import arguments_value
from agentkv.server.conversation import TEXT_JOINER, checked_text
from agentkv.server.errors import APIError

log = logging.getLogger(__name__)

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


@dataclass(slots=True)
class Conversation:
    """A request's conversation: the system prompt, the messages after it (chat-template
    shape), the tools in OpenAI's function shape, and the namespace of each namespaced one."""

    system: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    namespaces: dict[str, str] = field(default_factory=dict)

    @property
    def document(self) -> list[Message]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.messages]


def conversation(
    input_: str | list[Any],
    instructions: str | None,
    tools: list[Any] | None,
    earlier: Sequence[Any] = (),
) -> Conversation:
    """Read a request's ``input``, ``instructions`` and ``tools``, after the ``earlier`` items
    of the responses it continues (``previous_response_id``). Raises APIError (400)."""
    systems = [checked_text(instructions, "instructions")] if instructions else []
    messages: list[Message] = []
    reader = _Reader(systems, messages)
    reader.read(earlier, "previous_response_id")
    if isinstance(input_, str):
        messages.append({"role": "user", "content": checked_text(input_, "input")})
    else:
        reader.read(input_, "input")
    offered, namespaces = function_tools(tools or [])
    return Conversation(TEXT_JOINER.join(systems), messages, offered or None, namespaces)


class _Reader:
    def __init__(self, systems: list[str], messages: list[Message]):
        self.systems = systems
        self.messages = messages
        self.calls: set[str] = set()  # call ids of the assistant turn before (for outputs)
        self.thinking: list[str] = []  # reasoning items' text, for the next assistant turn

    def read(self, items: Sequence[Any], label: str) -> None:
        for i, item in enumerate(items):
            where = f"{label}.{i}"
            if not isinstance(item, dict):
                raise APIError.invalid(f"{where}: an input item must be an object", where)
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                self.message(item, where)
            elif kind == "function_call":
                self.function_call(item, where)
            elif kind == "function_call_output":
                self.function_output(item, where)
            elif kind == "reasoning":
                self.reasoning(item, where)
            else:
                raise APIError.invalid(
                    f"{where}.type: {kind!r} items are not supported (messages, function_call "
                    "and function_call_output are)",
                    f"{where}.type",
                )

    def reasoning(self, item: dict[str, Any], where: str) -> None:
        """A reasoning item: its text waits for the assistant turn it preceded."""
        parts = item.get("content") or item.get("summary") or []
        if not isinstance(parts, list):
            raise APIError.invalid(f"{where}.content: must be a list of parts", f"{where}.content")
        for j, part in enumerate(parts):
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(text, str):
                raise APIError.invalid(f"{where}.content.{j}.text: required (a string)", where)
            self.thinking.append(checked_text(text, f"{where}.content.{j}.text"))

    def _assistant(self, message: dict[str, Any]) -> dict[str, Any]:
        """An assistant turn starting now, with the reasoning items read before it."""
        if self.thinking:
            message["reasoning_content"] = "\n".join(self.thinking)
            self.thinking = []
        return message

    def message(self, item: dict[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError.invalid(
                f"{where}.role: {role!r} is not one of user, assistant, system, developer",
                f"{where}.role",
            )
        text = _text(item.get("content"), f"{where}.content", images=role == "user")
        if role in ("system", "developer"):
            if not self.messages:
                self.systems.append(text)
                return
            role = "system"
        if role == "assistant":
            self.calls = set()
            self.messages.append(self._assistant({"role": role, "content": text}))
            return
        self.messages.append({"role": role, "content": text})

    def function_call(self, item: dict[str, Any], where: str) -> None:
        call_id, name = item.get("call_id"), item.get("name")
        if not isinstance(call_id, str) or not call_id:
            raise APIError.invalid(f"{where}.call_id: required (a string)", f"{where}.call_id")
        if not isinstance(name, str) or not name:
            raise APIError.invalid(f"{where}.name: required (a string)", f"{where}.name")
        arguments = item.get("arguments", "{}")
        try:
            parsed = arguments_value(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise APIError.invalid(
                f"{where}.arguments: must be a JSON object, as a string", f"{where}.arguments"
            )
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # the same assistant turn
        else:
            message = {"role": "assistant", "content": "", "tool_calls": [call]}
            self.messages.append(self._assistant(message))
            self.calls = set()
        self.calls.add(call_id)

    def function_output(self, item: dict[str, Any], where: str) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or call_id not in self.calls:
            raise APIError.invalid(
                f"{where}.call_id: {call_id!r} names no function_call of the assistant turn "
                "before it",
                f"{where}.call_id",
            )
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, f"{where}.output", True)
        self.messages.append({"role": "tool", "content": text, "tool_call_id": call_id})


def _text(content: Any, where: str, images: bool = False) -> Any:
    """A message's text: a string, or text parts joined; with ``images`` (a user message, a
    function's output) its parts where it holds ``input_image`` parts. Anything else is
    refused."""
    if isinstance(content, str):
        return checked_text(content, where)
    if not isinstance(content, list):
        raise APIError.invalid(f"{where}: must be a string or a list of text parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if images and kind == "input_image":
            parts.append(responses_image(part, f"{where}.{j}"))
            continue
        if not isinstance(kind, str) or kind not in TEXT_PARTS or not isinstance(text, str):
            readable = "input_text, output_text" + (", input_image" if images else "")
            raise APIError.invalid(
                f"{where}.{j}: {kind!r} parts are not supported (this server reads {readable})",
                f"{where}.{j}",
            )
        parts.append({"type": "text", "text": checked_text(text, f"{where}.{j}.text")})
    return joined(parts, TEXT_JOINER)


def function_tools(tools: list[Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The function tools (namespaces' functions included) in chat-template shape, and the
    namespace of each namespaced function's name. Other tool types are left out (logged)."""
    offered: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    names: set[str] = set()

    def add(tool: dict[str, Any], where: str, namespace: str | None) -> None:
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise APIError.invalid(f"{where}.name: required (a string)", f"{where}.name")
        if name in names:
            raise APIError.invalid(f"{where}.name: {name!r} is offered twice", f"{where}.name")
        names.add(name)
        parameters = tool.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            raise APIError.invalid(
                f"{where}.parameters: must be a JSON Schema object", f"{where}.parameters"
            )
        function = {"name": name, "parameters": parameters}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise APIError.invalid(
                    f"{where}.description: must be a string", f"{where}.description"
                )
            function["description"] = tool["description"]
        offered.append({"type": "function", "function": function})
        if namespace is not None:
            namespaces[name] = namespace

    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise APIError.invalid(f"{where}: a tool must be an object", where)
        kind = tool.get("type")
        if kind == "function":
            add(tool, where, None)
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list) or not isinstance(tool.get("name"), str):
                raise APIError.invalid(f"{where}: a namespace needs a name and tools", where)
            for j, member in enumerate(inner):
                if not isinstance(member, dict):
                    raise APIError.invalid(f"{where}.tools.{j}: must be an object", where)
                if member.get("type") == "function":
                    add(member, f"{where}.tools.{j}", tool["name"])
                else:
                    _left_out(member, f"{where}.tools.{j}")
        else:
            _left_out(tool, where)
    return offered, namespaces


def _left_out(tool: Any, where: str) -> None:
    kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
    log.info("%s: a %r tool is hosted by OpenAI, not run here: left out", where, kind)
