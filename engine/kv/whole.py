"""A whole cache in one file (format 1): mlx-lm cache layers to an EncodedCache and back.

Both directions run on the generation thread (every MLX op lives there). An :class:`EncodedCache`
holds only C-contiguous numpy arrays that own their memory, and strings, so a writer thread can
hand it to ``safetensors.numpy.save_file`` without touching MLX.

Format (``format_version`` 1). Tensors: ``tokens`` (int32, 1-D) and, per layer ``i``, either
``layers.{i}.keys`` / ``layers.{i}.values`` (unquantized: the original dtype, bfloat16 as a
uint16 view) or ``layers.{i}.keys.q|.scales|.biases`` and the same for ``values`` (uint32
words, float16 scales and biases: ``mx.quantize`` of the float16 cast, at 8 bits keys rotated
first; at 4 bits, keys per channel and values rotated first, as ``agentkv.engine.kv.quant``
describes). Metadata:
``format_version``, ``kv_bits`` ("none", "8", "4"), ``group_size`` ("none" or the preferred
group size) and ``layers``, a JSON list with each layer's ``type``, ``offset``, ``max_size``,
``keep``, ``dtype``, ``keys_shape``, ``values_shape`` and ``group_size`` (and where they
apply, at 8 bits ``rotated_keys``, at 4 bits ``channel_keys`` with ``key_group_size`` and
``key_bits``, and ``rotated_values``). Keys and values are stored in temporal order, only the
positions in use.

q4 keys in groups of their own (``key_group_size``, 16 positions) came after q4 keys in groups
of the layer's ``group_size``, and five-bit keys over 32 positions (``key_bits``) after those:
a file of any of them is read by this version (a layout without a field has what came before
it); a reader from before either field refuses the newer q4 files (their key scales or key
words are not the shape it expects) instead of misreading them.

Each layer is quantized with the first group size that divides its head dimension, trying the
preferred one, then 64, 32, 128 (what ``mx.quantize`` accepts). A layer that none divides (head
dim 72, say) is stored unquantized, with a logged warning: saving never fails on a head size.
Its layout says ``"group_size": null``; a layout without the field (older files) uses the file's.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from agentkv.engine.batch.state import row_arrays
from agentkv.engine.config import group_size_for
from agentkv.engine.errors import CacheFormatError
from agentkv.engine.kv.encoded import FORMAT_VERSION, GROUP_SIZES, EncodedCache, tensor
from agentkv.engine.kv.layouts import (
    DTYPES,
    STORED,
    group_of,
    parse_layouts,
    part_bits,
    part_group,
    temporal_layer,
)
from agentkv.engine.kv.quant import (
    expand_layer_part,
    quant_scheme,
    quantized_parts,
    stored_kv,
)
from agentkv.engine.kv.state import STATE_TYPE, decode_state, encode_state, state_names
from agentkv.engine.mlxlm import set_write_index
from agentkv.engine.models.caches import is_state
from agentkv.engine.request import PromptCache
from agentkv.engine.scheme import FLAGS, layer_scheme


def encode_cache(
    cache: PromptCache, kv_bits: int | None, group_size: int | None = None
) -> EncodedCache:
    """Copy a prompt cache into host memory, quantizing keys and values if asked.

    Args:
        cache: Per-layer ``KVCache`` / ``RotatingKVCache`` and the tokens they hold.
        kv_bits: None to store keys and values bit-exactly, or 8 / 4 to quantize them.
        group_size: Preferred quantization group size along the head dimension (ignored when
            unquantized; None: the precision's own, ``agentkv.engine.config.GROUP_SIZE_BY_BITS``); a
            layer it does not divide uses :func:`choose_group_size`'s choice.

    Returns:
        The encoded cache.

    Raises:
        ValueError: Empty cache, unsupported layer type or dtype, offsets that disagree with
            the token count, kv_bits other than None / 8 / 4, or a group size mx.quantize
            does not know.
    """
    if kv_bits not in (None, 4, 8):
        raise ValueError(f"kv_bits must be None, 8 or 4, got {kv_bits!r}")
    group_size = group_size_for(kv_bits, group_size)
    if kv_bits is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"group_size {group_size} is not supported; use one of {GROUP_SIZES}")
    if cache.num_tokens == 0 or not cache.layers:
        raise ValueError("cannot encode an empty cache (no tokens or no layers)")
    pending: dict[str, mx.array] = {}
    layouts = []
    for i, layer in enumerate(cache.layers):
        if is_state(layer):
            state, layout = encode_state(layer, i, cache.num_tokens)
            pending |= state
            layouts.append(layout)
            continue
        keys, values, layout = temporal_layer(layer, i, cache.num_tokens, cache.packing)
        dims = layout["keys_shape"][3], layout["values_shape"][3]
        decided = layer_scheme(kv_bits, group_size, dims, keep=layout["keep"])
        layer_group = None if decided is None else decided.group_size
        scheme = quant_scheme(decided)
        layouts.append(layout | {"group_size": layer_group} | scheme)
        start = layout["offset"] - keys.shape[2]
        pending |= stored_kv(i, keys, values, kv_bits, layer_group, cache.packing, start, scheme)
    mx.eval(*pending.values())
    # np.array copies (C order): the result owns its memory, so no MLX buffer is freed elsewhere.
    tensors = {name: np.array(x, order="C") for name, x in pending.items()}
    tensors["tokens"] = np.array(cache.tokens, dtype=np.int32)
    metadata = {
        "format_version": str(FORMAT_VERSION),
        "kv_bits": "none" if kv_bits is None else str(kv_bits),
        "group_size": "none" if kv_bits is None else str(group_size),
        "layers": json.dumps(layouts, separators=(",", ":")),
    }
    return EncodedCache(tensors, metadata)


def decode_cache(encoded: EncodedCache) -> PromptCache:
    """Rebuild the prompt cache (fresh ``KVCache`` / ``RotatingKVCache`` layers, evaluated).

    Quantized keys and values are dequantized and cast back to their original dtype, so the
    result merges into a running batch like any other cache.

    Raises:
        CacheFormatError: Unsupported format_version, bad metadata, a missing, unexpected or
            misshapen tensor, an unknown layer type, or a token count that is not the offset.
    """
    meta = encoded.metadata
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        raise CacheFormatError(
            f"unsupported format_version {version!r}; this agentkv reads version "
            f"{FORMAT_VERSION} (drop the cache file and let it be rebuilt)"
        )
    kv_bits, group_size = encoded.kv_bits, encoded.group_size
    if (kv_bits is None) != (group_size is None):
        raise CacheFormatError(f"kv_bits {kv_bits} and group_size {group_size} must both be set")
    tokens = tensor(encoded, "tokens", None, np.int32)
    if tokens.ndim != 1:
        raise CacheFormatError(f"tensor 'tokens' must be 1-D, got shape {tokens.shape}")
    layouts = parse_layouts(meta)
    expected = {"tokens"}
    for i, layout in enumerate(layouts):
        if layout["type"] == STATE_TYPE:
            expected |= set(state_names(i, layout))
            continue
        parts = [""] if group_of(encoded, layout) is None else [".q", ".scales", ".biases"]
        expected |= {f"layers.{i}.{kv}{part}" for kv in ("keys", "values") for part in parts}
    if extra := sorted(set(encoded.tensors) - expected):
        raise CacheFormatError(f"unexpected tensors {extra} for this layout")
    layers = []
    for i, layout in enumerate(layouts):
        if layout["offset"] != tokens.shape[0]:
            raise CacheFormatError(
                f"layer {i} holds {layout['offset']} positions but tensor 'tokens' has "
                f"{tokens.shape[0]}"
            )
        if layout["type"] == STATE_TYPE:
            try:
                layers.append(decode_state(encoded.tensors.__getitem__, i, layout))
            except KeyError as exc:
                raise CacheFormatError(f"tensor {exc} is missing") from exc
            except ValueError as exc:
                raise CacheFormatError(str(exc)) from exc
            continue
        if layout["type"] == "KVCache":
            layer = KVCache()
        else:
            layer = RotatingKVCache(max_size=layout["max_size"], keep=layout["keep"])
            set_write_index(layer, layout["keys_shape"][2])  # temporal order: after the newest
        group_size = group_of(encoded, layout)
        layer.keys, layer.values = (
            _read_kv(encoded, i, kv, layout, group_size) for kv in ("keys", "values")
        )
        layer.offset = layout["offset"]
        layers.append(layer)
    mx.eval(*(x for layer in layers for x in row_arrays(layer)))
    return PromptCache(layers, tokens.tolist())


def _read_kv(
    encoded: EncodedCache, i: int, kind: str, layout: dict, group_size: int | None
) -> mx.array:
    name, shape, dtype = f"layers.{i}.{kind}", layout[f"{kind}_shape"], layout["dtype"]
    if group_size is None:
        x = mx.array(tensor(encoded, name, shape, STORED[dtype]))
        return x.view(mx.bfloat16) if dtype == "bfloat16" else x
    group, bits = part_group(layout, kind, group_size), part_bits(layout, kind, encoded.kv_bits)
    parts = quantized_parts(encoded, name, shape, group, bits)
    q, scales, biases = (mx.array(x) for x in parts)
    if any(layout.get(flag, False) for flag in FLAGS):
        got = {".q": q, ".scales": scales, ".biases": biases}
        x = expand_layer_part(got, layout, kind, encoded.kv_bits, group_size, fused=False)
    else:
        x = mx.dequantize(q, scales, biases, group_size=group_size, bits=encoded.kv_bits)
    return x.astype(DTYPES[dtype])
