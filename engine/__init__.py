"""Model loading, the generation thread and KV codecs. Everything that touches MLX lives here."""

from engine import blas

blas.load()  # must run before the first `import mlx.core` anywhere in the process
