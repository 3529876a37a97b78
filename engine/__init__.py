"""Model loading, the generation thread and KV codecs. Everything that touches MLX lives here."""

from agentkv.models import blas

blas.load_before_mlx()  # the system OpenBLAS, loaded when mlx is first imported (Linux)
