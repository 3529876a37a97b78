"""Shared fixtures. `engine` is imported first so OpenBLAS is preloaded before mlx.core."""

import engine  # noqa: F401  (side effect: OpenBLAS preload, must precede any mlx import)
