"""Cuts of running requests (``RequestHandle.cut``): the cache of a request's first tokens,
asked while it runs, continues as the same tokens prefilled whole would, on full attention,
sliding windows (from the snapshot there) and recurrent state; a cut asked of a request that
ends first, or where no snapshot was kept, is None."""

from __future__ import annotations

import asyncio

import pytest

from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.request import GenerationRequest

PROMPT = [(7 * i + 3) % 400 + 16 for i in range(300)]
TASK = [30, 31, 32, 33, 34]


@pytest.mark.parametrize("spec", ["tiny:llama", "tiny:gemma3", "tiny:hybrid"])
async def test_a_cut_of_a_running_prefill_continues_as_a_whole_prefill(spec):
    config = EngineConfig(speculative="off", prefill_step_size=64)
    eng = await Engine.open(spec, config)
    try:
        first = GenerationRequest(PROMPT, max_tokens=24, ignore_eos=True, snapshots_at=(128, 256))
        async with eng.submit(first) as handle:
            cut, later = await asyncio.gather(handle.cut(256), handle.cut(200))
            whole = await handle.result()
        assert cut.tokens == PROMPT[:256] and cut.num_tokens == 256
        if spec == "tiny:llama":  # any token of full attention
            assert later.tokens == PROMPT[:200]
        else:  # the snapshot before it
            assert later.tokens == PROMPT[:128]
        rest = [*PROMPT[256:280], *TASK]
        resumed = await eng.generate(
            GenerationRequest(rest, max_tokens=12, ignore_eos=True, cache=cut)
        )
        alone = await eng.generate(
            GenerationRequest([*PROMPT[:280], *TASK], max_tokens=12, ignore_eos=True)
        )
        assert resumed.token_ids == alone.token_ids
        assert len(whole.token_ids) == 24
        assert await handle.cut(10) is None  # it has ended
    finally:
        await eng.close()


async def test_a_cut_of_a_request_that_ends_first_is_none():
    eng = await Engine.open("tiny:gemma3", EngineConfig(speculative="off"))
    try:
        request = GenerationRequest(PROMPT[:40], max_tokens=4, ignore_eos=True)
        async with eng.submit(request) as handle:
            beyond = asyncio.ensure_future(handle.cut(100))  # it never holds 100 tokens
            await handle.result()
            assert await beyond is None
    finally:
        await eng.close()


async def test_a_cut_asked_of_a_closed_engine_is_none():
    eng = await Engine.open("tiny:llama", EngineConfig(speculative="off"))
    handle = eng.submit(GenerationRequest(PROMPT, max_tokens=400, ignore_eos=True))
    await eng.close(drain=False)
    assert await asyncio.wait_for(handle.cut(10), timeout=10) is None
