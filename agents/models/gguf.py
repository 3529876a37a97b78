"""GGUF files → mlx-lm model directories (``agentkv import-gguf``).

``mx.load`` reads GGUF but not its k-quants (Q4_K, Q6_K, ...); the ``gguf`` package dequantizes
every type in numpy. The output is a plain mlx-lm directory: ``config.json``,
``generation_config.json``, ``model.safetensors`` (float32 by default: CPU matmuls in bfloat16 or
float16 do not use BLAS), ``tokenizer.json`` (see :mod:`agentkv.models.gguf_tokenizer`),
``tokenizer_config.json`` with the chat template, ``special_tokens_map.json``.

llama.cpp's converter changes two things that :mod:`agentkv.models.gguf_families` undoes: it
stores Gemma's RMSNorm weights with the ``+1`` already added (mlx-lm adds it again at run time),
and it permutes Llama's Q and K projections for its rotary embedding layout. The directory
appears atomically: everything is written to a temporary sibling that is renamed into place, so
a failed import leaves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from agentkv.engine.errors import ModelNotFoundError, OutputDirNotEmptyError, UnsupportedModelError
from agentkv.models.gguf_families import FAMILIES, Family, GGUFMetadata, hf_name
from agentkv.models.gguf_tokenizer import GGUFVocab, build_tokenizer

DTYPES = ("float32", "float16", "bfloat16")
IMPORTER_VERSION = 1  # bump when the output of an import changes
MARKER_FILE = "agentkv_gguf.json"


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
        name = hf_name(tensor.name, family)
        if name is None:
            continue
        x = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weights[name] = family.transform(tensor.name, x, config)
    if "model.embed_tokens.weight" not in weights:
        raise UnsupportedModelError("the GGUF file has no token_embd.weight tensor")
    return weights


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
