"""Offline tiny models: real model directories built locally and deterministically.

No model hub is reachable, so tests and benchmarks use random-weight models built here:
``config.json``, ``model.safetensors`` (float32), a byte-level BPE ``tokenizer.json`` trained on a
corpus generated from a fixed seed, ``tokenizer_config.json`` with a chat template, plus
``special_tokens_map.json`` and ``generation_config.json``. ``mlx_lm.load`` accepts them as is.

Chat templates render every message independently of later ones, so the rendering of a prefix of
the messages is a string prefix of the whole rendering (the runtime appends each new turn as a text
delta to a cached history). Gemma style renders a system message as its own
``<start_of_turn>system`` turn rather than folding it into the first user turn as Gemma does, so an
agent's system prompt can be prefilled and cached before its first user message.

Building reseeds MLX's global random generator (``mx.random.seed``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from agentkv.engine.errors import OutputDirNotEmptyError, UnknownTinyModelError
from agentkv.models.chat_formats import (
    CHATML_TOOLS,
    CHATML_TOOLS_GEMMA4_VL,
    CHATML_TOOLS_LFM2_VL,
    CHATML_TOOLS_LLAVA_VL,
    CHATML_TOOLS_MISTRAL_VL,
    CHATML_TOOLS_QWEN_VL,
    CHATML_TOOLS_VL,
    GEMMA,
    LLAMA,
    QWEN3,
    ChatFormat,
)
from agentkv.models.tiny_tokenizer import write_tokenizer

BUILDER_VERSION = 1
HOME_ENV = "AGENTKV_HOME"
MARKER_FILE = "agentkv_tiny.json"
# Builds seed MLX's global generator; two threads building at once would interleave draws.
_BUILD_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class Shape:
    """Model dimensions; ``window``/``pattern`` are Gemma-3's sliding window and global stride."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_pos: int
    window: int | None = None
    pattern: int | None = None


