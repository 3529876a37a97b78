"""Images in a vision-language model's turns: the tokens an image stands for reach the model as
its features (the same tokens as mlx-vlm's own model), a follow-up and a restart resume the
image's KV instead of running the vision tower again, the same image shown by another
conversation is the same tokens, and a bad image or a model that takes none is refused by name.
Real SQLite files, a real tiny VLM built from mlx-vlm's gemma3 classes."""

from __future__ import annotations

import io
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from PIL import Image

from agentkv import AgentRuntime, RuntimeConfig
from agentkv.engine.config import EngineConfig
from agentkv.engine.engine import Engine
from agentkv.engine.errors import UnsupportedModelError
from agentkv.engine.models.mrope import Scanned, chunk_positions, scan
from agentkv.engine.models.vision import IMAGE_BASE, image_blocks, image_rows, image_token
from agentkv.engine.request import GenerationRequest
from agentkv.errors import EmptyMessageError, InvalidImageError, InvalidMessageError
from agentkv.models import blas
from agentkv.models.tiny import tiny_model_dir

MODEL = "tiny:gemma3-vl"
MODELS = [
    "tiny:gemma3-vl",
    "tiny:gemma4-vl",
    "tiny:gemma4-unified-vl",
    "tiny:qwen3_5-vl",
    "tiny:qwen2_5-vl",
    "tiny:qwen2-vl",
    "tiny:qwen3-vl",
    "tiny:qwen3-moe-vl",
    "tiny:mistral3-vl",
    "tiny:pixtral-vl",
    "tiny:lfm2-vl",
    "tiny:llava-vl",
]
RED, BLUE = (200, 10, 30), (10, 20, 220)


def encoded(color: tuple[int, int, int], kind: str = "PNG", size=(100, 80)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=kind)
    return buf.getvalue()


def config(data_dir: Path, model: str = MODEL, **kw) -> RuntimeConfig:
    return RuntimeConfig(model=model, data_dir=data_dir, **kw)


