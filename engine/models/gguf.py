"""GGUF files → mlx-lm model directories (``agentkv import-gguf``).

``mx.load`` reads GGUF but not its k-quants (Q4_K, Q6_K, ...); the ``gguf`` package dequantizes
every type in numpy. The output is a plain mlx-lm directory: ``config.json``,
``generation_config.json``, ``model.safetensors`` (float32 by default: CPU matmuls in bfloat16 or
float16 do not use BLAS), ``tokenizer.json`` (see :mod:`engine.models.gguf_tokenizer`),
``tokenizer_config.json`` with the chat template, ``special_tokens_map.json``.

llama.cpp's converter changes two things that are undone here: it stores Gemma's RMSNorm weights
with the ``+1`` already added (mlx-lm adds it again at run time), and it permutes Llama's Q and K
projections for its rotary embedding layout. The directory appears atomically: everything is
written to a temporary sibling that is renamed into place, so a failed import leaves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelNotFoundError, OutputDirNotEmptyError, UnsupportedModelError
from engine.models.gguf_tokenizer import GGUFVocab, build_tokenizer
from engine.models.tiny import LLAMA_TEMPLATE

DTYPES = ("float32", "float16", "bfloat16")
IMPORTER_VERSION = 1  # bump when the output of an import changes
MARKER_FILE = "agentkv_gguf.json"

# The chat template of Gemma 3 instruction-tuned checkpoints (a system message joins the first
# user turn), without its check that roles alternate, so any transcript renders.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# For a Llama-family file without a template whose vocabulary has no chat tokens.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\n\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
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


def import_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    progress: bool = True,
) -> Path:
    """Convert a GGUF file into an mlx-lm model directory.

    Args:
        gguf_path: A Gemma 3 (``gemma3``) or Llama-family (``llama``) GGUF file, any quant type.
        out_dir: Directory to create (it may exist if empty); written atomically.
        dtype: Weight dtype of ``model.safetensors``: float32 (default), float16 or bfloat16.
        progress: Show a progress bar on stderr while dequantizing.

    Returns:
        The absolute model directory.

    Raises:
        ModelNotFoundError: ``gguf_path`` is not a file.
        OutputDirNotEmptyError: ``out_dir`` exists and is not an empty directory.
        UnsupportedModelError: An architecture, tokenizer or tensor this importer cannot convert.
        ValueError: ``dtype`` is not one of float32, float16, bfloat16.
    """
    import gguf

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    source = Path(gguf_path).expanduser()
    if not source.is_file():
        raise ModelNotFoundError(f"GGUF file {os.fspath(gguf_path)!r} not found")
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise OutputDirNotEmptyError(
            f"{out} exists and is not an empty directory; choose a new or empty --out directory"
        )
    try:
        reader = gguf.GGUFReader(source)
    except (ValueError, OSError) as exc:
        raise UnsupportedModelError(f"{source} is not a readable GGUF file: {exc}") from exc
    arch = reader.fields["general.architecture"].contents()
    family = FAMILIES.get(arch)
    if family is None:
        raise UnsupportedModelError(
            f"{source.name}: GGUF architecture {arch!r} is not supported; import-gguf converts "
            f"{', '.join(repr(a) for a in FAMILIES)} (Gemma 3 and Llama-family models)"
        )
    meta = GGUFMetadata(dict(reader.fields), arch)
    config = family.config(meta)
    vocab = _vocab(meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        weights = _weights(reader, family, config, progress)
        config |= _special_ids(vocab) | {"torch_dtype": dtype}
        config["tie_word_embeddings"] = "lm_head.weight" not in weights
        _write_weights(weights, tmp / "model.safetensors", dtype)
        del weights
        _write_tokenizer(
            vocab,
            meta.get("tokenizer.chat_template") or family.chat_template(vocab.tokens),
            config,
            tmp,
        )
        _write_json(tmp / "config.json", config)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        _write_json(tmp / "generation_config.json", generation)
        _write_json(
            tmp / MARKER_FILE,
            {"source": source.name, "dtype": dtype, "importer_version": IMPORTER_VERSION},
        )
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        if out.exists():
            out.rmdir()  # empty, checked above; os.replace needs the name free or an empty dir
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _vocab(meta: GGUFMetadata) -> GGUFVocab:
    tokens = meta.require("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    model = meta.require("tokenizer.ggml.model")
    return GGUFVocab(
        model=model,
        pre=meta.get("tokenizer.ggml.pre"),
        tokens=list(tokens),
        token_types=list(types),
        scores=list(scores),
        merges=list(meta.get("tokenizer.ggml.merges") or []),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
        pad_id=meta.get("tokenizer.ggml.padding_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", model == "llama")),
    )


def _special_ids(vocab: GGUFVocab) -> dict[str, Any]:
    """bos/eos/pad ids for config.json; every end-of-turn token also stops generation."""
    stops = {vocab.eos_id} if vocab.eos_id is not None else set()
    for token in ("<end_of_turn>", "<|eot_id|>", "<|end_of_text|>", "<|im_end|>"):
        with contextlib.suppress(ValueError):
            stops.add(vocab.tokens.index(token))
    return {
        "bos_token_id": vocab.bos_id,
        "eos_token_id": sorted(stops),
        "pad_token_id": vocab.pad_id,
    }


def _weights(
    reader: Any, family: Family, config: dict[str, Any], progress: bool
) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, renamed and transformed for mlx-lm."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    weights = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
        name = _hf_name(tensor.name, family)
        if name is None:
            continue
        x = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weights[name] = family.transform(tensor.name, x, config)
    if "model.embed_tokens.weight" not in weights:
        raise UnsupportedModelError("the GGUF file has no token_embd.weight tensor")
    return weights


def _hf_name(name: str, family: Family) -> str | None:
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


def _write_weights(weights: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    import mlx.core as mx

    target = getattr(mx, dtype)
    arrays = {name: mx.array(x).astype(target) for name, x in weights.items()}
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})


def _write_tokenizer(vocab: GGUFVocab, template: str, config: dict[str, Any], out: Path) -> None:
    build_tokenizer(vocab).save(str(out / "tokenizer.json"))
    special = {
        f"{role}_token": vocab.token(token_id)
        for role, token_id in (
            ("bos", vocab.bos_id),
            ("eos", vocab.eos_id),
            ("unk", vocab.unk_id),
            ("pad", vocab.pad_id),
        )
        if token_id is not None
    }
    _write_json(out / "special_tokens_map.json", special)
    tokenizer_config = {
        **special,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": template,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
