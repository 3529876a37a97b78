"""Which image rule (``agentkv.engine.models.image_rules``) a vision-language checkpoint
follows, with the settings its configs give it (``config.json``, the image processor's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentkv.engine.models.image_rules import (
    LFM2_TILE_MARKERS,
    Gemma4Images,
    GemmaImages,
    ImageRule,
    Lfm2Images,
    LlavaImages,
    PixtralImages,
    QwenImages,
)


def image_rule(config: dict[str, Any], tokenizer: Any, path: Path) -> ImageRule | None:
    """The image rule of the model at ``path`` (None: a family agentkv feeds no images)."""
    family = config.get("model_type")
    text = config.get("text_config", {})
    if family == "gemma3":
        boi, eoi, image = (
            tokenizer.convert_ids_to_tokens(config[key])
            for key in ("boi_token_index", "eoi_token_index", "image_token_index")
        )
        count = config.get("mm_tokens_per_image", text.get("mm_tokens_per_image", 256))
        return GemmaImages(boi, config["image_token_index"], image, eoi, count)
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe", "qwen2_vl", "qwen2_5_vl"):
        processor = _processor_config(path)
        size = processor.get("size") or {}
        text = text or config  # (Qwen2-VL's keep the language model's fields at the top)
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        if family.startswith("qwen2"):  # all of each head rotated, sections in order
            rope = text.get("rope_scaling") or {}
            rope = rope | {"rope_theta": text.get("rope_theta", 1_000_000.0)}
            rope |= {"partial_rotary_factor": 1.0, "style": "chunked"}
        elif family.startswith("qwen3_vl"):  # all of each head rotated, interleaved
            rope = text.get("rope_scaling") or {}
            rope |= {"rope_theta": text.get("rope_theta", 5_000_000.0)}
            rope |= {"partial_rotary_factor": 1.0}
        else:
            rope = text.get("rope_parameters") or {}
        placeholder = config.get("image_token_id", config.get("image_token_index"))
        return QwenImages(
            tokenizer.convert_ids_to_tokens(placeholder),
            placeholder,
            patch=processor.get("patch_size", 16),
            merge=processor.get("merge_size", 2),
            min_pixels=size.get("shortest_edge", processor.get("min_pixels", 56 * 56)),
            max_pixels=size.get("longest_edge", processor.get("max_pixels", 28 * 28 * 1280)),
            mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
            theta=float(rope.get("rope_theta", 100_000.0)),
            rotary_dims=int(head_dim * rope.get("partial_rotary_factor", 0.25)),
            style=rope.get("style", "interleaved"),
        )
    if family in ("gemma4", "gemma4_unified"):  # (unified: each token one projected patch)
        processor = _processor_config(path)
        if family == "gemma4_unified":  # (mlx-vlm's defaults for what its files leave out)
            from mlx_vlm.models.gemma4_unified import ModelConfig

            ids = ("boi_token_id", "eoi_token_id", "image_token_id")
            config = {key: getattr(ModelConfig, key) for key in ids} | config
            if "num_soft_tokens" in processor:
                processor = {"max_soft_tokens": processor["num_soft_tokens"]} | processor
        boi, eoi, image = (
            tokenizer.convert_ids_to_tokens(config[key])
            for key in ("boi_token_id", "eoi_token_id", "image_token_id")
        )
        return Gemma4Images(
            image,
            config["image_token_id"],
            boi,
            eoi,
            patch=processor.get("patch_size", 16),
            pooling=processor.get("pooling_kernel_size", 3),
            budget=processor.get("max_soft_tokens", 280),
            scale=text["hidden_size"] ** 0.5,
            unified=json.dumps(processor, sort_keys=True) if family == "gemma4_unified" else "",
        )
    if family in ("mistral3", "pixtral"):
        processor = _processor_config(path)
        size = processor.get("size") or {}
        placeholder = config.get("image_token_index", config.get("image_token_id"))
        return PixtralImages(
            tokenizer.convert_ids_to_tokens(placeholder),
            placeholder,
            break_id=tokenizer.convert_tokens_to_ids("[IMG_BREAK]"),
            patch=config["vision_config"].get("patch_size", 14),
            merge=config.get("spatial_merge_size", 2 if family == "mistral3" else 1),
            longest_edge=size.get("longest_edge", size.get("height", 1540)),
        )
    if family == "llava":
        vision = config["vision_config"]
        count = (vision.get("image_size", 336) // vision.get("patch_size", 14)) ** 2
        count += vision.get("model_type", "clip_vision_model") == "clip_vision_model"
        count -= config.get("vision_feature_select_strategy", "default") == "default"
        image = config.get("image_token_index", config.get("image_token_id", 32000))
        return LlavaImages(tokenizer.convert_ids_to_tokens(image), image, count=count)
    if family == "lfm2-vl":
        settings = _processor_config(path) | _processor_config(path, "processor_config.json")
        settings = {k: v for k, v in settings.items() if k not in _LFM2_TILING}
        image = config.get("image_token_id", config.get("image_token_index"))
        ids = tokenizer.convert_tokens_to_ids([*LFM2_TILE_MARKERS, "<|img_thumbnail|>"])
        return Lfm2Images(
            tokenizer.convert_ids_to_tokens(image),
            image,
            markers=frozenset(i for i in ids if i is not None and i != tokenizer.unk_token_id),
            settings=json.dumps(settings, sort_keys=True),
        )
    return None


_LFM2_TILING = ("do_image_splitting", "min_tiles", "max_tiles", "use_thumbnail")
"""What mlx-vlm's LFM2-VL processor ignores in a checkpoint (its official tiling applies)."""


def _processor_config(path: Path, *names: str) -> dict[str, Any]:
    """The image processor's settings in the first of ``names`` the model has (by default
    ``preprocessor_config.json``, else ``processor_config.json``)."""
    for name in names or ("preprocessor_config.json", "processor_config.json"):
        if (path / name).is_file():
            data = json.loads((path / name).read_text())
            return dict(data.get("image_processor", data))
    return {}
