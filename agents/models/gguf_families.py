"""The GGUF architectures import-gguf converts, and how each maps onto an mlx-lm model type:
config fields, tensor names, and the tensor changes llama.cpp's converter made that are undone.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentkv.engine.errors import UnsupportedModelError
from agentkv.models.chat_formats import GEMMA3_TEMPLATE, LLAMA_TEMPLATE, PLAIN_TEMPLATE

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(slots=True, frozen=True)
class Family:
    """How one GGUF architecture maps onto an mlx-lm model type.

    Attributes:
        model_type: mlx-lm's ``model_type``.
        tensor_names: GGUF tensor name (after ``blk.N.``) -> Hugging Face name.
        config: Builds ``config.json`` from the file's metadata.
        transform: Undoes llama.cpp's changes to one tensor: ``(gguf_name, array, config)``.
        chat_template: The template to use when the file carries none, given its tokens.
    """

    model_type: str
    tensor_names: dict[str, str]
    config: Callable[[GGUFMetadata], dict[str, Any]]
    transform: Callable[[str, np.ndarray, dict[str, Any]], np.ndarray]
    chat_template: Callable[[list[str]], str]


@dataclass(slots=True, frozen=True)
class GGUFMetadata:
    """Typed access to a GGUF file's key-value fields."""

    fields: dict[str, Any]
    arch: str

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``; a leading ``.`` means ``<arch>.key``."""
        name = f"{self.arch}{key}" if key.startswith(".") else key
        field = self.fields.get(name)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            name = f"{self.arch}{key}" if key.startswith(".") else key
            raise UnsupportedModelError(f"the GGUF file has no {name!r} field")
        return value


def _common_config(meta: GGUFMetadata) -> dict[str, Any]:
    heads = meta.require(".attention.head_count")
    hidden = meta.require(".embedding_length")
    return {
        "hidden_size": hidden,
        "intermediate_size": meta.require(".feed_forward_length"),
        "num_hidden_layers": meta.require(".block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(".attention.head_count_kv", heads),
        "head_dim": meta.get(".attention.key_length", hidden // heads),
        "max_position_embeddings": meta.require(".context_length"),
        "rms_norm_eps": meta.require(".attention.layer_norm_rms_epsilon"),
        "vocab_size": len(meta.require("tokenizer.ggml.tokens")),
    }


def _gemma3_config(meta: GGUFMetadata) -> dict[str, Any]:
    config = _common_config(meta)
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 62-layer 27B model.
    scalar = config["head_dim"]
    if config["num_hidden_layers"] == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    rope_scaling = None
    if meta.get(".rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": meta.require(".rope.scaling.factor")}
    return config | {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "rope_theta": meta.get(".rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": 10_000.0,  # fixed in llama.cpp and transformers alike
        "query_pre_attn_scalar": scalar,
        "sliding_window": meta.require(".attention.sliding_window"),
        "sliding_window_pattern": 6,  # every 6th layer is global, as llama.cpp assumes
        "rope_scaling": rope_scaling,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _gemma3_transform(name: str, x: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    # Gemma computes x * (1 + w); llama.cpp stores 1 + w, mlx-lm expects w.
    return x - 1.0 if name.endswith("norm.weight") else x


def _llama_config(meta: GGUFMetadata) -> dict[str, Any]:
    config = _common_config(meta)
    rope_dims = meta.get(".rope.dimension_count", config["head_dim"])
    if rope_dims != config["head_dim"]:
        raise UnsupportedModelError(
            f"rope over {rope_dims} of {config['head_dim']} head dimensions is not supported"
        )
    if meta.get(".rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(
            f"rope scaling {meta.get('.rope.scaling.type')!r} is not supported"
        )
    return config | {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": meta.get(".rope.freq_base", 10_000.0),
        "attention_bias": False,
        "mlp_bias": False,
    }


def _llama_transform(name: str, x: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    # llama.cpp interleaves each head's rotary halves; restore the Hugging Face layout.
    if name.endswith("attn_q.weight"):
        return unpermute_rope(x, config["num_attention_heads"])
    if name.endswith("attn_k.weight"):
        return unpermute_rope(x, config["num_key_value_heads"])
    return x


def unpermute_rope(x: np.ndarray, heads: int) -> np.ndarray:
    """Invert llama.cpp's ``permute`` of a Q or K projection (rows grouped by ``heads``)."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


_SHARED_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
}
FAMILIES = {
    "gemma3": Family(
        model_type="gemma3_text",
        tensor_names=_SHARED_NAMES
        | {
            "attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight",
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
        config=_gemma3_config,
        transform=_gemma3_transform,
        chat_template=lambda tokens: GEMMA3_TEMPLATE,
    ),
    "llama": Family(
        model_type="llama",
        tensor_names=_SHARED_NAMES | {"ffn_norm.weight": "post_attention_layernorm.weight"},
        config=_llama_config,
        transform=_llama_transform,
        chat_template=lambda tokens: (
            LLAMA_TEMPLATE if "<|start_header_id|>" in tokens else PLAIN_TEMPLATE
        ),
    ),
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str, family: Family) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: a tensor mlx-lm does not take)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    if name == "rope_freqs.weight":
        raise UnsupportedModelError(
            "the GGUF file carries rope_freqs (Llama 3.1-style rope scaling), which import-gguf "
            "does not convert"
        )
    block = _BLOCK.match(name)
    if block is None or block.group(2) not in family.tensor_names:
        raise UnsupportedModelError(
            f"tensor {name!r} has no {family.model_type} counterpart; is this a variant of the "
            "architecture that import-gguf does not know?"
        )
    return f"model.layers.{block.group(1)}.{family.tensor_names[block.group(2)]}"
