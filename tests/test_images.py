"""Images in a vision-language model's turns: the tokens an image stands for reach the model as
its features (the same tokens as mlx-vlm's own model), a follow-up and a restart resume the
image's KV instead of running the vision tower again, the same image shown by another
conversation is the same tokens, and a bad image or a model that takes none is refused by name.
Real SQLite files, a real tiny VLM built from mlx-vlm's gemma3 classes."""

from __future__ import annotations

import io
from pathlib import Path

import mlx.core as mx
import pytest
from PIL import Image

from agentkv import AgentRuntime, RuntimeConfig
from agentkv.engine.engine import Engine
from agentkv.engine.errors import UnsupportedModelError
from agentkv.engine.models.vision import IMAGE_BASE, image_rows, image_token
from agentkv.engine.request import GenerationRequest
from agentkv.errors import EmptyMessageError, InvalidImageError
from agentkv.models.tiny import tiny_model_dir

MODEL = "tiny:gemma3-vl"
RED, BLUE = (200, 10, 30), (10, 20, 220)


def encoded(color: tuple[int, int, int], kind: str = "PNG", size=(100, 80)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=kind)
    return buf.getvalue()


def config(data_dir: Path, model: str = MODEL, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=model, data_dir=data_dir, **kw)


def reference(prompt: list[int], data: bytes, n: int) -> list[int]:
    """Greedy tokens of mlx-vlm's own gemma3 model (vision tower, merge, language model)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model
    from transformers import AutoImageProcessor

    path = tiny_model_dir(MODEL)
    model = load_model(path)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    pixels = AutoImageProcessor.from_pretrained(str(path))(images=[image], return_tensors="np")
    placeholder = model.config.image_token_index
    x = mx.array([[placeholder if t >= IMAGE_BASE else t for t in prompt]])
    embeds = model.get_input_embeddings(
        x, mx.array(pixels["pixel_values"]), mask=mx.ones_like(x)
    ).inputs_embeds
    cache = make_prompt_cache(model.language_model)
    logits = model.language_model(x, inputs_embeds=embeds, cache=cache).logits
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model.language_model(mx.array([[out[-1]]]), cache=cache).logits
    return out


async def test_an_image_reaches_the_model_as_mlx_vlm_feeds_it():
    engine = await Engine.open(MODEL)
    try:
        rule = engine.model.vision.rule
        shown = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": shown}], add_generation_prompt=True, tokenize=False
        )
        text = text.replace(rule.marker, rule.expansion)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        got = {}
        for number, color in ((1, RED), (2, BLUE)):
            token = image_token(number)
            prompt = [token if t == rule.placeholder else t for t in ids]
            # Beside a text-only row, the image split across two prefill chunks.
            other = engine.submit(GenerationRequest(ids[:9], max_tokens=4))
            request = GenerationRequest(prompt, max_tokens=10, images={token: encoded(color)})
            result = await engine.generate(request)
            await other.result()
            got[color] = result.token_ids
            assert got[color] == reference(prompt, encoded(color), 10)
        assert got[RED] != got[BLUE]
    finally:
        await engine.close()


def test_image_rows_count_within_each_image_across_chunks():
    a, b = image_token(3), image_token(4)
    history = [1, 2, a, a]
    assert image_rows(history, [a, a, 5, b, b], 10) == [
        (10, a, 2),
        (11, a, 3),
        (13, b, 0),
        (14, b, 1),
    ]
    assert image_rows([1], [2, 3], 0) == []


async def test_an_image_turn_resumes_in_process_and_after_a_restart(tmp_path):
    data = tmp_path / "data"
    async with await AgentRuntime.open(config(data)) as rt:
        agent = await rt.create_agent(system_prompt="Describe images briefly.")
        first = await rt.chat(agent.id, "What is this?", images=[encoded(RED)], max_tokens=6)
        assert first.usage.cached_tokens == 0
        follow = await rt.chat(agent.id, "And its colour?", max_tokens=6)
        assert follow.cache_source == "hot"
        held = first.usage.prompt_tokens + len(first.token_ids)
        assert follow.usage.cached_tokens == held
        # Shown again later in the conversation: the same image, other positions.
        again = await rt.chat(agent.id, "Once more.", images=[encoded(RED)], max_tokens=6)
        assert again.usage.prompt_tokens - again.usage.cached_tokens > 16
        assert rt._engine.model.vision.encoded == 1  # its features were kept
        stored = await rt.transcript(agent.id)
    async with await AgentRuntime.open(config(data)) as rt:
        assert await rt.transcript(agent.id) == stored
        resumed = await rt.chat(agent.id, "Thanks.", max_tokens=6)
        assert resumed.cache_source == "disk"
        assert resumed.usage.cached_tokens == again.usage.prompt_tokens + len(again.token_ids)
        assert rt._engine.model.vision.encoded == 0  # the images' KV came from disk
    # Rebuilt from the transcript (no cache): the stored images render the same tokens.
    async with await AgentRuntime.open(config(tmp_path / "alone")) as rt:
        alone = await rt.create_agent(system_prompt="Describe images briefly.")
        replay = await rt.chat(alone.id, "What is this?", images=[encoded(RED)], max_tokens=6)
        assert replay.token_ids == first.token_ids
        other = await rt.chat(
            (await rt.create_agent(system_prompt="Describe images briefly.")).id,
            "What is this?",
            images=[encoded(BLUE)],
            max_tokens=6,
        )
        assert other.token_ids != first.token_ids  # another image, other tokens


async def test_bad_images_and_text_models_are_refused_by_name(tmp_path):
    async with await AgentRuntime.open(config(tmp_path / "vl")) as rt:
        agent = await rt.create_agent()
        with pytest.raises(InvalidImageError, match=r"images\[1\]: not a readable image"):
            await rt.chat(agent.id, "Look.", images=[encoded(RED), b"not an image"])
        with pytest.raises(InvalidImageError, match=r"images\[0\]: a BMP image"):
            await rt.chat(agent.id, "Look.", images=[encoded(RED, "BMP")])
        with pytest.raises(EmptyMessageError):
            await rt.chat(agent.id, " ")
        assert await rt.transcript(agent.id) == []  # nothing of a refused turn is stored
        # An image alone is a message; a GIF's first frame is read.
        reply = await rt.chat(agent.id, "", images=[encoded(BLUE, "GIF")], max_tokens=3)
        assert reply.usage.prompt_tokens > 16
    async with await AgentRuntime.open(config(tmp_path / "text", "tiny:gemma3")) as rt:
        agent = await rt.create_agent()
        with pytest.raises(UnsupportedModelError, match="not a vision-language model"):
            await rt.chat(agent.id, "Look.", images=[encoded(RED)])
