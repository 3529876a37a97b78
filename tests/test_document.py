"""Whole-conversation turns (AgentRuntime.respond): the longest common token prefix is reused."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from agentkv import AgentRuntime, Reply, RuntimeConfig, SamplingParams
from agentkv.messages import common_prefix
from agentkv.models.tiny import tiny_model_dir


def config(data_dir: Path, model: str) -> RuntimeConfig:
    return RuntimeConfig(model=model, data_dir=data_dir)


async def respond(rt: AgentRuntime, agent_id: str, messages: list[dict], **kw) -> Reply:
    reply = None
    async for event in rt.respond(agent_id, messages, **({"max_tokens": 8} | kw)):
        reply = event
    assert isinstance(reply, Reply)
    return reply


def tokens(model: str, messages: list[dict]) -> list[int]:
    tokenizer = load_tokenizer(tiny_model_dir(model))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


async def test_edited_system_prompt_reprefills_only_what_changed(tmp_path):
    model = "tiny:llama"  # global attention only: any prefix of a cache can be kept
    base = "You are a careful assistant who checks every answer twice. "
    first = [system(base + "Answer briefly."), user("Hello")]
    edited = [system(base + "Answer at length."), user("Hello")]
    async with await AgentRuntime.open(config(tmp_path, model)) as rt:
        await rt.create_agent("doc")
        one = await respond(rt, "doc", first)
        two = await respond(rt, "doc", edited)
        transcript = [(str(m.role), m.content) for m in await rt.transcript("doc")]
        agent = await rt.get_agent("doc")
    shared = common_prefix([*tokens(model, first), *one.token_ids], tokens(model, edited))
    assert one.usage.cached_tokens == 0 and one.cache_source == "none"
    assert 0 < shared < len(tokens(model, edited))
    assert two.usage.cached_tokens == shared and two.cache_source == "hot"
    assert two.usage.prompt_tokens == len(tokens(model, edited))
    # The conversation replaced the transcript; its system message is the system prompt.
    assert transcript == [("user", "Hello"), ("assistant", two.text)]
    assert agent.system_prompt == base + "Answer at length."


async def test_follow_up_resumes_the_whole_cache_with_the_reply_spliced_in(tmp_path):
    model = "tiny:llama"
    conversation = [system("Be brief."), user("Hi"), system("The user is in a hurry.")]
    async with await AgentRuntime.open(config(tmp_path, model)) as rt:
        await rt.create_agent("doc")
        one = await respond(rt, "doc", conversation)
        conversation += [{"role": "assistant", "content": one.text}, user("More")]
        two = await respond(rt, "doc", conversation)
    assert two.usage.cached_tokens == one.usage.prompt_tokens + one.usage.completion_tokens


async def test_dropped_messages_reprefill_from_the_first_change(tmp_path):
    model = "tiny:llama"
    conversation = [system("Be brief."), user("First question")]
    async with await AgentRuntime.open(config(tmp_path, model)) as rt:
        await rt.create_agent("doc")
        one = await respond(rt, "doc", conversation)
        conversation += [{"role": "assistant", "content": one.text}, user("Second question")]
        await respond(rt, "doc", conversation)
        compacted = [system("Be brief."), user("Second question")]  # the first exchange dropped
        three = await respond(rt, "doc", compacted)
    shared = common_prefix(tokens(model, conversation[:2]), tokens(model, compacted))
    assert three.usage.cached_tokens == shared > 0


async def test_after_a_restart_replies_are_found_in_the_cache_on_disk(tmp_path):
    model = "tiny:tools"
    weather = {"type": "function", "function": {"name": "weather", "parameters": {}}}
    conversation = [system("Be brief."), user("Hi")]
    async with await AgentRuntime.open(config(tmp_path, model)) as rt:
        await rt.create_agent("doc")
        one = await respond(rt, "doc", conversation, tools=[weather])
        conversation += [{"role": "assistant", "content": one.text}, user("More")]
        two = await respond(rt, "doc", conversation, tools=[weather])
    conversation += [{"role": "assistant", "content": two.text}, user("Again")]
    async with await AgentRuntime.open(config(tmp_path, model)) as rt:
        three = await respond(rt, "doc", conversation, tools=[weather])
    assert three.cache_source == "disk"
    assert three.usage.cached_tokens == two.usage.prompt_tokens + two.usage.completion_tokens


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
async def test_a_slid_window_cannot_be_cut_so_the_prompt_is_rebuilt(tmp_path, model):
    # Sliding-window layers (window 32) or recurrent state: an old prefix is gone
    long = "You are a careful assistant who checks every answer twice and thrice. " * 3
    async with await AgentRuntime.open(config(tmp_path, model)) as rt:
        await rt.create_agent("doc")
        await respond(rt, "doc", [system(long + "A."), user("Hello")])
        edited = await respond(rt, "doc", [system(long + "B."), user("Hello")])
    assert edited.cache_source == "rebuilt" and edited.usage.cached_tokens == 0


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
async def test_a_rewritten_last_turn_resumes_exactly_from_the_turn_before(tmp_path, model):
    # Sliding windows of 32 tokens (or recurrent state): once the last turn moved them on,
    # the cache cannot be cut back inside it; the checkpoint kept where the turn began can.
    cfg = RuntimeConfig(model=model, data_dir=tmp_path, kv_bits=None)
    head = [system("Answer briefly."), user("Tell me about the sea and the sky.")]
    question = " ".join(f"Then say what colour the water is on day {i}." for i in range(8))
    async with await AgentRuntime.open(cfg) as rt:
        for agent_id in ("rewritten", "fresh"):
            await rt.create_agent(agent_id)
        first = await respond(rt, "rewritten", head)
        assert (await respond(rt, "fresh", head)).token_ids == first.token_ids
        asked = [*head, {"role": "assistant", "content": first.text}, user(question)]
        second = await respond(rt, "rewritten", asked)
        assert second.cache_source == "hot" and second.usage.prompt_tokens > (
            second.usage.cached_tokens + 32
        )
        # Resent with the last user turn changed (as Claude Code adds a nudge to a turn whose
        # reply was empty): resumed from the turn before, not rebuilt from a shared head.
        rewritten = [*asked[:-1], user(question + " Answer now, please.")]
        again = await respond(rt, "rewritten", rewritten)
        assert again.cache_source == "hot"
        assert again.usage.cached_tokens == second.usage.cached_tokens
        # Exactly the tokens of an agent that never had the rewritten turn (it resumes the
        # rewritten conversation's history from the agent that had it: its own cache ends
        # sooner).
        alone = await respond(rt, "fresh", rewritten)
        history = len(tokens(model, rewritten)) - len(generation_prompt(model))
        assert (alone.cache_source, alone.usage.cached_tokens) == ("prefix", history)
        assert again.token_ids == alone.token_ids
        # The reply to the rewrite is the turn now: its own boundary is kept in turn.
        assert (await respond(rt, "rewritten", [*rewritten, user("And?")])).cache_source == "hot"


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
async def test_a_reply_sent_back_rewritten_resumes_where_it_began_after_a_restart(tmp_path, model):
    # A framework that sends its reply back as its own text (smolagents' "Calling tools: …"):
    # the window (32 tokens) or recurrent state moved on over the reply, so only the
    # checkpoint kept where its history ended gives the prompt back; the saved cache keeps it.
    cfg = RuntimeConfig(model=model, data_dir=tmp_path, kv_bits=None)
    asked = [system("Answer briefly."), user("Tell me about the sea and the sky, please.")]
    async with await AgentRuntime.open(cfg) as rt:
        await rt.create_agent("doc")
        await rt.create_agent("fresh")
        on = SamplingParams(logit_bias={t: -100 for t in rt.engine.model.eos_token_ids})
        first = await respond(rt, "doc", asked, max_tokens=40, sampling=on)
        assert first.usage.completion_tokens == 40  # past the window
    rewritten = [*asked, assistant("Calling tools: [{'name': 'sea'}]"), user("Go on.")]
    async with await AgentRuntime.open(cfg) as rt:  # a restart: nothing in memory
        again = await respond(rt, "doc", rewritten)
        alone = await respond(rt, "fresh", rewritten)
    assert again.cache_source == "disk"  # all of the prompt but its generation prompt
    history = first.usage.prompt_tokens - len(generation_prompt(model))
    assert again.usage.cached_tokens == history
    assert alone.usage.cached_tokens == 0 and again.token_ids == alone.token_ids


async def test_a_reply_is_spliced_at_its_own_place_not_at_an_earlier_equal_message(tmp_path):
    # Agents repeat identical tool calls, and a conversation imported before the agent's first
    # reply holds messages equal to its later replies: each reply goes back to its own place.
    model = "tiny:llama"
    tokenizer = load_tokenizer(tiny_model_dir(model))
    forced = SamplingParams(logit_bias={tokenizer.encode("a", add_special_tokens=False)[0]: 100})
    async with await AgentRuntime.open(config(tmp_path, model)) as rt:
        await rt.create_agent("doc")
        probe = await respond(rt, "doc", [user("Say it")], sampling=forced)
        await rt.create_agent("mid")
        imported = [system("Be brief."), user("Say it"), assistant(probe.text), user("Again")]
        one = await respond(rt, "mid", imported, sampling=forced)
        assert one.text == probe.text  # the reply equals the imported message before it
        conversation = [*imported, assistant(one.text), user("Once more")]
        two = await respond(rt, "mid", conversation, sampling=forced)
    assert two.cache_source == "hot"
    assert two.usage.cached_tokens == one.usage.prompt_tokens + one.usage.completion_tokens
    async with await AgentRuntime.open(config(tmp_path, model)) as rt:  # found again on disk
        conversation += [assistant(two.text), user("And again")]
        three = await respond(rt, "mid", conversation, sampling=forced)
    assert three.cache_source == "disk"
    assert three.usage.cached_tokens == two.usage.prompt_tokens + two.usage.completion_tokens


async def test_a_sibling_conversation_shares_past_the_replies_it_repeats(tmp_path):
    # Two conversations with one history that differ only in their last message (a retry, a
    # delegation): the second agent has no cache, and resumes the first's past the reply
    # they both repeat, spliced in as it was generated (retokenized, its text splits apart).
    model = "tiny:llama"
    tokenizer = load_tokenizer(tiny_model_dir(model))
    forced = SamplingParams(logit_bias={tokenizer.encode("a", add_special_tokens=False)[0]: 100})
    rules = " ".join(f"Rule {i}: answer politely and briefly." for i in range(40))
    head = [system(rules), user("Say it")]  # past a block: other conversations share it
    async with await AgentRuntime.open(config(tmp_path, model)) as rt:
        await rt.create_agent("first")
        one = await respond(rt, "first", head, sampling=forced)
        asked = [*head, assistant(one.text)]
        two = await respond(rt, "first", [*asked, user("Question one?")])
        await rt.create_agent("sibling")
        sibling = await respond(rt, "sibling", [*asked, user("Question two?")])
    assert len(tokens(model, asked[:2])) < one.usage.prompt_tokens + one.usage.completion_tokens
    apart = common_prefix(
        tokens(model, [*asked, user("Question one?")]),
        tokens(model, [*asked, user("Question two?")]),
    )
    tail = len(tokens(model, [*asked, user("Question one?")])) - apart
    assert sibling.cache_source == "prefix"
    assert sibling.usage.cached_tokens == two.usage.prompt_tokens - tail


async def test_a_chat_importing_another_agents_history_shares_past_its_replies(tmp_path):
    # The same through AgentRuntime.chat: a new agent whose imported history repeats another
    # agent's conversation (a stateless client's sibling request) resumes that agent's cache
    # past the replies it repeats.
    model = "tiny:llama"
    tokenizer = load_tokenizer(tiny_model_dir(model))
    forced = SamplingParams(logit_bias={tokenizer.encode("a", add_special_tokens=False)[0]: 100})
    rules = " ".join(f"Rule {i}: answer politely and briefly." for i in range(40))
    async with await AgentRuntime.open(config(tmp_path, model)) as rt:
        await rt.create_agent("first", system_prompt=rules)
        one = await rt.chat("first", "Say it", sampling=forced, max_tokens=8)
        two = await rt.chat("first", "Question one?", max_tokens=8)
        await rt.create_agent("sibling", system_prompt=rules)
        history = [user("Say it"), assistant(one.text)]
        sibling = await rt.chat("sibling", "Question two?", history=history, max_tokens=8)
    asked = [system(rules), *history]
    first, second = (tokens(model, [*asked, user(f"Question {n}?")]) for n in ("one", "two"))
    assert sibling.cache_source == "prefix"
    assert sibling.usage.cached_tokens == two.usage.prompt_tokens - (
        len(first) - common_prefix(first, second)
    )
    assert sibling.usage.cached_tokens > one.usage.prompt_tokens + one.usage.completion_tokens


@pytest.mark.parametrize("hot_cache_bytes", [0, "auto"])
async def test_replies_are_remembered_only_while_the_hot_tier_holds_their_cache(
    tmp_path, hot_cache_bytes
):
    """The replies generated into a cache are kept in memory only while the hot tier holds
    that cache: one resumed from disk finds them again in its tokens, reusing as much."""
    cfg = RuntimeConfig(
        model="tiny:llama", data_dir=tmp_path, kv_bits=None, hot_cache_bytes=hot_cache_bytes
    )
    async with await AgentRuntime.open(cfg) as rt:
        for agent_id in ("a", "b"):
            await rt.create_agent(agent_id)
        asked = {a: [system("Answer briefly."), user(f"Tell me about {a}.")] for a in "ab"}
        first = {a: await respond(rt, a, asked[a]) for a in "ab"}
        held = set(rt._conversations.replies)
        assert held == ({"a", "b"} if hot_cache_bytes else set())
        again = await respond(rt, "a", [*asked["a"], assistant(first["a"].text), user("And then?")])
        assert again.cache_source == ("hot" if hot_cache_bytes else "disk")
        assert again.usage.cached_tokens == (
            first["a"].usage.prompt_tokens + first["a"].usage.completion_tokens
        )


def generation_prompt(model: str) -> list[int]:
    tokenizer = load_tokenizer(tiny_model_dir(model))
    probe = [user("x")]
    opened, closed = (
        tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=g)
        for g in (True, False)
    )
    return tokenizer.encode(opened[len(closed) :], add_special_tokens=False)


def long_reply(model: str) -> SamplingParams:
    """Sampling under which a tiny model writes one token again and again (never its end)."""
    token = load_tokenizer(tiny_model_dir(model)).encode("a", add_special_tokens=False)[0]
    return SamplingParams(logit_bias={token: 100})


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
@pytest.mark.parametrize("restart", [False, True], ids=["hot", "disk"])
async def test_a_dropped_reply_resumes_the_whole_history_before_it(tmp_path, model, restart):
    """A client that drops the agent's reply (mini-swe-agent after a format error) and sends
    a new message resumes everything before the reply, on a sliding-window model (its windows
    moved on during the reply) and a hybrid (its recurrent state did), before and after a
    restart: from the checkpoint where the history ended, before the generation prompt."""
    brief = " ".join(f"Step {i}: read the file, then edit it." for i in range(60))
    asked = [system("You are a coding agent."), user(brief)]
    dropped = [*asked, user("Your reply had the wrong format; answer with one command.")]
    cfg = config(tmp_path, model)
    async with await AgentRuntime.open(cfg) as rt:
        await rt.create_agent("swe")
        one = await respond(rt, "swe", asked, max_tokens=60, sampling=long_reply(model))
        if not restart:
            again = await respond(rt, "swe", dropped)
    if restart:
        async with await AgentRuntime.open(cfg) as rt:
            again = await respond(rt, "swe", dropped)
    assert one.usage.completion_tokens == 60  # well past the tiny models' 32-token windows
    history = len(tokens(model, asked)) - len(generation_prompt(model))
    assert common_prefix(tokens(model, asked), tokens(model, dropped)) >= history
    assert again.cache_source == ("disk" if restart else "hot")
    assert again.usage.cached_tokens == history
    assert again.usage.cached_tokens / again.usage.prompt_tokens > 0.95


@pytest.mark.parametrize("model", ["tiny:gemma3", "tiny:hybrid"])
async def test_an_identical_resend_resumes_all_but_the_generation_prompt(tmp_path, model):
    """A stateless client resending the same conversation (a retry) replaces the last reply:
    on a sliding-window model and a hybrid the history before the generation prompt is
    resumed, in one process and after a restart."""
    asked = [user(" ".join(f"Fact {i}: the sky is blue." for i in range(40)))]
    cfg = config(tmp_path, model)
    async with await AgentRuntime.open(cfg) as rt:
        await rt.create_agent("retry")
        await respond(rt, "retry", asked, max_tokens=40, sampling=long_reply(model))
        replies = [await respond(rt, "retry", asked) for _ in range(2)]
    async with await AgentRuntime.open(cfg) as rt:
        replies.append(await respond(rt, "retry", asked))
    history = len(tokens(model, asked)) - len(generation_prompt(model))
    assert [r.cache_source for r in replies] == ["hot", "hot", "disk"]
    assert [r.usage.cached_tokens for r in replies] == [history] * 3
    assert history / len(tokens(model, asked)) > 0.95
