"""Benchmark of the CPU paged-attention kernel (SmolLM2-135M shapes).

Prints, for decode (S sequences x 1 new token, context ``--ctx``) and prefill
(one sequence, ``--prefill`` new tokens, no earlier context):
the first call (JIT compile, or load from Numba's on-disk cache) and the
median / min of ``--iters`` timed calls, per layer, plus the max relative error
against the dense float64 reference for the first sequence.

Usage:  python tools/bench_kernels.py [--seqs 32] [--ctx 512] [--prefill 512]
        [--iters 20] [--tile-q 16] [--threads N] [--kv-cache-dtype auto|int8]

``--kv-cache-dtype int8`` times the same batches on the int8 cache
(``kvserve.model.kv_quant``); the reference is then computed on the
dequantized cache.

The first-call time is the compile time only on a cold cache
(``NUMBA_CACHE_DIR`` / ``src/cpu/__pycache__``); run twice to see both.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import statistics
import time

import numba
import numpy as np

from kvserve.cpu.ops import CpuOps
from kvserve.model import kv_quant
from kvserve.testing.reference import reference_attention

NH, NKV, HD, BS = 9, 3, 64, 16  # SmolLM2-135M attention shapes, block size 16


def make_batch(rng: np.random.Generator, ctxs: list[int], n_new: list[int], ops: CpuOps,
               kv_cache_dtype: str = "auto"):
    """Random paged batch; blocks shuffled across the cache (of ``kv_cache_dtype``)."""
    blocks_per = [(c + BS - 1) // BS for c in ctxs]
    num_blocks = sum(blocks_per) + 4
    perm = rng.permutation(num_blocks).astype(np.int32)
    cache = ops.allocate_kv_cache(num_blocks, BS, NKV, HD, kv_cache_dtype=kv_cache_dtype)
    values = rng.standard_normal(cache.shape[:4] + (HD,), dtype=np.float32)
    cache[...] = kv_quant.quantize(values) if cache.dtype == np.int8 else values
    bt = np.full((len(ctxs), max(blocks_per)), -1, np.int32)
    i = 0
    for s, nb in enumerate(blocks_per):
        bt[s, :nb] = perm[i:i + nb]
        i += nb
    qsl = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]), NH, HD), dtype=np.float32)
    return q, cache, bt, np.asarray(ctxs, np.int32), qsl


def gather(cache: np.ndarray, bt_row: np.ndarray, L: int):
    blocks = cache[bt_row[: (L + BS - 1) // BS]]  # [nb, 2, BS, nkv, hd]
    if blocks.dtype == np.int8:
        blocks = kv_quant.dequantize(blocks)
    k = blocks[:, 0].reshape(-1, NKV, HD)[:L]
    v = blocks[:, 1].reshape(-1, NKV, HD)[:L]
    return k, v


def bench(name: str, ops: CpuOps, batch, iters: int) -> None:
    q, cache, bt, sl, qsl = batch
    scale = HD ** -0.5
    t = time.perf_counter()
    out = ops.paged_attention(q, cache, bt, sl, qsl, scale)
    first = time.perf_counter() - t
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        ops.paged_attention(q, cache, bt, sl, qsl, scale)
        times.append(time.perf_counter() - t)
    k, v = gather(cache, bt[0], int(sl[0]))
    n0 = int(qsl[1] - qsl[0])
    ref = reference_attention(q[:n0], k, v, scale)
    err = np.abs(out[:n0] - ref).max() / np.abs(ref).max()
    print(f"{name:<34s} first call {first * 1e3:9.1f} ms   median {statistics.median(times) * 1e3:8.3f} ms"
          f"   min {min(times) * 1e3:8.3f} ms   max rel err {err:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tile-q", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto")
    args = ap.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
    ops = CpuOps() if args.tile_q is None else CpuOps(tile_q=args.tile_q)
    rng = np.random.default_rng(0)
    print(f"numba {numba.__version__}, threading layer threads={numba.get_num_threads()}, "
          f"tile_q={ops.tile_q}, heads {NH}/{NKV}, head_dim {HD}, block {BS}, "
          f"kv cache {args.kv_cache_dtype}")
    decode = make_batch(rng, [args.ctx] * args.seqs, [1] * args.seqs, ops, args.kv_cache_dtype)
    bench(f"decode S={args.seqs} ctx={args.ctx}", ops, decode, args.iters)
    prefill = make_batch(rng, [args.prefill], [args.prefill], ops, args.kv_cache_dtype)
    bench(f"prefill 1 seq x {args.prefill} new", ops, prefill, args.iters)
    print(f"(threading layer: {numba.threading_layer()})")


if __name__ == "__main__":
    main()