def reference(model_name: str, prompt: list[int], data: bytes, n: int) -> list[int]:
    """Greedy tokens of mlx-vlm's own model (vision tower, merge, its positions, deepstack,
    language model), ``n`` of them whatever it samples."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model
    from transformers import AutoImageProcessor

    path = tiny_model_dir(model_name)
    model = load_model(path)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    config = model.config
    kwargs = {}  # (transformers' PixtralProcessor asks for patches of merged patches)
    if config.model_type in ("mistral3", "pixtral"):
        side = config.vision_config.patch_size * getattr(config, "spatial_merge_size", 1)
        kwargs = {"patch_size": {"height": side, "width": side}}
    if config.model_type == "lfm2-vl":  # (mlx-vlm's own processor, its tiling)
        from mlx_vlm.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

        processor = Lfm2VlProcessor.from_pretrained(str(path)).image_processor
    elif config.model_type == "gemma4_unified":  # (mlx-vlm's own processor)
        from mlx_vlm.models.gemma4_unified import Gemma4UnifiedProcessor

        processor = Gemma4UnifiedProcessor.from_pretrained(str(path)).image_processor
    else:
        processor = AutoImageProcessor.from_pretrained(str(path))
    processed = processor(images=[image], return_tensors="np", **kwargs)
    if isinstance(processed, tuple):  # (mlx-vlm's Gemma 4 processors: data, token counts)
        processed = processed[0]
    inputs = ("spatial_shapes", "pixel_attention_mask")  # (LFM2-VL's patch shapes and mask)
    extra = {k: mx.array(v) for k, v in processed.items() if k.startswith("image_") or k in inputs}
    placeholder = getattr(model.config, "image_token_index", None) or model.config.image_token_id
    x = mx.array([[placeholder if t >= IMAGE_BASE else t for t in prompt]])
    pixels = mx.array(processed["pixel_values"])
    got = model.get_input_embeddings(x, pixels, mask=mx.ones_like(x), **extra)
    positions = {}
    if getattr(got, "position_ids", None) is not None:  # multimodal rotary positions
        positions = {"position_ids": got.position_ids, "rope_deltas": got.rope_deltas}
    if "num_soft_tokens_per_image" in processed:  # (Gemma 4's processor counts them)
        assert int(processed["num_soft_tokens_per_image"][0]) == sum(
            t >= IMAGE_BASE for t in prompt
        )
    if getattr(got, "per_layer_inputs", None) is not None:  # Gemma 4's, image rows read as pad
        positions |= {"per_layer_inputs": got.per_layer_inputs}
    if config.model_type.startswith("gemma4"):  # its image tokens attend both ways
        positions |= {"mm_token_type_ids": (x == config.image_token_id).astype(mx.int32)}
    if getattr(got, "deepstack_visual_embeds", None) is not None:  # Qwen3-VL's early layers
        positions |= {"deepstack_visual_embeds": got.deepstack_visual_embeds}
        positions |= {"visual_pos_masks": got.visual_pos_masks}
    language = model.language_model
    cache = (
        language.make_cache() if hasattr(language, "make_cache") else make_prompt_cache(language)
    )
    logits = model.language_model(x, inputs_embeds=got.inputs_embeds, cache=cache, **positions)
    logits, out = logits.logits, []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model.language_model(mx.array([[out[-1]]]), cache=cache).logits
    return out


@pytest.mark.parametrize("model_name", MODELS)
async def test_an_image_reaches_the_model_as_mlx_vlm_feeds_it(model_name):
    # 16 prompt tokens a step: an image's tokens are fed across steps (and chunks).
    engine = await Engine.open(model_name, EngineConfig(prefill_step_size=16))
    try:
        rule, size = engine.model.vision.rule, (100, 80)
        shown = [
            {"type": "text", "text": "Look."},
            {"type": "image"},
            {"type": "text", "text": "What?"},
        ]
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": shown}], add_generation_prompt=True, tokenize=False
        )
        text = text.replace(rule.marker, rule.expansion(size))
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        got = {}
        for number, color in ((1, RED), (2, BLUE)):
            token = image_token(number)
            prompt = [token if t == rule.placeholder else t for t in ids]
            # Beside a text-only row.
            other = engine.submit(GenerationRequest(ids[:9], max_tokens=4))
            request = GenerationRequest(
                prompt,
                max_tokens=10,
                images={token: encoded(color)},
                image_sizes={token: size},
            )
            result = await engine.generate(request)
            await other.result()
            got[color] = result.token_ids
            expected = reference(model_name, prompt, encoded(color), 10)
            assert got[color] == expected[: len(got[color])]
            assert len(got[color]) == 10 or got[color][-1] in engine.model.eos_token_ids
        assert got[RED] != got[BLUE]
    finally:
        await engine.close()


async def test_an_image_the_model_cannot_read_fails_its_turn_not_the_batch():
    engine = await Engine.open(MODEL)
    try:
        rule = engine.model.vision.rule
        token = image_token(7)
        prompt = [1, 2, *[token] * rule.tokens((64, 64)), 3]
        other = engine.submit(GenerationRequest([1, 2, 3, 4], max_tokens=6))
        bad = GenerationRequest(prompt, max_tokens=4, images={token: b"not an image"})
        failed = await engine.generate(bad)
        assert failed.finish_reason == "error" and failed.error is not None
        assert len((await other.result()).token_ids) == 6  # the other turn ran on
        assert engine.model.vision.encoded == 0
    finally:
        await engine.close()


async def test_turns_step_on_while_an_image_is_encoded_off_the_generation_thread(monkeypatch):
    engine = await Engine.open(MODEL, EngineConfig(prefill_step_size=16))
    vision, gate, seen = engine.model.vision, threading.Event(), []
    encode = vision._encode

    def held(token, data):  # the vision tower, taking as long as the test holds it
        seen.append((threading.current_thread(), blas.threads()))
        assert gate.wait(60)
        return encode(token, data)

    monkeypatch.setattr(vision, "_encode", held)
    pool = blas.threads()
    try:
        red, blue, size = image_token(3), image_token(4), (64, 64)
        text, n = list(range(5, 45)), vision.rule.tokens(size)
        request = GenerationRequest(
            [*text, *[red] * n, 3, *[blue] * n, 4],
            max_tokens=6,
            images={red: encoded(RED, size=size), blue: encoded(BLUE, size=size)},
            image_sizes={red: size, blue: size},
        )
        other = engine.submit(GenerationRequest([1, 2, 3, 4], max_tokens=32, ignore_eos=True))
        await anext(other)  # decoding when the images come
        shown, again = engine.submit(request), engine.submit(request)
        assert len((await other.result()).token_ids) == 32  # it stepped on meanwhile
        assert vision.encoded == 0 and shown._seq.tokens == text  # text fed, up to the image
        gate.set()
        first, second = await shown.result(), await again.result()
        assert vision.encoded == 2  # each image once, for the two turns that show it
        assert [t.name for t, _ in seen] == ["vision", "vision"]
        # Begun beside a decoding turn, the tower's BLAS calls ran beside the batch's; the
        # second began with none decoding.
        assert [threads for _, threads in seen] == [pool and 1, pool] and blas.threads() == pool
        assert first.token_ids == second.token_ids and len(first.token_ids) == 6
        kept = await engine.generate(request)  # its features kept: fed whole at once
        assert kept.token_ids == first.token_ids and vision.encoded == 2
    finally:
        gate.set()
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
    # Pixtral's rows of one image, a break (9) between them: one count across rows and chunks.
    assert image_rows([1, a, a, 9], [a, a, 9, a, 8, a], 0, frozenset({9})) == [
        (0, a, 2),
        (1, a, 3),
        (3, a, 4),
        (5, a, 0),
    ]


def test_lfm2_vl_writes_an_image_as_mlx_vlm_processor_does():
    from mlx_vlm.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    from agentkv.engine.models.loading import load_model

    model = load_model("tiny:lfm2-vl")
    rule, tokenizer = model.vision.rule, model.tokenizer
    processor = Lfm2VlProcessor.from_pretrained(str(model.path))
    # Within the budget (one view), tiled in a grid beside its thumbnail, long and thin.
    for size in [(40, 30), (64, 64), (20, 200), (100, 80), (300, 40), (1000, 10), (517, 333)]:
        image = Image.new("RGB", size, RED)
        got = processor(images=[image], text=["Look.<image>What?"], return_tensors="np")
        mine = tokenizer.encode(f"Look.{rule.expansion(size)}What?", add_special_tokens=False)
        assert list(got["input_ids"][0]) == mine, size
        assert sum(t == rule.placeholder for t in mine) == rule.tokens(size)
    assert rule.layout((100, 80))[:2] == (3, 3) and rule.layout((40, 30))[:2] == (1, 1)


async def test_an_lfm2_vl_checkpoint_of_either_spelling_reads_images(tmp_path):
    # transformers spells the family lfm2_vl, mlx-lm's module lfm2-vl: both load alike.
    spelled = tmp_path / "lfm2_vl"
    shutil.copytree(tiny_model_dir("tiny:lfm2-vl"), spelled)
    written = (spelled / "config.json").read_text().replace('"lfm2-vl"', '"lfm2_vl"')
    (spelled / "config.json").write_text(written)
    replies = []
    for model in ("tiny:lfm2-vl", str(spelled)):
        async with await AgentRuntime.open(config(tmp_path / model[-7:], model)) as rt:
            agent = await rt.create_agent()
            replies.append(await rt.chat(agent.id, "What?", images=[encoded(RED)], max_tokens=6))
            assert rt.engine.model.vision.encoded == 1
    assert replies[0].token_ids == replies[1].token_ids


def test_a_gemma4_unified_checkpoint_leaving_out_settings_takes_mlx_vlms(tmp_path):
    import json

    from mlx_vlm.models.gemma4_unified import Gemma4UnifiedProcessor
    from transformers import AutoTokenizer

    from agentkv.engine.models.image_configs import image_rule

    path = tmp_path / "unified"
    shutil.copytree(tiny_model_dir("tiny:gemma4-unified-vl"), path)
    config = json.loads((path / "config.json").read_text())
    for key in ("boi_token_id", "eoi_token_id", "image_token_id"):
        del config[key]
    settings = json.loads((path / "processor_config.json").read_text())
    settings["image_processor"]["num_soft_tokens"] = settings["image_processor"].pop(
        "max_soft_tokens"
    )
    (path / "processor_config.json").write_text(json.dumps(settings))
    rule = image_rule(config, AutoTokenizer.from_pretrained(path), path)
    processor = Gemma4UnifiedProcessor.from_pretrained(str(path)).image_processor
    assert rule.placeholder == 258880 and rule.budget == processor.max_soft_tokens == 70


def test_a_chunk_never_ends_inside_an_image_that_attends_both_ways():
    from agentkv.engine.sequence import Sequence

    a, b = image_token(3), image_token(4)
    assert image_blocks([1, a, a, 2, b, b, a]) == (-1, 0, 0, -1, 1, 1, 2)
    seq = Sequence(*[None] * 8, prompt=[1, a, a, a, 2, b, b, 3])
    assert [seq.chunk_within(n, False) for n in (1, 2, 3, 4, 6, 8)] == [1, 2, 3, 4, 6, 8]
    seq.whole_images = True  # (Gemma 4's)
    assert [seq.chunk_within(n, False) for n in (1, 2, 3, 4, 6, 8)] == [1, 4, 4, 4, 7, 8]


@pytest.mark.parametrize("model_name", MODELS)
async def test_an_image_turn_resumes_in_process_and_after_a_restart(tmp_path, model_name):
    data = tmp_path / "data"
    async with await AgentRuntime.open(config(data, model_name)) as rt:
        vision = rt.engine.model.vision
        agent = await rt.create_agent(system_prompt="Describe images briefly.")
        first = await rt.chat(agent.id, "What is this?", images=[encoded(RED)], max_tokens=6)
        assert first.usage.cached_tokens == 0
        follow = await rt.chat(agent.id, "And its colour?", max_tokens=6)
        assert follow.cache_source == "hot"
        held = first.usage.prompt_tokens + len(first.token_ids)
        assert follow.usage.cached_tokens == held
        # Shown again later in the conversation: the same image, other positions.
        again = await rt.chat(agent.id, "Once more.", images=[encoded(RED)], max_tokens=6)
        assert again.usage.prompt_tokens - again.usage.cached_tokens > vision.rule.tokens((100, 80))
        assert vision.encoded == 1  # its features were kept
        stored = await rt.transcript(agent.id)
    async with await AgentRuntime.open(config(data, model_name)) as rt:
        assert await rt.transcript(agent.id) == stored
        resumed = await rt.chat(agent.id, "Thanks.", max_tokens=6)
        assert resumed.cache_source == "disk"
        assert resumed.usage.cached_tokens == again.usage.prompt_tokens + len(again.token_ids)
        assert rt.engine.model.vision.encoded == 0  # the images' KV came from disk
    shutil.rmtree(config(data).caches_path)
    async with await AgentRuntime.open(config(data, model_name)) as rt:
        # No cache left: the transcript re-renders with its stored images.
        rebuilt = await rt.chat(agent.id, "Bye.", max_tokens=6)
        assert rebuilt.cache_source == "rebuilt"
        assert rebuilt.usage.prompt_tokens > resumed.usage.prompt_tokens
        assert rt.engine.model.vision.encoded == 1
    async with await AgentRuntime.open(config(tmp_path / "alone", model_name)) as rt:
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


async def test_appended_messages_show_images_as_a_turn_does(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        shown = await rt.create_agent()
        await rt.chat(shown.id, "What is this?", images=[encoded(RED)], max_tokens=2)
        replies = {}
        for color in (RED, BLUE):  # the same exchange imported, with each image
            imported = await rt.create_agent()
            picture = {"type": "image", "data": encoded(color)}
            await rt.append_messages(
                imported.id,
                [
                    {"role": "user", "content": [picture, {"type": "text", "text": "What?"}]},
                    {"role": "assistant", "content": "Fine."},
                ],
            )
            stored = await rt.transcript(imported.id)
            assert stored[0].content == "What?" and stored[1].content == "Fine."
            replies[color] = await rt.chat(imported.id, "And?", max_tokens=6)
            held = replies[color].usage.prompt_tokens
            assert held > rt.engine.model.vision.rule.tokens((100, 80))
        # The image is stored as chat stores it (the same number, by content); the model read
        # it (encoded once: the first turn's features were kept) and each gives other tokens.
        red = (await rt.transcript(shown.id))[0].parts[0]
        assert [p for p in stored[0].parts if p["type"] == "image"] != [red]
        assert rt.engine.model.vision.encoded == 2
        assert replies[RED].token_ids != replies[BLUE].token_ids
        first = await rt.create_agent()
        await rt.append_messages(
            first.id, [{"role": "user", "content": [{"type": "image", "data": encoded(RED)}]}]
        )
        assert (await rt.transcript(first.id))[0].parts == (red,)
        # Bad parts are named and store nothing.
        before = await rt.transcript(imported.id)
        for content, says in [
            ([{"type": "image", "data": "not bytes"}], r"messages\[0\]\.content\[0\]"),
            ([{"type": "image", "data": b"not an image"}], r"messages\[0\]\.content\[0\]"),
            ([{"type": "audio"}], r"messages\[0\]\.content\[0\]: a part is a text or an image"),
        ]:
            with pytest.raises((InvalidMessageError, InvalidImageError), match=says):
                await rt.append_messages(imported.id, [{"role": "user", "content": content}])
        with pytest.raises(InvalidMessageError, match=r"messages\[0\]: only a user message"):
            await rt.append_messages(imported.id, [{"role": "assistant", "content": [picture]}])
        assert await rt.transcript(imported.id) == before
    async with await AgentRuntime.open(config(tmp_path / "text", "tiny:gemma3")) as rt:
        agent = await rt.create_agent()
        with pytest.raises(UnsupportedModelError, match="images"):
            await rt.append_messages(agent.id, [{"role": "user", "content": [picture]}])
        assert await rt.transcript(agent.id) == []


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
    async with await AgentRuntime.open(config(tmp_path / "qwen", "tiny:qwen3_5-vl")) as rt:
        agent = await rt.create_agent()
        with pytest.raises(InvalidImageError, match="an image of 2000x8 pixels"):
            await rt.chat(agent.id, "Look.", images=[encoded(RED, size=(2000, 8))])
        assert await rt.transcript(agent.id) == []
    async with await AgentRuntime.open(config(tmp_path / "text", "tiny:gemma3")) as rt:
        agent = await rt.create_agent()
        with pytest.raises(UnsupportedModelError, match="not a vision-language model"):
            await rt.chat(agent.id, "Look.", images=[encoded(RED)])


def test_multimodal_positions_are_qwens_and_the_same_fed_in_any_chunks():
    a, b = image_token(1), image_token(2)
    grids = {a: (2, 3), b: (1, 2)}  # (rows, columns) of tokens
    tokens = [10, 11, *[a] * 6, 12, 13, *[b] * 2, 14]
    positions, images, end = chunk_positions([], tokens, grids.__getitem__, Scanned())
    # Text counts on from where an image starts plus its longer side (Qwen's get_rope_index).
    assert positions == [0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7, 7, 9]
    assert images == [
        (2, 2, 2, 2), (3, 2, 2, 3), (4, 2, 2, 4), (5, 2, 3, 2), (6, 2, 3, 3), (7, 2, 3, 4),
        (10, 7, 7, 7), (11, 7, 7, 8),
    ]  # fmt: skip
    assert end == Scanned(13, -3) == scan(tokens, grids.__getitem__, Scanned())
    fed, history, since = [], [], Scanned()
    for cut in ((0, 4), (4, 9), (9, 11), (11, 13)):  # mid-image, across an image's end
        piece = tokens[slice(*cut)]
        got, _, since = chunk_positions(history, piece, grids.__getitem__, since)
        fed, history = fed + got, history + piece
    assert fed == positions and since == end


async def test_resent_conversations_name_their_parts(tmp_path):
    async with await AgentRuntime.open(config(tmp_path)) as rt:
        agent = await rt.create_agent()
        for content, says in (
            ([{"type": "text", "text": "\ud800"}], r"messages\[0\].content\[0\].text"),
            ([{"type": "audio"}], r"messages\[0\].content\[0\]: a part is a text or an image"),
            ([{"type": "image", "data": "aGk="}], r"content\[0\].data: an image must be bytes"),
        ):
            with pytest.raises(InvalidMessageError, match=says):
                async for _ in rt.respond(agent.id, [{"role": "user", "content": content}]):
                    pass
        shown = [{"type": "image", "data": encoded(BLUE)}, {"type": "text", "text": "Which?"}]
        async for _ in rt.respond(agent.id, [{"role": "user", "content": shown}], max_tokens=3):
            pass
        (stored, _) = await rt.transcript(agent.id)
        assert stored.content == "Which?" and stored.parts[0]["type"] == "image"


@pytest.mark.parametrize(
    "model_name",
    [
        "tiny:gemma3-vl",
        "tiny:gemma4-vl",
        "tiny:qwen3_5-vl",
        "tiny:qwen3-vl",
        "tiny:mistral3-vl",
        "tiny:lfm2-vl",
        "tiny:llava-vl",
    ],
)
async def test_an_image_turn_in_a_batch_that_holds_its_kv_at_8_bits(tmp_path, model_name):
    settings = config(tmp_path, model_name, batch_kv_bits=8)
    async with await AgentRuntime.open(settings) as rt:
        agent = await rt.create_agent()
        first = await rt.chat(agent.id, "What?", images=[encoded(RED)], max_tokens=5)
        follow = await rt.chat(agent.id, "More.", max_tokens=5)
        assert follow.cache_source == "hot"
        assert follow.usage.cached_tokens == first.usage.prompt_tokens + len(first.token_ids)
    async with await AgentRuntime.open(settings) as rt:
        again = await rt.chat(agent.id, "Again.", max_tokens=5)
        assert again.cache_source == "disk"
        assert again.usage.cached_tokens == follow.usage.prompt_tokens + len(follow.token_ids)
