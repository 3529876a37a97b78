"""agentkv's public API: persistent LLM agents over a continuously batched MLX engine."""

import engine  # noqa: F401  (first: preloads OpenBLAS before anything imports mlx.core)
