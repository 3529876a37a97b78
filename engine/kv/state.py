"""Recurrent state in a cache file: a hybrid model's ``ArraysCache`` layers (conv and SSM /
gated-delta state, ``agentkv.engine.batch.state``) stored beside the keys and values, in the model's
precision whatever the file's ``kv_bits`` (a state is a few arrays whatever the history's
length, and every later token reads all of it: quantizing it would drift with every turn).

A state layer's layout: ``type`` "ArraysCache", ``offset`` (the tokens it has consumed: the
cache's), ``max_size`` / ``keep`` / ``group_size`` null, ``dtype`` (its first array's) and
``states``, per entry of the ``ArraysCache`` either null (an entry the layer never set) or
``[dtype, shape]``. Its tensors are ``layers.{i}.state.{e}`` (bfloat16 as its uint16 bits). A
paged file keeps them in its tail (``start`` = ``offset``): a state is had only whole, at the
point it was saved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from agentkv.engine.batch.state import state_row

STATE_TYPE = "ArraysCache"
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def state_names(i: int, layout: dict[str, Any]) -> list[str]:
    """The tensor names of state layer ``i`` as ``layout`` lists its entries."""
    return [f"layers.{i}.state.{e}" for e, entry in enumerate(layout["states"]) if entry]


def encode_state(layer: Any, i: int, num_tokens: int) -> tuple[dict[str, mx.array], dict]:
    """State layer ``i``'s tensors (lazy) and layout.

    Raises:
        ValueError: it holds no state, or an array of a dtype a file cannot store.
    """
    if all(x is None for x in layer.cache):
        raise ValueError(f"layer {i} holds no recurrent state")
    tensors, entries = {}, []
    for e, x in enumerate(layer.cache):
        if x is None:
            entries.append(None)
            continue
        name = next((n for n, d in _DTYPES.items() if d == x.dtype), None)
        if name is None:
            raise ValueError(f"layer {i} state {e} has dtype {x.dtype}; need {list(_DTYPES)}")
        entries.append([name, list(x.shape)])
        tensors[f"layers.{i}.state.{e}"] = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
    layout = {
        "type": STATE_TYPE,
        "offset": num_tokens,
        "max_size": None,
        "keep": None,
        "group_size": None,
        "dtype": next(e for e in entries if e)[0],
        "states": entries,
    }
    return tensors, layout


def state_layout_problem(layout: dict[str, Any]) -> str | None:
    """What is wrong with a state layer's layout, or None."""
    entries = layout.get("states")
    if type(layout.get("offset")) is not int or layout["offset"] < 1:
        return "offset must be a positive integer"
    if not isinstance(entries, list) or not entries or not any(entries):
        return "a state layer needs 'states': a non-empty list of [dtype, shape] or null"
    for entry in entries:
        if entry is None:
            continue
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and entry[0] in _DTYPES
            and isinstance(entry[1], list)
            and entry[1]
            and all(type(n) is int and n >= 1 for n in entry[1])
            and entry[1][0] == 1
        ):
            return f"state entry {str(entry)[:80]} is not [dtype, shape of one row]"
    if any(layout.get(f) is not None for f in ("max_size", "keep", "group_size")):
        return "a state layer has no max_size, keep or group_size"
    return None


def decode_state(get: Callable[[str], Any], i: int, layout: dict[str, Any]) -> ArraysCache:
    """State layer ``i`` read back: ``get(name)`` gives a stored tensor (numpy or MLX).

    Raises:
        KeyError / ValueError: a tensor missing or not the shape and dtype the layout lists.
    """
    entries = []
    for e, entry in enumerate(layout["states"]):
        if entry is None:
            entries.append(None)
            continue
        dtype, shape = _DTYPES[entry[0]], tuple(entry[1])
        x = mx.array(get(f"layers.{i}.state.{e}"))
        stored = mx.uint16 if dtype == mx.bfloat16 else dtype
        if x.dtype != stored or tuple(x.shape) != shape:
            raise ValueError(
                f"tensor layers.{i}.state.{e} is {x.dtype}{list(x.shape)}, expected "
                f"{stored}{list(shape)}"
            )
        entries.append(x.view(mx.bfloat16) if dtype == mx.bfloat16 else x)
    return state_row(entries)
