"""How each vision-language family writes an image into its prompt: peers of one small protocol,
one class a family (``agentkv.engine.models.vision`` uses them).

A chat template writes ``marker`` for each image part; :meth:`ImageRule.expansion` is the text
the family's processor puts there instead, holding :meth:`ImageRule.tokens` placeholders (the
model's image token) for an image of that size. A family whose image tokens take positions of
their own (Qwen's multimodal rotary positions) also gives each image's grid of merged patches,
from which those positions are computed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Size = tuple[int, int]
"""An image's (width, height) in pixels."""


@dataclass(frozen=True, slots=True)
class ImageRule:
    """An image in a family's prompt (see the module docstring)."""

    marker: str
    placeholder: int  # the model's image token id

    def tokens(self, size: Size) -> int:
        raise NotImplementedError

    def expansion(self, size: Size) -> str:
        raise NotImplementedError

    @property
    def positioned(self) -> bool:
        """Whether image tokens take positions of their own (:meth:`grid`)."""
        return False

    def grid(self, size: Size) -> Size:
        """(rows, columns) of the image's tokens."""
        raise NotImplementedError

    @property
    def joiner(self) -> int | None:
        """A token between the rows of one image's placeholders (None: they are one run)."""
        return None

    def processing(self) -> dict[str, Any]:
        """What the family's processor passes its image processor beyond its config."""
        return {}

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens attend to each other both ways (Gemma 4): a prompt chunk
        then never ends inside an image."""
        return False

    @property
    def reads(self) -> int:
        """The id the language model reads at an image's rows (beside its features)."""
        return self.placeholder

    @property
    def embedding_scale(self) -> float:
        """What the language model multiplies its input embeddings by, where the family's
        merged embeddings hold image features unscaled (Gemma 4): they are divided by it."""
        return 1.0


@dataclass(frozen=True, slots=True)
class GemmaImages(ImageRule):
    """Gemma 3: a fixed count of image tokens between ``<start_of_image>`` and
    ``<end_of_image>``, blank lines around (transformers' Gemma3Processor, no pan and scan)."""

    image: str = ""
    end: str = ""
    count: int = 256

    def tokens(self, size: Size) -> int:
        return self.count

    def expansion(self, size: Size) -> str:
        return f"\n\n{self.marker}{self.image * self.count}{self.end}\n\n"


@dataclass(frozen=True, slots=True)
class QwenImages(ImageRule):
    """Qwen 3.5 / Qwen3-VL / Qwen2.5-VL: the template writes
    ``<|vision_start|><|image_pad|><|vision_end|>`` and the processor repeats
    ``<|image_pad|>`` once per merged patch of the resized image
    (``smart_resize``: sides multiples of patch x merge, pixels within the bounds). The tokens
    take multimodal rotary positions: (t, row, column) offsets from where the image starts, and
    text after it continues from the start plus its longer side."""

    patch: int = 16
    merge: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mrope_section: tuple[int, ...] = (11, 11, 10)
    theta: float = 100_000.0
    rotary_dims: int = 64
    style: str = "interleaved"  # how the frequencies read the three positions (mlx-vlm's)

    def grid(self, size: Size) -> Size:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        width, height = size
        factor = self.patch * self.merge
        h, w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return h // factor, w // factor

    def tokens(self, size: Size) -> int:
        rows, columns = self.grid(size)
        return rows * columns

    def expansion(self, size: Size) -> str:
        return self.marker * self.tokens(size)

    @property
    def positioned(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class Gemma4Images(ImageRule):
    """Gemma 4: the template writes ``<|image|>``; the image is resized, aspect ratio kept,
    to the most ``patch``-pixel patches within ``budget`` tokens of ``pooling`` x ``pooling``
    patches each, its sides whole tokens, and the processor writes that many ``<|image|>``
    between ``<|image>`` and ``<image|>``. The image's tokens attend to each other both ways
    (``use_bidirectional_attention: vision``) and its rows' per-layer inputs read token
    ``pad`` (0, as mlx-vlm's model and transformers' feed them)."""

    begin: str = "<|image>"
    end: str = "<image|>"
    patch: int = 16
    pooling: int = 3
    budget: int = 280
    pad: int = 0
    scale: float = 1.0

    def grid(self, size: Size) -> Size:
        width, height = size  # (transformers' get_aspect_ratio_preserving_size)
        factor = math.sqrt(self.budget * self.pooling**2 * self.patch**2 / (height * width))
        side = self.pooling * self.patch
        rows, columns = int(factor * height / side), int(factor * width / side)
        if rows == 0 and columns == 0:
            raise ValueError("the image would be resized to 0 x 0 pixels")
        if rows == 0:
            rows, columns = 1, min(width // height, self.budget)
        elif columns == 0:
            rows, columns = min(height // width, self.budget), 1
        return rows, columns

    def tokens(self, size: Size) -> int:
        rows, columns = self.grid(size)
        return rows * columns

    def expansion(self, size: Size) -> str:
        return f"{self.begin}{self.marker * self.tokens(size)}{self.end}"

    @property
    def bidirectional(self) -> bool:
        return True

    @property
    def reads(self) -> int:
        return self.pad

    @property
    def embedding_scale(self) -> float:
        return self.scale


@dataclass(frozen=True, slots=True)
class PixtralImages(ImageRule):
    """Mistral 3 and Pixtral: the template writes ``[IMG]``; the image is scaled
    down to fit ``longest_edge`` and its sides rounded up to whole merged patches, and the
    processor writes a row of ``[IMG]`` a row of merged patches, ``[IMG_BREAK]`` after each
    row but the last, ``[IMG_END]`` after that (transformers' PixtralProcessor)."""

    row_break: str = "[IMG_BREAK]"
    end: str = "[IMG_END]"
    break_id: int = -1
    patch: int = 14
    merge: int = 2
    longest_edge: int = 1540

    def grid(self, size: Size) -> Size:
        width, height = size
        ratio = max(width, height) / self.longest_edge
        if ratio > 1:
            width, height = int(width / ratio), int(height / ratio)
        side = self.patch * self.merge
        return (height - 1) // side + 1, (width - 1) // side + 1

    def tokens(self, size: Size) -> int:
        rows, columns = self.grid(size)
        return rows * columns

    def expansion(self, size: Size) -> str:
        rows, columns = self.grid(size)
        row = self.marker * columns
        return (row + self.row_break) * (rows - 1) + row + self.end

    @property
    def joiner(self) -> int | None:
        return self.break_id

    def processing(self) -> dict[str, Any]:
        side = self.patch * self.merge
        return {"patch_size": {"height": side, "width": side}}


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
    if family == "gemma4":
        processor = _processor_config(path)
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
    return None


def _processor_config(path: Path) -> dict[str, Any]:
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (path / name).is_file():
            data = json.loads((path / name).read_text())
            return data.get("image_processor", data)
    return {}
