"""Prompt deltas under a strict, Gemma-3-like template: content is trimmed, roles must alternate."""

from __future__ import annotations

import json
import shutil

import pytest

from agents import AgentRuntime, ChatTemplateError, RuntimeConfig
from agents.prompt import ChatRenderer
from engine.models.loading import load_model
from engine.models.tiny import tiny_model_dir

# Like the official Gemma-3 template: the system prompt is folded into the first user turn,
# content is trimmed, and user/assistant must alternate.
STRICT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] | trim + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def strict_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("strict") / "model"
    shutil.copytree(tiny_model_dir("tiny:gemma3"), path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = STRICT_TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def renderer(strict_model):
    model = load_model(strict_model)
    return ChatRenderer(model.tokenizer, model.eos_token_ids)


@pytest.mark.parametrize("reply", ["Hello there.", "Hello there.\n", " Hello", "Hello  "])
def test_delta_survives_trimmed_content(renderer, reply):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And then?"},
    ]
    end_of_turn = renderer.encode("<end_of_turn>")[0]
    delta = renderer.delta(messages, 3, end_of_turn)
    # The generated reply (whatever its whitespace) and its end-of-turn token are in the cache;
    # what follows is the newline that closes the turn and the new user turn.
    assert delta == renderer.encode(
        "\n<start_of_turn>user\nAnd then?<end_of_turn>\n<start_of_turn>model\n"
    )
    cut_by_length = renderer.delta(messages, 3, renderer.encode("x")[0])
    assert cut_by_length == renderer.encode("<end_of_turn>") + delta


async def test_strict_template_runtime_resumes_and_refuses_non_alternating_history(
    tmp_path, strict_model
):
    config = RuntimeConfig(model=str(strict_model), data_dir=tmp_path, kv_bits=None)
    async with await AgentRuntime.open(config) as rt:
        await rt.create_agent("s", system_prompt="Be brief.")
        first = await rt.chat("s", "Hi", max_tokens=12)
        second = await rt.chat("s", "More", max_tokens=12)
        assert (first.cache_source, second.cache_source) == ("none", "hot")
        with pytest.raises(ChatTemplateError, match="alternate"):
            await rt.append_messages("s", [{"role": "user", "content": u} for u in ("a", "b")])
        assert len(await rt.transcript("s")) == 4  # nothing stored
    async with await AgentRuntime.open(config) as rt:
        assert (await rt.chat("s", "Again", max_tokens=4)).cache_source == "disk"
