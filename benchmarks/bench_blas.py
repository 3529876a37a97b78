"""fp32 matmul GFLOP/s with and without the OpenBLAS preload, each in a fresh interpreter.

python -m benchmarks.bench_blas [--n 1024] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROBE = """
import json, sys, time
import agentkv.engine
import mlx.core as mx
from agentkv.models import blas
n, iters = int(sys.argv[1]), int(sys.argv[2])
a = mx.random.normal((n, n)); b = mx.random.normal((n, n)); mx.eval(a, b, a @ b)
t = time.perf_counter()
for _ in range(iters):
    mx.eval(a @ b)
dt = time.perf_counter() - t
print(json.dumps({"blas": blas.loaded_library(), "gflops": 2 * n**3 * iters / dt / 1e9}))
"""


def measure(n: int, iters: int, opt_out: bool) -> dict:
    env = dict(os.environ)
    env.pop("AGENTKV_NO_OPENBLAS", None)
    if opt_out:
        env["AGENTKV_NO_OPENBLAS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(n), str(iters)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    bundled = measure(args.n, max(2, args.iters // 10), opt_out=True)
    openblas = measure(args.n, args.iters, opt_out=False)
    print(f"fp32 matmul {args.n}x{args.n}")
    print(f"  bundled BLAS : {bundled['gflops']:8.1f} GFLOP/s")
    print(f"  OpenBLAS     : {openblas['gflops']:8.1f} GFLOP/s  ({openblas['blas']})")
    if openblas["blas"]:
        print(f"  speed-up     : {openblas['gflops'] / bundled['gflops']:8.1f}x")


if __name__ == "__main__":
    main()
