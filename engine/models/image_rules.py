"""How each vision-language family writes an image into its prompt: peers of one small protocol,
one class a family (``agentkv.engine.models.vision`` uses them).

A chat template writes ``marker`` for each image part; :meth:`ImageRule.expansion` is the text
the family's processor puts there instead, holding :meth:`ImageRule.tokens` placeholders (the
model's image token) for an image of that size. A family whose image tokens take positions of
their own (Qwen's multimodal rotary positions) also gives each image's grid of merged patches,
from which those positions are computed.
"""

from __future__ import annotations

import functools
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
    def joiners(self) -> frozenset[int]:
        """Tokens between the runs of one image's placeholders (Pixtral's row breaks, LFM2-VL's
        tile markers); none: an image is one run."""
        return frozenset()

    def processing(self) -> dict[str, Any]:
        """What the family's processor passes its image processor beyond its config."""
        return {}

    def image_processor(self, path: Path) -> Any:
        """The family's image processor for the model at ``path`` (transformers')."""
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(str(path))

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
    def joiners(self) -> frozenset[int]:
        return frozenset((self.break_id,))

    def processing(self) -> dict[str, Any]:
        side = self.patch * self.merge
        return {"patch_size": {"height": side, "width": side}}


@dataclass(frozen=True, slots=True)
class Lfm2Images(ImageRule):
    """LFM2-VL: the template writes ``<image>``; the processor (mlx-vlm's, LFM2-VL's official
    tiling) resizes the image to a token budget, each 2x2 patches one token, and writes that
    many ``<image>`` between ``<|image_start|>`` and ``<|image_end|>``. An image too large for
    the budget is cut into a grid of tiles instead, each written after its
    ``<|img_row_R_col_C|>``, then the resized image after ``<|img_thumbnail|>``; the features
    come in that order. ``settings`` is the image processor's configuration."""

    begin: str = "<|image_start|>"
    end: str = "<|image_end|>"
    thumbnail: str = "<|img_thumbnail|>"
    markers: frozenset[int] = frozenset()  # the tiles' and the thumbnail's marker ids
    settings: str = "{}"  # (JSON)

    def layout(self, size: Size) -> tuple[int, int, int, int]:
        """(rows, columns) of the image's tiles (1, 1: not tiled), the tokens of a tile and
        those of the whole image resized (alone, or as the thumbnail)."""
        from mlx_vlm.models.lfm2_vl import processing_lfm2_vl as lfm2

        p = _lfm2_processor(self.settings)
        width, height = size
        patch, factor = p.encoder_patch_size, p.downsample_factor
        w, h = lfm2._smart_resize(
            height, width, factor, p.min_image_tokens, p.max_image_tokens, patch
        )
        whole = lfm2._num_image_tokens_from_patch_grid(h // patch, w // patch, factor)
        large = lfm2._is_image_too_large(
            height, width, p.max_image_tokens, patch, factor, p.max_pixels_tolerance
        )
        if not (p.do_image_splitting and large):
            return 1, 1, 0, whole
        columns, rows, _, _ = lfm2._get_grid_layout(
            height, width, p.min_tiles, p.max_tiles, p.tile_size
        )
        side = p.tile_size // patch
        tile = lfm2._num_image_tokens_from_patch_grid(side, side, factor)
        return rows, columns, tile, whole if p.use_thumbnail else 0

    def tokens(self, size: Size) -> int:
        rows, columns, tile, whole = self.layout(size)
        return rows * columns * tile + whole

    def expansion(self, size: Size) -> str:
        rows, columns, tile, whole = self.layout(size)
        text = self.begin
        for row in range(1, rows + 1 if tile else 1):
            for column in range(1, columns + 1):
                text += f"<|img_row_{row}_col_{column}|>" + self.marker * tile
        if whole:
            text += self.thumbnail * (tile > 0) + self.marker * whole
        return text + self.end

    @property
    def joiners(self) -> frozenset[int]:
        return self.markers

    def image_processor(self, path: Path) -> Any:
        return _lfm2_processor(self.settings)


@functools.lru_cache(maxsize=8)
def _lfm2_processor(settings: str) -> Any:
    """mlx-vlm's LFM2-VL image processor with ``settings`` (JSON; the official tiling on, as
    mlx-vlm's processor loads it whatever the checkpoint says)."""
    from mlx_vlm.models.lfm2_vl.processing_lfm2_vl import Lfm2VlNumpyImageProcessor

    return Lfm2VlNumpyImageProcessor(**json.loads(settings))


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
    if family == "lfm2-vl":
        settings = _processor_config(path) | _processor_config(path, "processor_config.json")
        settings = {k: v for k, v in settings.items() if k not in _LFM2_TILING}
        image = config.get("image_token_id", config.get("image_token_index"))
        markers = [
            f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11) if r * c <= 10
        ]
        ids = tokenizer.convert_tokens_to_ids([*markers, "<|img_thumbnail|>"])
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
