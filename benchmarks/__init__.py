"""Reproducible benchmarks. Run each as ``python -m benchmarks.<name>``.

Importing ``engine`` here, before any benchmark module imports ``mlx.core``, preloads OpenBLAS
(import sorting puts third-party ``mlx`` above first-party ``engine`` inside the modules).
"""

import agentkv.engine  # noqa: F401
