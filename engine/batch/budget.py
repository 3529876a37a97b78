"""The default KV memory budget."""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from agentkv.engine.errors import KVBudgetError

BUDGET_SHARE = 0.6  # of the device memory left once the weights are loaded


def budget_bytes(given: int | None, layout: Any) -> int:
    """The batch's KV budget: ``given`` (``EngineConfig.kv_budget_bytes``), else the default;
    refused when the smallest turn of the model (``layout``: its ``KVLayout``) cannot fit."""
    budget = given or default_budget_bytes()
    smallest = layout.reservation(2, overhang=1)
    if budget < smallest:
        raise KVBudgetError(
            f"kv_budget_bytes={budget} is smaller than the smallest turn of this model "
            f"needs ({smallest} bytes for one prompt token and one generated token); "
            "raise kv_budget_bytes",
            needed_bytes=smallest,
            budget_bytes=budget,
        )
    return budget


def default_budget_bytes() -> int:
    """A share of the memory left after the weights: Apple's recommended working set, CUDA's
    free memory, else the host's available RAM."""
    info = mx.device_info()
    if "max_recommended_working_set_size" in info:
        left = int(info["max_recommended_working_set_size"]) - mx.get_active_memory()
    elif "free_memory" in info:
        left = int(info["free_memory"])
    else:
        left = _available_ram()
    return max(0, int(left * BUDGET_SHARE))


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
