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
class LlavaImages(ImageRule):
    """LLaVA: the template writes ``<image>`` and the processor repeats it once per feature
    the vision tower gives a (center-cropped, fixed-size) image: a token a patch, with CLIP's
    class token unless the model drops it (``vision_feature_select_strategy: default``)."""

    count: int = 576

    def tokens(self, size: Size) -> int:
        return self.count

    def expansion(self, size: Size) -> str:
        return self.marker * self.count


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
    unified: str = ""
    """Gemma 4 unified (encoder-free): its image processor's settings (JSON), for mlx-vlm's."""

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

    def image_processor(self, path: Path) -> Any:
        if not self.unified:
            return ImageRule.image_processor(self, path)
        from mlx_vlm.models.gemma4_unified import Gemma4UnifiedImageProcessor

        settings = json.loads(self.unified)
        settings.pop("image_processor_type", None)
        processor = Gemma4UnifiedImageProcessor(**settings)
        return lambda images, **kwargs: processor(images, **kwargs)[0]  # (data, counts)

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


LFM2_TILE_MARKERS = tuple(
    f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11) if r * c <= 10
)
"""The token LFM2-VL writes before each tile of an image's grid (at most 10 tiles)."""


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