@dataclass(frozen=True, slots=True)
class TinySpec:
    """The full definition of one tiny model; its hash names the cache directory."""

    name: str
    description: str
    model_type: str
    chat: ChatFormat
    shape: Shape
    corpus_words: int
    lexicon_size: int
    seed: int = 0
    eos_scale: float = 1.0
    """Scales the end-of-turn token's (tied) embedding, so the random model ends its replies
    after a few tokens instead of running to max_tokens (clients like Claude Code ask for up
    to 64,000 tokens)."""
    embed_scale: float = 1.0
    """Scales the token embeddings: a random model with tied embeddings whose hidden state is
    mostly its input token's embedding (LFM2's) only repeats that token."""
    dtype: str = "float32"
    """The weights' floating-point type (and so the activations' and the KV cache's)."""
    weight_bits: int | None = None
    """Quantize the linear and embedding weights to this many bits (groups of 64), as
    ``mlx_lm.convert -q`` writes them; None keeps them in ``dtype``."""
    fields: tuple[tuple[str, object], ...] = ()
    """``config.json`` fields of the architecture beyond :class:`Shape` (a hybrid's recurrent
    layers)."""
    vision: tuple[tuple[str, object], ...] = ()
    """A vision-language model's ``vision_config`` (its weights built from mlx-vlm's classes,
    the text model's fields under ``text_config``); empty for a text model."""
    image_tokens: int = 16
    """A vision-language model's tokens per image."""

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab

    @property
    def definition_hash(self) -> str:
        """Short hash of everything that shapes the files, including the building libraries."""
        definition = asdict(self)
        defaults = {
            "eos_scale": 1.0,
            "embed_scale": 1.0,
            "dtype": "float32",
            "weight_bits": None,
            "fields": (),
            "vision": (),
            "image_tokens": 16,
        }
        for field, default in defaults.items():  # leave older models' hashes as they were
            if definition[field] == default:
                del definition[field]
        versions = _library_versions()
        if self.vision:
            versions = versions | {"mlx-vlm": importlib.metadata.version("mlx-vlm")}
        blob = json.dumps([BUILDER_VERSION, versions, definition], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def config(self) -> dict:
        """The ``config.json`` contents, in Hugging Face field names."""
        s, chat = self.shape, self.chat
        config = {
            "model_type": self.model_type,
            "hidden_size": s.hidden,
            "intermediate_size": s.ffn,
            "num_hidden_layers": s.layers,
            "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads,
            "head_dim": s.head_dim,
            "vocab_size": s.vocab,
            "max_position_embeddings": s.max_pos,
            "tie_word_embeddings": True,
            "bos_token_id": chat.id_of(chat.bos),
            "eos_token_id": chat.eos_token_ids,
            "pad_token_id": chat.id_of(chat.pad),
            "torch_dtype": self.dtype,
        }
        if self.weight_bits is not None:
            config["quantization"] = {"group_size": 64, "bits": self.weight_bits}
        if self.model_type in ("gemma3_text", "gemma3"):
            global_layer = s.pattern - 1
            config |= {
                "architectures": ["Gemma3ForCausalLM"],
                "sliding_window": s.window,
                "sliding_window_pattern": s.pattern,
                "layer_types": [
                    "full_attention" if i % s.pattern == global_layer else "sliding_attention"
                    for i in range(s.layers)
                ],
                "query_pre_attn_scalar": s.head_dim,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1_000_000.0,
                "rope_local_base_freq": 10_000.0,
                "hidden_activation": "gelu_pytorch_tanh",
            }
        elif self.model_type in ("qwen3_next", "qwen3_5"):
            config |= {"architectures": ["Qwen3NextForCausalLM"], "rms_norm_eps": 1e-6}
            config |= {"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
        else:
            config |= {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5}
            config |= {"rope_theta": 500_000.0, "attention_bias": False, "mlp_bias": False}
        config |= dict(self.fields)
        return self._vision_config(config) if self.vision else config

    def _vision_config(self, text: dict) -> dict:
        """A vision-language model's config: the language model's fields under text_config,
        the vision tower's under vision_config, the image tokens' ids."""
        chat = self.chat
        keys = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
        config = {key: text[key] for key in keys}
        config |= {"model_type": self.model_type, "torch_dtype": self.dtype}
        config |= {"vision_config": dict(self.vision)}
        if self.model_type == "gemma3":
            text |= {"rope_global_base_freq": text["rope_theta"]}
            return config | {
                "architectures": ["Gemma3ForConditionalGeneration"],
                "text_config": text | {"mm_tokens_per_image": self.image_tokens},
                "hidden_size": text["hidden_size"],
                "mm_tokens_per_image": self.image_tokens,
                "boi_token_index": chat.id_of("<start_of_image>"),
                "eoi_token_index": chat.id_of("<end_of_image>"),
                "image_token_index": chat.id_of("<image_soft_token>"),
            }
        if self.model_type in ("gemma4", "gemma4_unified"):  # a token budget, aspect kept
            unified = self.model_type == "gemma4_unified"
            return config | {
                "architectures": [f"Gemma4{'Unified' if unified else ''}ForConditionalGeneration"],
                "text_config": text | {"model_type": f"{self.model_type}_text"},
                "hidden_size": text["hidden_size"],
                "boi_token_id": chat.id_of("<|image>"),
                "eoi_token_id": chat.id_of("<image|>"),
                "image_token_id": chat.id_of("<|image|>"),
                "vision_soft_tokens_per_image": self.image_tokens,
            }
        if self.model_type == "llava":  # LLaVA's: a Llama text model, a CLIP tower
            return config | {
                "architectures": ["LlavaForConditionalGeneration"],
                "text_config": text | {"model_type": "llama"},
                "image_token_index": chat.id_of("<image>"),
                "vision_feature_select_strategy": "default",
                "vision_feature_layer": -2,
                "projector_hidden_act": "gelu",
            }
        if self.model_type == "lfm2-vl":  # LFM2-VL's: an LFM2 text model, patches unshuffled
            return config | {
                "architectures": ["Lfm2VlForConditionalGeneration"],
                "text_config": text | {"model_type": "lfm2"},
                "image_token_id": chat.id_of("<image>"),
                "downsample_factor": 2,
                "projector_hidden_size": 64,
                "projector_use_layernorm": True,
                "vision_feature_layer": -1,
            }
        if self.model_type == "pixtral":  # Pixtral's: a Mistral text model, patches unmerged
            return config | {
                "architectures": ["LlavaForConditionalGeneration"],
                "text_config": text | {"model_type": "mistral"},
                "image_token_index": chat.id_of("[IMG]"),
                "vision_feature_layer": -1,
            }
        if self.model_type == "mistral3":  # Mistral 3's: a Mistral text model, Pixtral's tower
            return config | {
                "architectures": ["Mistral3ForConditionalGeneration"],
                "text_config": text | {"model_type": "mistral"},
                "image_token_index": chat.id_of("[IMG]"),
                "spatial_merge_size": 2,
                "vision_feature_layer": -1,
                "multimodal_projector_bias": False,
                "projector_hidden_act": "gelu",
            }
        qwen = {
            "image_token_id": chat.id_of("<|image_pad|>"),
            "video_token_id": chat.id_of("<|video_pad|>"),
            "vision_start_token_id": chat.id_of("<|vision_start|>"),
            "vision_end_token_id": chat.id_of("<|vision_end|>"),
        }
        if self.model_type in ("qwen3_vl", "qwen3_vl_moe"):  # Qwen3's text model, interleaved
            rope = {"rope_type": "default", "mrope_section": [12, 10, 10]}  # (32 frequencies)
            text |= {"model_type": f"{self.model_type}_text", "rope_theta": 5_000_000.0}
            moe = self.model_type.endswith("moe")
            return config | {
                "architectures": [f"Qwen3VL{'Moe' if moe else ''}ForConditionalGeneration"],
                "text_config": text | {"rope_scaling": rope | {"mrope_interleaved": True}},
                **qwen,
            }
        if self.model_type in ("qwen2_vl", "qwen2_5_vl"):  # Qwen2(.5)-VL's: text fields at the top
            mrope = {"type": "mrope", "mrope_section": [2, 3, 3]}  # (8 frequencies a head)
            text |= {"rope_theta": 1_000_000.0, "rope_scaling": mrope}
            architecture = "Qwen2_5_VL" if self.model_type == "qwen2_5_vl" else "Qwen2VL"
            return (
                text
                | config
                | qwen
                | {"architectures": [f"{architecture}ForConditionalGeneration"]}
            )
        rope = {"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 100_000.0}
        rope |= {"partial_rotary_factor": 0.25, "mrope_interleaved": True}
        return config | {  # Qwen 3.5's
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": text | {"model_type": "qwen3_5_text", "rope_parameters": rope},
            **qwen,
        }


_GEMMA4_VL_TEXT = (  # tiny:gemma4-vl's text model fields (also Gemma 4 unified's)
    ("rms_norm_eps", 1e-6),
    ("global_head_dim", 64),
    ("vocab_size_per_layer_input", 512),
    ("hidden_size_per_layer_input", 16),
    ("num_kv_shared_layers", 2),  # (E2B's: the last two reuse earlier KV)
    ("sliding_window", 16),
    ("sliding_window_pattern", 2),
    ("layer_types", ["sliding_attention", "full_attention"] * 2),
    (
        "rope_parameters",
        {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
    ),
    ("final_logit_softcapping", 30.0),
    ("attention_k_eq_v", False),
    ("use_double_wide_mlp", False),
    ("enable_moe_block", False),
    ("use_bidirectional_attention", "vision"),
)


def _siglip(layers: int, hidden: int, ffn: int, heads: int, patch: int, image: int) -> tuple:
    """Gemma 3's vision tower (SigLIP) fields: ``layers`` of ``hidden`` (MLP ``ffn`` wide),
    ``image`` pixels a side in ``patch``-pixel patches."""
    return (
        ("model_type", "siglip_vision_model"),
        ("num_hidden_layers", layers),
        ("hidden_size", hidden),
        ("intermediate_size", ffn),
        ("num_attention_heads", heads),
        ("patch_size", patch),
        ("image_size", image),
    )


def _pixtral_tower(patch: int) -> tuple:
    """A 2-layer Pixtral vision tower (Pixtral's, Mistral 3's) of ``patch``-pixel patches,
    images up to 64 pixels a side."""
    return (
        ("model_type", "pixtral"),
        ("num_hidden_layers", 2),
        ("hidden_size", 32),
        ("head_dim", 16),
        ("intermediate_size", 64),
        ("num_attention_heads", 2),
        ("patch_size", patch),
        ("image_size", 64),
        ("rope_theta", 10_000.0),
    )


def _qwen3_vl_tower(family: str) -> tuple:
    """A 3-layer Qwen3-VL vision tower whose first two layers' features also enter the text
    model after its first two layers (deepstack); 16-pixel patches merged 2x2."""
    return (
        ("model_type", family),
        ("depth", 3),
        ("hidden_size", 32),
        ("intermediate_size", 64),
        ("out_hidden_size", 64),
        ("num_heads", 2),
        ("patch_size", 16),
        ("spatial_merge_size", 2),
        ("temporal_patch_size", 2),
        ("num_position_embeddings", 64),
        ("deepstack_visual_indexes", [0, 1]),
        ("in_channels", 3),
    )


def _qwen3_next(layers: int, key_heads: int, head_dim: int, moe: int) -> tuple:
    """Qwen3-Next's fields beyond :class:`Shape`: gated-delta layers with twice as many value
    heads as key heads, a global attention layer every 4th, and dense MLPs in every layer (the
    expert fields are required but unused)."""
    return (
        ("linear_num_value_heads", 2 * key_heads),
        ("linear_num_key_heads", key_heads),
        ("linear_key_head_dim", head_dim),
        ("linear_value_head_dim", head_dim),
        ("linear_conv_kernel_dim", 4),
        ("full_attention_interval", 4),
        ("num_experts", 4),
        ("num_experts_per_tok", 2),
        ("moe_intermediate_size", moe),
        ("shared_expert_intermediate_size", moe),
        ("decoder_sparse_step", 1),
        ("mlp_only_layers", tuple(range(layers))),
        ("norm_topk_prob", True),
    )


# head_dim is 64 or more so KV caches quantize with mx.quantize at group size 64.
TINY_SPECS: dict[str, TinySpec] = {
    s.name: s
    for s in (
        TinySpec(
            name="tiny:gemma3",
            description="gemma3_text, 5 layers: sliding (window 32) alternating with global",
            model_type="gemma3_text",
            chat=GEMMA,
            shape=Shape(64, 5, 4, 2, 64, 256, vocab=512, max_pos=8192, window=32, pattern=2),
            corpus_words=20_000,
            lexicon_size=2_000,
        ),
        TinySpec(
            name="tiny:gemma3-vl",
            description=(
                "gemma3 vision-language model (mlx-vlm's classes): tiny:gemma3's text model and "
                "a 2-layer SigLIP vision tower, 64x64 images of 16 tokens; ChatML with tool calling"
            ),
            model_type="gemma3",
            chat=CHATML_TOOLS_VL,
            shape=Shape(64, 5, 4, 2, 64, 256, vocab=512, max_pos=8192, window=32, pattern=2),
            corpus_words=20_000,
            lexicon_size=2_000,
            vision=_siglip(layers=2, hidden=32, ffn=64, heads=2, patch=8, image=64),
        ),
        TinySpec(
            name="tiny:tools-vl",
            description=(
                "tiny:tools (ChatML tool calling, a 128K context, 2 layers) as a gemma3 "
                "vision-language model: a 2-layer SigLIP vision tower, 64x64 images of 16 tokens"
            ),
            model_type="gemma3",
            chat=CHATML_TOOLS_VL,
            shape=Shape(64, 2, 1, 1, 64, 128, vocab=512, max_pos=131_072, window=128, pattern=2),
            corpus_words=20_000,
            lexicon_size=2_000,
            eos_scale=4.0,
            vision=_siglip(layers=2, hidden=32, ffn=64, heads=2, patch=8, image=64),
        ),
        TinySpec(
            name="tiny:gemma3-bench-vl",
            description=(
                "gemma3 vision-language benchmark model: tiny:gemma3-bench's text model and a "
                "6-layer SigLIP vision tower (hidden 384), 224x224 images of 64 tokens"
            ),
            model_type="gemma3",
            chat=CHATML_TOOLS_VL,
            shape=Shape(512, 12, 4, 1, 128, 2048, 32_768, 32_768, window=512, pattern=6),
            corpus_words=300_000,
            lexicon_size=40_000,
            vision=_siglip(layers=6, hidden=384, ffn=1536, heads=6, patch=14, image=224),
            image_tokens=64,
        ),
        TinySpec(
            name="tiny:gemma3-tower-vl",
            description=(
                "tiny:gemma3-bench-vl with a 12-layer SigLIP vision tower (hidden 768) on "
                "448x448 images of 256 tokens: a tower that takes seconds on a CPU"
            ),
            model_type="gemma3",
            chat=CHATML_TOOLS_VL,
            shape=Shape(512, 12, 4, 1, 128, 2048, 32_768, 32_768, window=512, pattern=6),
            corpus_words=300_000,
            lexicon_size=40_000,
            vision=_siglip(layers=12, hidden=768, ffn=3072, heads=12, patch=14, image=448),
            image_tokens=256,
        ),
        TinySpec(
            name="tiny:qwen3_5-vl",
            description=(
                "qwen3_5 vision-language model (mlx-vlm's classes): tiny:hybrid's text model "
                "(3 gated-delta layers, 1 global) with multimodal rotary positions and a "
                "2-layer vision tower; 16-pixel patches merged 2x2, images up to 128x128"
            ),
            model_type="qwen3_5",
            chat=CHATML_TOOLS_QWEN_VL,
            shape=Shape(64, 4, 4, 2, 64, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            eos_scale=4.0,
            fields=(  # Qwen3-Next's linear attention fields, dense MLPs
                ("linear_num_value_heads", 4),
                ("linear_num_key_heads", 2),
                ("linear_key_head_dim", 32),
                ("linear_value_head_dim", 32),
                ("linear_conv_kernel_dim", 4),
                ("full_attention_interval", 4),
            ),
            vision=(
                ("model_type", "qwen3_5"),
                ("depth", 2),
                ("hidden_size", 32),
                ("intermediate_size", 64),
                ("out_hidden_size", 64),
                ("num_heads", 2),
                ("patch_size", 16),
                ("spatial_merge_size", 2),
                ("temporal_patch_size", 2),
                ("num_position_embeddings", 64),
                ("in_channels", 3),
            ),
        ),
        TinySpec(
            name="tiny:qwen2_5-vl",
            description=(
                "qwen2_5_vl vision-language model (mlx-vlm's classes): a 4-layer Qwen2 text "
                "model with multimodal rotary positions (sections in order) and a 2-layer "
                "vision tower; 14-pixel patches merged 2x2, images up to 112x112"
            ),
            model_type="qwen2_5_vl",
            chat=CHATML_TOOLS_QWEN_VL,
            shape=Shape(64, 4, 4, 2, 16, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            eos_scale=4.0,
            vision=(
                ("model_type", "qwen2_5_vl"),
                ("depth", 2),
                ("hidden_size", 32),
                ("intermediate_size", 64),
                ("out_hidden_size", 64),
                ("num_heads", 2),
                ("patch_size", 14),
                ("spatial_patch_size", 14),
                ("spatial_merge_size", 2),
                ("temporal_patch_size", 2),
                ("window_size", 56),
                ("fullatt_block_indexes", [1]),
                ("in_channels", 3),
            ),
        ),
        TinySpec(
            name="tiny:qwen3-vl",
            description=(
                "qwen3_vl vision-language model (mlx-vlm's classes): a 4-layer Qwen3 text model "
                "with multimodal rotary positions (interleaved) and a 3-layer vision tower whose "
                "first two layers' features are added after the text model's first two layers "
                "(deepstack); 16-pixel patches merged 2x2, images up to 128x128"
            ),
            model_type="qwen3_vl",
            chat=CHATML_TOOLS_QWEN_VL,
            shape=Shape(64, 4, 4, 2, 64, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            eos_scale=4.0,
            vision=_qwen3_vl_tower("qwen3_vl"),
        ),
        TinySpec(
            name="tiny:qwen3-moe-vl",
            description=(
                "qwen3_vl_moe vision-language model (mlx-vlm's classes): tiny:qwen3-vl with "
                "4 experts (2 a token) in every layer's MLP"
            ),
            model_type="qwen3_vl_moe",
            chat=CHATML_TOOLS_QWEN_VL,
            shape=Shape(64, 4, 4, 2, 64, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            eos_scale=4.0,
            fields=(
                ("num_experts", 4),
                ("num_experts_per_tok", 2),
                ("moe_intermediate_size", 64),
                ("decoder_sparse_step", 1),
                ("mlp_only_layers", []),
                ("norm_topk_prob", True),
                ("tie_word_embeddings", False),  # (mlx-lm's class reads a head of its own)
            ),
            vision=_qwen3_vl_tower("qwen3_vl_moe"),
        ),
        TinySpec(
            name="tiny:gemma4-vl",
            description=(
                "gemma4 vision-language model (mlx-vlm's classes): a 4-layer Gemma 4 text "
                "model (sliding and global layers, per-layer inputs, the last two layers "
                "reusing earlier layers' KV, image tokens attending to each other both ways) "
                "and a 2-layer vision tower; 8-pixel patches pooled "
                "2x2, at most 70 image tokens an image, aspect ratio kept"
            ),
            model_type="gemma4",
            image_tokens=70,  # (the fewest transformers' Gemma 4 processor takes)
            chat=CHATML_TOOLS_GEMMA4_VL,
            shape=Shape(64, 4, 4, 2, 32, 128, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            fields=_GEMMA4_VL_TEXT,
            vision=(
                ("model_type", "gemma4_vision"),
                ("hidden_size", 32),
                ("intermediate_size", 64),
                ("num_hidden_layers", 2),
                ("num_attention_heads", 2),
                ("num_key_value_heads", 2),
                ("head_dim", 16),
                ("global_head_dim", 16),
                ("patch_size", 8),
                ("pooling_kernel_size", 2),
                ("position_embedding_size", 64),
                ("default_output_length", 70),
            ),
        ),
        TinySpec(
            name="tiny:gemma4-unified-vl",
            description=(
                "gemma4_unified vision-language model (mlx-vlm's classes): tiny:gemma4-vl's "
                "text model with Gemma 4's encoder-free vision: each 16-pixel patch (8-pixel "
                "patches pooled 2x2) projected to one token, at most 70 an image"
            ),
            model_type="gemma4_unified",
            image_tokens=70,  # (the fewest transformers' Gemma 4 processor takes)
            chat=CHATML_TOOLS_GEMMA4_VL,
            shape=Shape(64, 4, 4, 2, 32, 128, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            fields=_GEMMA4_VL_TEXT,
            vision=(
                ("model_type", "gemma4_unified_vision"),
                ("patch_size", 8),
                ("pooling_kernel_size", 2),
                ("model_patch_size", 16),
                ("mm_embed_dim", 32),
                ("mm_posemb_size", 64),
                ("num_soft_tokens", 70),
                ("output_proj_dims", 32),
            ),
        ),
        TinySpec(
            name="tiny:pixtral-vl",
            description=(
                "pixtral vision-language model (mlx-vlm's classes): a 4-layer Mistral text "
                "model with an output head of its own and a 2-layer Pixtral vision tower; "
                "16-pixel patches, images up to 64 pixels a side, a row of image tokens per "
                "row of patches"
            ),
            model_type="pixtral",
            chat=CHATML_TOOLS_MISTRAL_VL,
            shape=Shape(64, 4, 4, 2, 64, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            fields=(("tie_word_embeddings", False),),  # (mlx-lm's class reads a head)
            vision=_pixtral_tower(patch=16),
        ),
        TinySpec(
            name="tiny:mistral3-vl",
            description=(
                "mistral3 vision-language model (mlx-vlm's classes): a 4-layer Mistral text "
                "model and a 2-layer Pixtral vision tower; 8-pixel patches merged 2x2, images up "
                "to 64 pixels a side, a row of image tokens per row of merged patches"
            ),
            model_type="mistral3",
            chat=CHATML_TOOLS_MISTRAL_VL,
            shape=Shape(64, 4, 4, 2, 64, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            vision=_pixtral_tower(patch=8),
        ),
        TinySpec(
            name="tiny:lfm2-vl",
            description=(
                "lfm2-vl vision-language model (mlx-vlm's classes): a 4-layer LFM2 text "
                "model, hidden 128 (3 short-convolution layers, 1 global) and a 2-layer SigLIP2 "
                "vision tower; "
                "8-pixel patches unshuffled 2x2, at most 8 tokens an image, a larger image cut "
                "into 32-pixel tiles of 4 tokens beside its thumbnail"
            ),
            model_type="lfm2-vl",
            image_tokens=8,
            chat=CHATML_TOOLS_LFM2_VL,
            shape=Shape(128, 4, 2, 1, 64, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            embed_scale=0.1,
            fields=(
                ("norm_eps", 1e-5),
                ("conv_bias", False),
                ("conv_L_cache", 3),
                ("block_dim", 128),
                ("block_ff_dim", 256),
                ("block_multiple_of", 64),
                ("block_ffn_dim_multiplier", 1.0),
                ("block_auto_adjust_ff_dim", True),
                ("layer_types", ["conv", "conv", "full_attention", "conv"]),
                ("rope_theta", 1_000_000.0),
            ),
            vision=(
                ("model_type", "siglip2_vision_model"),
                ("hidden_size", 32),
                ("intermediate_size", 64),
                ("num_hidden_layers", 2),
                ("num_attention_heads", 2),
                ("patch_size", 8),
                ("num_patches", 16),
                ("num_channels", 3),
            ),
        ),
        TinySpec(
            name="tiny:llava-vl",
            description=(
                "llava vision-language model (mlx-vlm's classes): a 4-layer Llama text model, "
                "hidden 128, and a 2-layer CLIP vision tower; 32x32 center-cropped images of "
                "16 tokens (8-pixel patches, the class token dropped)"
            ),
            model_type="llava",
            chat=CHATML_TOOLS_LLAVA_VL,
            shape=Shape(128, 4, 2, 1, 64, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            image_tokens=16,
            embed_scale=0.1,
            vision=(
                ("model_type", "clip_vision_model"),
                ("num_hidden_layers", 2),
                ("hidden_size", 32),
                ("intermediate_size", 64),
                ("num_attention_heads", 2),
                ("image_size", 32),
                ("patch_size", 8),
                ("projection_dim", 32),
            ),
        ),
        TinySpec(
            name="tiny:qwen2-vl",
            description=(
                "qwen2_vl vision-language model (mlx-vlm's classes): tiny:qwen2_5-vl's text "
                "model and a 2-layer Qwen2-VL vision tower (full attention); 14-pixel patches "
                "merged 2x2, images up to 112x112"
            ),
            model_type="qwen2_vl",
            chat=CHATML_TOOLS_QWEN_VL,
            shape=Shape(64, 4, 4, 2, 16, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            eos_scale=4.0,
            vision=(
                ("model_type", "qwen2_vl"),
                ("depth", 2),
                ("embed_dim", 32),
                ("hidden_size", 64),
                ("num_heads", 2),
                ("mlp_ratio", 2),
                ("patch_size", 14),
                ("spatial_patch_size", 14),
                ("spatial_merge_size", 2),
                ("temporal_patch_size", 2),
                ("in_channels", 3),
            ),
        ),
        TinySpec(
            name="tiny:llama",
            description="llama, 4 full-attention layers",
            model_type="llama",
            chat=LLAMA,
            shape=Shape(64, 4, 4, 2, 64, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
        ),
        TinySpec(
            name="tiny:tools",
            description=(
                "gemma3_text with tool calling (ChatML, <tool_call> JSON) and a 128K context: one "
                "sliding layer (window 128) and one global layer, so prefilling a Claude Code "
                "prompt (~60K tokens) takes seconds on a CPU"
            ),
            model_type="gemma3_text",
            chat=CHATML_TOOLS,
            shape=Shape(64, 2, 1, 1, 64, 128, vocab=512, max_pos=131_072, window=128, pattern=2),
            corpus_words=20_000,
            lexicon_size=2_000,
            eos_scale=4.0,
        ),
        TinySpec(
            name="tiny:thinking",
            description=(
                "llama, 2 full-attention layers and a 128K context (a Claude Code or Codex "
                "prompt prefills in seconds on a CPU), with Qwen3's chat template: reasoning "
                "between <think> and </think> (enable_thinking), Qwen 3.5's XML tool calls"
            ),
            model_type="llama",
            chat=QWEN3,
            shape=Shape(64, 2, 4, 2, 64, 256, vocab=512, max_pos=131_072),
            corpus_words=20_000,
            lexicon_size=2_000,
            eos_scale=4.0,
        ),
        TinySpec(
            name="tiny:hybrid",
            description=(
                "qwen3_next (Qwen3-Next / Qwen 3.5's hybrid), 4 layers: 3 gated-delta linear "
                "attention layers (a convolution and a recurrent state each), 1 global attention "
                "layer; ChatML with tool calling"
            ),
            model_type="qwen3_next",
            chat=CHATML_TOOLS,
            shape=Shape(64, 4, 4, 2, 64, 256, vocab=512, max_pos=8192),
            corpus_words=20_000,
            lexicon_size=2_000,
            eos_scale=4.0,
            fields=_qwen3_next(layers=4, key_heads=2, head_dim=32, moe=64),
        ),
        TinySpec(
            name="tiny:gemma3-bench",
            description="gemma3_text benchmark model: 12 layers, 10 sliding (window 512), 2 global",
            model_type="gemma3_text",
            chat=GEMMA,
            shape=Shape(512, 12, 4, 1, 128, 2048, 32_768, 32_768, window=512, pattern=6),
            corpus_words=300_000,
            lexicon_size=40_000,
        ),
        TinySpec(
            name="tiny:hybrid-bench",
            description=(
                "qwen3_next benchmark model: 12 layers, 9 gated-delta linear attention, 3 global "
                "(1 KV head x 128)"
            ),
            model_type="qwen3_next",
            chat=CHATML_TOOLS,
            shape=Shape(512, 12, 4, 1, 128, 2048, 32_768, 32_768),
            corpus_words=300_000,
            lexicon_size=40_000,
            fields=_qwen3_next(layers=12, key_heads=4, head_dim=64, moe=256),
        ),
        TinySpec(
            name="tiny:gemma3-12b",
            description=(
                "Gemma 3 12B's shapes with random 4-bit weights, for accelerators: 48 layers, 40 "
                "sliding (window 1024), 8 global, 8 KV heads x 256, vocab 32768; 5.8 GiB"
            ),
            model_type="gemma3_text",
            chat=GEMMA,
            shape=Shape(3840, 48, 16, 8, 256, 15_360, 32_768, 131_072, window=1024, pattern=6),
            corpus_words=300_000,
            lexicon_size=40_000,
            dtype="bfloat16",
            weight_bits=4,
        ),
    )
}


@functools.cache
def _library_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in ("mlx", "mlx-lm", "tokenizers")}


def get_tiny_spec(spec: str) -> TinySpec:
    """The definition of a ``tiny:*`` spec.

    Raises:
        UnknownTinyModelError: ``spec`` is not a known tiny model.
    """
    try:
        return TINY_SPECS[spec]
    except KeyError:
        known = ", ".join(TINY_SPECS)
        raise UnknownTinyModelError(f"unknown tiny model {spec!r}; known: {known}") from None


def agentkv_home() -> Path:
    """``$AGENTKV_HOME``, by default ``~/.cache/agentkv``: what agentkv builds once per machine
    (tiny models, tokenizer indexes)."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "agentkv").expanduser()


def models_home() -> Path:
    """``$AGENTKV_HOME/models``, by default ``~/.cache/agentkv/models``."""
    return agentkv_home() / "models"


def tiny_model_dir(spec: str) -> Path:
    """The cached directory of a tiny model, built on first use.

    Concurrent callers (threads or processes) are safe: each builds into its own temporary
    directory and renames it into place; a loser of the race discards its copy.

    Args:
        spec: A tiny model spec such as ``"tiny:gemma3"``.

    Returns:
        The model directory, ``<models_home>/<name>-<definition hash>``.
    """
    definition = get_tiny_spec(spec)
    target = models_home() / f"{spec.removeprefix('tiny:')}-{definition.definition_hash}"
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        _build_and_move(definition, target)
    return target


def build_tiny_model(spec: str, out_dir: str | os.PathLike) -> Path:
    """Write a tiny model into ``out_dir`` (created if missing; must be empty).

    Args:
        spec: A tiny model spec such as ``"tiny:gemma3"``.
        out_dir: The directory to write.

    Returns:
        The absolute model directory.

    Raises:
        UnknownTinyModelError: ``spec`` is not a known tiny model.
        OutputDirNotEmptyError: ``out_dir`` holds anything but an identical earlier build.
    """
    definition = get_tiny_spec(spec)
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not _is_empty_dir(out):
        if _is_build_of(out, definition):
            return out
        raise OutputDirNotEmptyError(
            f"{out} exists and is not an empty directory; choose a new or empty --out directory"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    _build_and_move(definition, out)
    if not _is_build_of(out, definition):  # another process filled `out` meanwhile
        raise OutputDirNotEmptyError(f"{out} was filled by someone else while building")
    return out


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _is_build_of(path: Path, definition: TinySpec) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(definition)


def _marker(definition: TinySpec) -> dict:
    return {"spec": definition.name, "definition_hash": definition.definition_hash}


def _build_and_move(definition: TinySpec, target: Path) -> None:
    with _BUILD_LOCK:
        if _is_build_of(target, definition):
            return  # another thread built it while this one waited
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _write_model(definition, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it owner-only
            with contextlib.suppress(OSError):  # target is not empty: another process won
                os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_model(definition: TinySpec, out: Path) -> None:
    corpus = (definition.seed, definition.corpus_words, definition.lexicon_size)
    write_tokenizer(definition.chat, definition.vocab_size, corpus, out)
    config, chat = definition.config, definition.chat
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation)
    special = {"bos_token": chat.bos, "eos_token": chat.eos, "pad_token": chat.pad}
    if chat.unk is not None:
        special["unk_token"] = chat.unk
    _write_json(out / "special_tokens_map.json", special)
    tokenizer_config = {
        **special,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": definition.shape.max_pos,
        "chat_template": chat.chat_template,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    if definition.model_type == "gemma4_unified":  # (its processor's, nested)
        settings = {"image_processor": _image_processor(definition)}
        _write_json(out / "processor_config.json", settings | {"image_seq_length": 70})
    elif definition.vision:
        _write_json(out / "preprocessor_config.json", _image_processor(definition))
    _write_weights(definition, out / "model.safetensors")
    _write_json(out / MARKER_FILE, _marker(definition))


def _image_processor(definition: TinySpec) -> dict:
    """The image processor's config, as the family's checkpoints describe it."""
    vision = dict(definition.vision)
    common = {"do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True}
    common |= {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_convert_rgb": True}
    if definition.model_type == "gemma3":
        size = vision["image_size"]
        return common | {
            "image_processor_type": "Gemma3ImageProcessor",
            "size": {"height": size, "width": size},
            "do_resize": True,
            "resample": 2,
            "do_pan_and_scan": False,
        }
    if definition.model_type == "gemma4_unified":  # Gemma 4's, each token a patch
        return common | {
            "image_processor_type": "Gemma4UnifiedImageProcessor",
            "patch_size": vision["patch_size"],
            "max_soft_tokens": definition.image_tokens,
            "pooling_kernel_size": vision["pooling_kernel_size"],
            "model_patch_size": vision["model_patch_size"],
            "mm_posemb_size": vision["mm_posemb_size"],
            "do_resize": True,
            "do_normalize": False,
        }
    if definition.model_type == "gemma4":  # scaled to a patch budget, aspect kept
        return common | {
            "image_processor_type": "Gemma4ImageProcessor",
            "patch_size": vision["patch_size"],
            "max_soft_tokens": definition.image_tokens,
            "pooling_kernel_size": vision["pooling_kernel_size"],
            "do_resize": True,
            "do_normalize": False,
        }
    if definition.model_type == "llava":  # CLIP's: the short side resized, center-cropped
        size = vision["image_size"]
        return common | {
            "image_processor_type": "CLIPImageProcessor",
            "size": {"shortest_edge": size},
            "crop_size": {"height": size, "width": size},
            "do_resize": True,
            "do_center_crop": True,
            "resample": 3,
        }
    if definition.model_type == "lfm2-vl":  # a token budget; a larger image tiled
        return common | {
            "image_processor_type": "Lfm2VlImageProcessor",
            "encoder_patch_size": vision["patch_size"],
            "downsample_factor": 2,
            "min_image_tokens": 2,
            "max_image_tokens": definition.image_tokens,
            "tile_size": 4 * vision["patch_size"],
            "max_pixels_tolerance": 2.0,
            "do_image_splitting": True,
            "min_tiles": 2,
            "max_tiles": 10,
            "use_thumbnail": True,
            "resample": 3,
        }
    if definition.model_type in ("mistral3", "pixtral"):  # scaled to fit, sides in patches
        return common | {
            "image_processor_type": "PixtralImageProcessor",
            "patch_size": {"height": vision["patch_size"], "width": vision["patch_size"]},
            "size": {"longest_edge": vision["image_size"]},
            "do_resize": True,
            "resample": 3,
        }
    return common | {  # Qwen's: images resized to multiples of patch x merge, pixels bounded
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": vision["patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "size": {"shortest_edge": 32 * 32, "longest_edge": (8 * vision["patch_size"]) ** 2},
        "do_resize": True,
    }


def _initial(key: str, value):
    """A recurrent layer's time steps as trained models have them (softplus of the bias
    between 0.001 and 0.1), where mlx-lm's class starts them at one: a state that forgets
    everything within a few tokens would not show whether it was carried."""
    import math

    import mlx.core as mx

    if not key.endswith("dt_bias"):
        return value
    steps = mx.exp(mx.random.uniform(math.log(0.001), math.log(0.1), value.shape))
    return steps + mx.log(-mx.expm1(-steps))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_weights(definition: TinySpec, path: Path) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    config = definition.config
    mx.random.seed(definition.seed)
    if definition.vision:
        from mlx_vlm.utils import get_model_and_args, update_module_configs

        arch, _ = get_model_and_args(config=config)
        args = update_module_configs(
            arch.ModelConfig.from_dict(config), arch, config, ["text", "vision"]
        )
        embed = "language_model.model.embed_tokens.weight"
    else:
        arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        args = arch.ModelArgs.from_dict(config)
        embed = "model.embed_tokens.weight"
    model = arch.Model(args)
    dtype = getattr(mx, definition.dtype)
    params = {k: _initial(k, v).astype(dtype) for k, v in tree_flatten(model.parameters())}
    projection = "multi_modal_projector.mm_input_projection_weight"
    if projection in params:  # (mlx-vlm starts it at ones: every image would look alike)
        rows = params[projection].shape[0]
        params[projection] = mx.random.normal(params[projection].shape, dtype) * rows**-0.5
    if definition.embed_scale != 1.0:
        params[embed] = params[embed] * definition.embed_scale
    if definition.eos_scale != 1.0:
        eos = definition.chat.id_of(definition.chat.eos)
        params[embed][eos] = params[embed][eos] * definition.eos_scale
    if definition.weight_bits is not None:
        model.update(tree_unflatten(list(params.items())))
        nn.quantize(model, **config["quantization"])
        params = dict(tree_flatten(model.parameters()))
    if config.get("tie_word_embeddings"):  # mlx_lm's sanitize drops the head when absent
        params = {k: v for k, v in params.items() if "lm_head." not in k}
    for value in params.values():  # one at a time: a quantized model's float weights never
        mx.eval(value)  # all exist at once
    mx.save_safetensors(str(path), params, metadata={"format": "mlx"})
