"""Which agent answers a stateless request, and how many such agents are kept: the resolver over
a real runtime (real SQLite file, real tiny model, real cache files), without HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import openai
from mlx_lm.utils import load_tokenizer

from agentkv import AgentRuntime, Reply, RuntimeConfig
from agentkv.messages import common_prefix
from agentkv.models.tiny import tiny_model_dir
from agentkv.server.background import serve_in_thread
from agentkv.server.conversation import TurnRequest
from agentkv.server.identity import Identity
from agentkv.server.metrics import ServerMetrics
from agentkv.server.state import ModelInfo, ServerState
from agentkv.server.stateless import DEFAULT_MAX_STATELESS_AGENTS
from agentkv.server.turns import TurnStream

MODEL = "tiny:gemma3"
LONG_SYSTEM = " ".join(f"Rule {i}: answer politely and briefly about parcels." for i in range(40))


@asynccontextmanager
async def serving(data_dir, max_stateless_agents: int | None) -> AsyncIterator[ServerState]:
    async with await AgentRuntime.open(RuntimeConfig(model=MODEL, data_dir=data_dir)) as rt:
        identity = Identity(rt, 3600, max_stateless_agents)
        await identity.load()
        yield ServerState(rt, identity, ServerMetrics(), ModelInfo.of(rt))


async def ask(state: ServerState, text: str, system: str = "") -> tuple[str, Reply]:
    """A stateless request of one user message: the agent that answered, and its reply."""
    turn = await TurnStream(state, TurnRequest(None, system, [], text, max_tokens=4)).start()
    try:
        events = [event async for event in turn.events()]
    finally:
        await turn.aclose()
    assert isinstance(events[-1], Reply)
    return turn.agent_id, events[-1]


async def agent_ids(rt: AgentRuntime, expected: int) -> list[str]:
    """The agents, once there are ``expected`` (agents over the cap go in the background)."""
    deadline = time.monotonic() + 30
    while len(agents := await rt.list_agents()) != expected:
        assert time.monotonic() < deadline, [a.id for a in agents]
        await asyncio.sleep(0.02)
    return [a.id for a in agents]


async def removed(path: Path) -> None:
    """Returns once ``path`` is gone: an agent over the cap is deleted in the background, its
    registry row first, then its cache files."""
    deadline = time.monotonic() + 30
    while path.exists():
        assert time.monotonic() < deadline, f"{path} is still there"
        await asyncio.sleep(0.02)


async def test_the_cap_deletes_the_stateless_agents_used_least_recently(tmp_path):
    async with serving(tmp_path, max_stateless_agents=2) as state:
        a, _ = await ask(state, "First")
        b, _ = await ask(state, "Second")
        again, reply = await ask(state, "First")  # resent: a answers again, used last now
        assert again == a and reply.cache_source == "hot"
        c, _ = await ask(state, "Third")
        assert sorted(await agent_ids(state.runtime, 2)) == sorted([a, c])
        await removed(tmp_path / "caches" / b)
        # b is gone from the index too: its conversation starts a new agent (and a goes).
        d, _ = await ask(state, "Second")
        assert d not in (a, b, c)
        assert sorted(await agent_ids(state.runtime, 2)) == sorted([c, d])
        assert (await state.runtime.transcript(c))[0].content == "Third"


async def test_blocks_of_deleted_stateless_agents_stay_while_others_list_them(tmp_path):
    async with serving(tmp_path, max_stateless_agents=1) as state:
        first, one = await ask(state, "Where is parcel one?", LONG_SYSTEM)
        second, two = await ask(state, "And parcel two?", LONG_SYSTEM)
        await agent_ids(state.runtime, 1)  # the first is deleted
        await state.runtime.flush()
        third, three = await ask(state, "And parcel three?", LONG_SYSTEM)
        await agent_ids(state.runtime, 1)
        assert len({first, second, third}) == 3
        assert one.cache_source == "none"
        # Each new conversation starts from the system prompt the agents before it stored.
        assert (two.cache_source, three.cache_source) == ("prefix", "prefix")
        assert two.usage.cached_tokens == three.usage.cached_tokens >= 256


async def test_a_restart_with_a_lower_cap_keeps_the_agents_used_last(tmp_path):
    async with serving(tmp_path / "data", max_stateless_agents=None) as state:
        ids = [(await ask(state, text))[0] for text in ("One", "Two", "Three")]
        await ask(state, "One")  # the first is used last now
    async with serving(tmp_path / "data", max_stateless_agents=2) as state:
        assert sorted(await agent_ids(state.runtime, 2)) == sorted([ids[0], ids[2]])
    assert DEFAULT_MAX_STATELESS_AGENTS == 256


def test_a_stateless_conversation_with_tools_resumes_from_disk_after_a_restart(tmp_path):
    # Frameworks send tools with every request of an agent and no agent id: the conversation
    # is matched on system prompt and tools, the same key stored, rebuilt at open and asked.
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    config = RuntimeConfig(model="tiny:tools", data_dir=tmp_path)
    messages = [
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "Will it rain in Oslo?"},
    ]

    def turn(url: str, follow_up: str) -> tuple[str, int, int]:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none") as client:
            raw = client.chat.completions.with_raw_response.create(
                model="m", max_tokens=6, messages=messages, tools=[weather]
            )
        completion = raw.parse()
        message = completion.choices[0].message
        assert not message.tool_calls
        messages.extend(
            [
                {"role": "assistant", "content": message.content},
                {"role": "user", "content": follow_up},
            ]
        )
        usage = completion.usage
        cached = usage.prompt_tokens_details.cached_tokens
        return raw.headers["x-agent-id"], cached, usage.prompt_tokens + usage.completion_tokens

    with serve_in_thread(config) as url:
        first, cached, _ = turn(url, "And in Bergen?")
        assert cached == 0
        second, _, held = turn(url, "And tomorrow?")
    with serve_in_thread(config) as url:  # a restart
        third, cached, _ = turn(url, "Thanks.")
    assert first == second == third
    assert cached == held  # everything the agent held, from its cache on disk


def test_a_client_that_drops_or_rewrites_its_last_reply_resumes_the_same_agent(tmp_path):
    # pydantic-ai drops a reply it cannot use and asks again with a system message; the OpenAI
    # Agents SDK leaves an empty final reply out. Either way the next request no longer extends
    # the agent's transcript, only its transcript before that reply: the agent answers it, its
    # last reply replaced, the cache reused up to where the conversations differ.
    tokenizer = load_tokenizer(tiny_model_dir("tiny:llama"))

    def tokens(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def turn(url: str, messages: list[dict]) -> tuple[str, str, int, int]:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none") as client:
            raw = client.chat.completions.with_raw_response.create(
                model="m", max_tokens=6, messages=messages
            )
        completion, agent = raw.parse(), raw.headers["x-agent-id"]
        usage = completion.usage
        text = completion.choices[0].message.content
        return agent, text, usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

    retry = {"role": "system", "content": "Please return text or call a tool."}
    config = RuntimeConfig(model="tiny:llama", data_dir=tmp_path)
    with serve_in_thread(config) as url:
        for system, rewritten in ((LONG_SYSTEM, retry), ("Be brief. " + LONG_SYSTEM, None)):
            asked = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
            agent, text, _, _ = turn(url, asked)
            extended = [*asked, {"role": "assistant", "content": text}]
            extended.append({"role": "user", "content": "Go on"})
            again, _, _, held = turn(url, extended)  # the agent holds its prompt and a reply
            assert again == agent
            dropped = [*extended, rewritten or {"role": "user", "content": "Well?"}]
            again, _, cached, prompt = turn(url, dropped)  # that reply left out
            assert again == agent
            # Reused up to where the two prompts differ: the reply's place (its header).
            differs = common_prefix(tokens(extended), tokens(dropped))
            assert cached == held - (len(tokens(extended)) - differs)
            assert cached / prompt > 0.9
