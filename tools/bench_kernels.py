"""Benchmark of the CPU paged-attention kernel (SmolLM2-135M shapes).

Prints, for decode (S sequences x 1 new token, context ``--ctx``) and prefill
(one sequence, ``--prefill`` new tokens, no earlier context):
the first call (JIT compile, or load from Numba's on-disk cache) and the
median / min of ``--iters`` timed calls, per layer, plus the max relative error
against the dense float64 reference for the first sequence.

Usage:  python tools/bench_kernels.py [--seqs 32] [--ctx 512] [--prefill 512]
        [--verify 9] [--layers 30] [--gemv-rows 1 2 4 9 16] [--iters 20] [--tile-q 16]
        [--threads N] [--kv-cache-dtype auto|int8] [--json out.json]

``--layers N`` times the decode batch over N caches in turn, as a model's
layers are (a working set beyond the last-level cache: the blocks come from
memory); ``--verify N`` adds a speculative verification's attention (one sequence, N
new tokens at the end of ``--ctx``); ``--gemv-rows`` times the float32
product ``kernels.f32_gemv_range`` on one thread for those row counts at the
default model's gate/up shape (1,536 x 576), in GMAC/s.

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
import json
import os
import statistics
import time
from pathlib import Path

import numba
import numpy as np

from kvserve.bench.replay import machine_info
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


def bench(name: str, ops: CpuOps, batch, iters: int) -> dict:
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
    return {"name": name, "first_call_ms": first * 1e3,
            "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "max_rel_err": float(err)}


def bench_layers(args, ops: CpuOps, rng: np.random.Generator) -> dict:
    """The decode batch over ``args.layers`` caches in turn: median and best
    time per layer (ms)."""
    batches = [make_batch(rng, [args.ctx] * args.seqs, [1] * args.seqs, ops, args.kv_cache_dtype)
               for _ in range(args.layers)]
    scale = HD ** -0.5
    for q, cache, bt, sl, qsl in batches:
        ops.paged_attention(q, cache, bt, sl, qsl, scale)
    times = []
    for _ in range(max(3, args.iters // 4)):
        t = time.perf_counter()
        for q, cache, bt, sl, qsl in batches:
            ops.paged_attention(q, cache, bt, sl, qsl, scale)
        times.append((time.perf_counter() - t) / args.layers)
    name = f"decode S={args.seqs} ctx={args.ctx} over {args.layers} caches"
    print(f"{name:<34s} per layer: median {statistics.median(times) * 1e3:8.3f} ms"
          f"   min {min(times) * 1e3:8.3f} ms")
    return {"name": name, "median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3}


def bench_gemv(rows: list[int], iters: int, n: int = 1536, k: int = 576) -> list[dict]:
    """One thread's ``f32_gemv_range`` over all ``n`` channels of a float32
    [n, k] weight for each row count: median and best GMAC/s, and the
    largest error against float64 relative to the largest output."""
    from kvserve.cpu.kernels import f32_gemv_range
    rng = np.random.default_rng(1)
    w = rng.standard_normal((n, k), dtype=np.float32)
    results = []
    for m in rows:
        x = rng.standard_normal((m, k), dtype=np.float32)
        out = np.empty((m, n), np.float32)
        f32_gemv_range(x, w, out, 0, n)
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        err = float(np.abs(out - ref).max() / np.abs(ref).max())
        reps = max(5, int(2e7 // (m * n * k)))
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            for _ in range(reps):
                f32_gemv_range(x, w, out, 0, n)
            times.append((time.perf_counter() - t) / reps)
        macs = m * n * k
        row = {"rows": m, "median_us": statistics.median(times) * 1e6,
               "gmac_s_median": macs / statistics.median(times) / 1e9,
               "gmac_s_best": macs / min(times) / 1e9, "max_rel_err": err}
        print(f"f32_gemv_range {m:3d} x {k} x {n}: median {row['median_us']:8.1f} us  "
              f"{row['gmac_s_median']:6.2f} GMAC/s (best {row['gmac_s_best']:6.2f})  "
              f"rel err {err:.1e}")
        results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tile-q", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto")
    ap.add_argument("--verify", type=int, default=0,
                    help="also a verification step: one sequence, this many new tokens")
    ap.add_argument("--layers", type=int, default=1,
                    help="decode over this many caches in turn (per-layer time reported)")
    ap.add_argument("--gemv-rows", type=int, nargs="*", default=[],
                    help="time f32_gemv_range on one thread at these row counts")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
    ops = CpuOps() if args.tile_q is None else CpuOps(tile_q=args.tile_q)
    rng = np.random.default_rng(0)
    print(f"numba {numba.__version__}, threading layer threads={numba.get_num_threads()}, "
          f"tile_q={ops.tile_q}, heads {NH}/{NKV}, head_dim {HD}, block {BS}, "
          f"kv cache {args.kv_cache_dtype}")
    loadavg_before = list(os.getloadavg())
    decode = make_batch(rng, [args.ctx] * args.seqs, [1] * args.seqs, ops, args.kv_cache_dtype)
    results = [bench(f"decode S={args.seqs} ctx={args.ctx}", ops, decode, args.iters)]
    if args.layers > 1:
        results.append(bench_layers(args, ops, rng))
    if args.verify:
        verify = make_batch(rng, [args.ctx], [args.verify], ops, args.kv_cache_dtype)
        results.append(bench(f"verify 1 seq x {args.verify} new ctx={args.ctx}", ops, verify,
                             args.iters))
    prefill = make_batch(rng, [args.prefill], [args.prefill], ops, args.kv_cache_dtype)
    results.append(bench(f"prefill 1 seq x {args.prefill} new", ops, prefill, args.iters))
    gemv = bench_gemv(args.gemv_rows, args.iters) if args.gemv_rows else []
    print(f"(threading layer: {numba.threading_layer()})")
    if args.json:
        record = {"argv": vars(args), "numba": numba.__version__,
                  "threads": numba.get_num_threads(), "threading_layer": numba.threading_layer(),
                  "machine": machine_info(), "loadavg_before": loadavg_before,
                  "loadavg_after": list(os.getloadavg()), "attention": results, "gemv": gemv}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
