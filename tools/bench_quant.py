"""Benchmark of the CPU int8 matrix products (``kvserve.cpu.quant_ops``) against
float32 BLAS, at the default model's shapes (SmolLM2-135M).

For each layer shape ``[N out, K in]`` and each row count M it times
``x @ W.T`` (NumPy's BLAS sgemm), ``linear_int8`` and ``linear_w8a8`` (each
including its allocations, and for w8a8 the activation quantization and the
epilogue), and prints a Markdown table of medians in microseconds plus the
speed-ups over BLAS. The last rows add up one decode/prefill step of the
whole model: 30 layers of q, k, v, o, gate_up, down, and the LM head.

Usage:  python tools/bench_quant.py [--threads 2] [--rows 1 8 32 128]
        [--repeats 30] [--min-time 0.2]

Both thread pools (BLAS via threadpoolctl, Numba via ``num_threads``) get
``--threads``. The load average is printed before and after: on a shared
machine, compare runs taken at similar loads only.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import os
import platform
import statistics
import time
from typing import Callable

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from kvserve.cpu.quant_ops import linear_int8, linear_w8a8, quantize_weight

#: SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 kv heads of 64.
LAYERS = {
    "q_proj / o_proj": (576, 576),
    "k_proj / v_proj": (192, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
#: Products of each shape in one forward step: 30 decoder layers, one head.
PER_STEP = {"q_proj / o_proj": 60, "k_proj / v_proj": 60, "gate_up": 30, "down": 30,
            "lm_head": 1}
METHODS = ("blas_f32", "int8", "w8a8")


def median_seconds(fn: Callable[[], object], repeats: int, min_time: float) -> float:
    """Median wall time of ``fn()`` over at least ``repeats`` calls and
    ``min_time`` seconds, after one warm-up call."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_time:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_shape(n: int, k: int, m: int, threads: int, repeats: int,
                min_time: float) -> dict[str, float]:
    """Median seconds of each method for x float32[m, k] and W [n, k]."""
    rng = np.random.default_rng(0)
    wq, scales = quantize_weight(rng.standard_normal((n, k), dtype=np.float32))
    w = wq.astype(np.float32) * scales[:, None]
    x = rng.standard_normal((m, k), dtype=np.float32)
    calls = {
        "blas_f32": lambda: x @ w.T,
        "int8": lambda: linear_int8(x, wq, scales, num_threads=threads),
        "w8a8": lambda: linear_w8a8(x, wq, scales, num_threads=threads),
    }
    return {name: median_seconds(fn, repeats, min_time) for name, fn in calls.items()}


def row(layer: str, shape: str, m: int, t: dict[str, float]) -> str:
    us = " | ".join(f"{t[name] * 1e6:,.0f}" for name in METHODS)
    gains = " | ".join(f"{t['blas_f32'] / t[name]:.2f}x" for name in METHODS[1:])
    return f"| {layer} | {shape} | {m} | {us} | {gains} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--min-time", type=float, default=0.2,
                        help="least seconds of timed calls per cell")
    args = parser.parse_args()

    load_before = os.getloadavg()
    print(f"# int8 products vs float32 BLAS: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, {args.threads} threads, numba {numba.__version__}, "
          f"numpy {np.__version__}")
    print(f"load average before: {' '.join(f'{v:.2f}' for v in load_before)}\n")
    print("| layer | N x K | M | f32 BLAS us | int8 us | w8a8 us | int8 speed-up | "
          "w8a8 speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    step = {m: dict.fromkeys(METHODS, 0.0) for m in args.rows}
    with threadpool_limits(args.threads):
        for layer, (n, k) in LAYERS.items():
            for m in args.rows:
                t = bench_shape(n, k, m, args.threads, args.repeats, args.min_time)
                print(row(layer, f"{n} x {k}", m, t), flush=True)
                for name in METHODS:
                    step[m][name] += PER_STEP[layer] * t[name]
    for m in args.rows:
        print(row("**model step**", "30 layers + head", m, step[m]))
    load_after = os.getloadavg()
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in load_after)}")


if __name__ == "__main__":
    main()
