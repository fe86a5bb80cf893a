#!/usr/bin/env python3
"""One prepared check of the CUDA backend on a GPU: it cannot pass what it did not measure.

Run it from the repository root on a machine with one NVIDIA GPU (written for
an H200), with ``NUMBA_ENABLE_CUDASIM`` unset or ``0``::

    python tools/gpu_check.py --out gpu_check.json

Sections, run in this order (most important first), each in its own
try/except; after each one ``--out`` (JSON) and ``<out stem>.md`` (the
Markdown summary) are rewritten (a temporary file, then ``os.replace``), so a
run cut by a time limit leaves what it measured, and the section it was in
shows ``"status": "running"``:

1. ``environment``: GPU name, memory, compute capability, CUDA runtime and
   driver (CuPy), NVVM and libdevice as Numba finds them, nvidia-smi's line,
   the numba / cupy / numpy versions, then the engine's start-up probe
   (``kvserve.cuda.probe``: a kernel compiled through NVVM and launched on
   CuPy's stream, a cuBLAS product).  Fails when CuPy or Numba sees no GPU,
   when the probe fails (its one line names what to install), and under
   Numba's CUDA simulator unless ``--allow-simulator``.  Fail fast: when it
   has not passed, every later section is skipped with its reason.
2. ``copy_bandwidth``: a device-to-device copy of 1 GiB (``cupy.copyto``),
   median of 20 CUDA-event timings after 3 warm-ups; GB/s = bytes read +
   written / time (10**9 bytes).  The HBM roof of the sections below.
3. ``golden``: the model served by ``AsyncEngine`` (``backend="cuda"``,
   float16, CUDA graphs: the GPU defaults) on every golden prompt, greedy,
   judged by the rule of ``shared/golden/README.md`` and ``tests/e2e``:
   prompt ids equal; each golden first-step top-5 logit within the tolerance
   of ours (among our top 20); output tokens equal, except a divergence at a
   position where our own top-2 logits differ by less than the tolerance.
   The tolerance is 1e-3 at float32 (the golden README's) and
   ``--f16-logit-tol`` (0.25) at float16: an assumption, not a derivation: a
   float16 unit roundoff is 8192 times float32's, and logits of about 25
   carry the rounding of 30 layers' float16 residual stream (a random walk
   of about 60 roundings of 2**-11: ~0.1).  Each case's largest difference
   and each divergence's gap are in the JSON, to judge that tolerance by.
   Fails too, on a GPU, when the engine captured no CUDA graphs (its
   ``runner.graphs``; the engine log's ``cuda_graphs`` line says why).
4. ``decode_step``: one request (32 prompt tokens, 128 greedy output tokens,
   ignore_eos) through the same engine; over its decode steps (medians):
   the worker's step time (``StepStats.seconds``) and phases (``StepTimes``:
   the figures of ``kvserve:step_phase_seconds``), the interval between two
   consecutive steps' ends (what a client sees), and the HBM floor of a step
   (below); Numba kernel launches and host->device / device->host copies per
   decode step (``CudaOps.counters``: cuBLAS calls and CUDA-graph replays go
   through CuPy and are not counted; the difference of two readings taken k
   steps apart, over k: with steps in flight both readings are equally
   ahead, so a run's last two steps, after which nothing is, are left out).
   Fails when the counters or the floor are missing.
5. ``throughput``: decode tokens/s at 1, 32 and 128 concurrent requests
   (same requests): N / the mean interval between consecutive decode steps
   of all N (the engine's cadence), and as the client streams saw it over
   the window where all N decode; with each, the per-step figures of
   ``decode_step``.
6. ``graphs_vs_eager``: ``throughput`` again on an engine with
   ``EngineConfig(enforce_eager=True)`` (vLLM's ``--enforce-eager``: no CUDA
   graphs), side by side with the graphs figures: tokens/s, step interval,
   launches per step, and the ratios.  Fails when ``EngineConfig`` has no
   ``enforce_eager``, the graphs figures are missing, or that engine
   captured no graphs.
7. ``prefill``: tokens/s of a fresh 2,000-token prompt (prompt tokens / time
   to its first token, median of 3), with the prefill step's own time.  It
   runs on the engine already up (the eager one after section 6: CUDA graphs
   are captured for decode batch sizes only; the JSON names it).
8. ``kv_int8``: the int8 KV cache (``--kv-cache-dtype int8``,
   ``kvserve.model.kv_quant``), float16 (and float32 for split-K decode):
   ``write_kv`` stores ``kv_quant.quantize``'s bytes exactly (strided K/V
   views, skipped slots); ``paged_attention`` (the forms of ``kernels``,
   with and without a window; every unreadable slot a NaN-scale vector)
   and the fused decode (``rope_kv_attention`` of a planned decode step,
   split-K) against float64 attention over ``kv_quant.dequantize`` of the
   same cache (the ``kernels`` bounds); the fused decode timed over an
   int8 and a float cache at the same contexts (ratio and KV bytes read);
   then, with a model, the largest ``throughput`` batch on an engine with
   ``kv_cache_dtype="int8"`` (CUDA graphs captured over int8 caches)
   against the float16 engine: decode step time, tok/s, KV-cache tokens.
   Fails when a case fails, the model is missing (the kernel figures are
   kept), or the int8 engine captured no graphs.
9. ``kernels``: every ``CudaOps`` kernel (embedding, rms_norm,
   fused_add_rms_norm, rotary_embedding, silu_and_mul, gelu_tanh_and_mul,
   write_kv, paged_attention as decode / split-K decode / prefill over a
   cached prefix / mixed batch at GQA ratios 1, 3 and 8, each form also
   with a sliding window (``window=``, a quarter of the longest context;
   the cache slots before each sequence's window are NaN, so a kernel that
   reads them fails), linear through CuPy's cuBLAS,
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
   2**24, so exact in float32 before scaling.  Timing: CUDA events around
   each call, median of 20 after warm-up (the wrapper's host work and
   Numba's launch overhead included, as the engine pays them); GB/s =
   minimum bytes read + written / time, and its fraction of section 2's copy.

HBM floor of a decode step = (W + sum over its sequences of ctx x b) / C, where
W = ``model.weights_nbytes`` (every weight on the device, a tied LM head once),
ctx = the tokens each sequence's new token attends to (``start_position +
num_tokens`` of the ``SchedulerOutput``), b = ``plan.bytes_per_token`` (K and V
of one token in every layer: 2 x layers x kv_heads x head_dim x dtype bytes)
and C = section 2's bandwidth: the bytes a step must read from HBM at the rate
of the best copy (its writes, one K/V row a token, left out).

Statuses: ``passed``, ``failed`` (with the reason), ``skipped`` (past
``--budget-s``, not in ``--sections``, or a model section under the simulator
without ``--e2e``) and ``error`` (the exception's first line; the traceback is
in the JSON).  ``"ok"`` is true, and the exit status 0, only when every section
ran and passed; a skip counts as a failure unless named in ``--allow-skip``
(recorded in the JSON).  A missing model or golden file fails the sections
that need them with one line saying how to bring it: the default model is
used only when already converted in ``$KVSERVE_CACHE`` (``~/.cache/kvserve``)
or assembled by ``--assemble-gguf``; this script never downloads.

Time: planned for under 6 minutes on an H200 (an estimate; not yet timed on
one): ``--budget-s`` (330) is checked between sections (one that would start
after it is skipped) and between kernel groups, and an engine call is cut 60 s
past it.  Engine log lines go to ``<out>.log``.

Bringing the default model to a GPU machine that has no network and takes at
most 64 MiB of files per command (this project's device machine, whose
``python3`` has NumPy, Numba, CuPy, safetensors and tokenizers but not
structlog, gguf or llguidance).  Here, from the repository root (``results/``
and ``.whl/`` are git-ignored; nothing is committed)::

    .venv/bin/python tools/gpu_check.py --split-gguf --parts-dir results/gpu-parts
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl structlog gguf llguidance

``--split-gguf`` cuts the default model's GGUF (98 MB, in the folder of
``ensure_default_model()``) into parts of at most ``--part-mib`` (48) MiB,
copies the golden file beside them, and writes ``manifest.json`` (SHA-256 and
size of each); it prints the two carry lists.  Then two consecutive device
commands, the second within 30 s of the first (the machine stays warm that
long; a fresh one has lost part 1):

1. carry ``results/gpu-parts/manifest.json`` and ``results/gpu-parts/<gguf>.part1of2``;
   command ``ls -l results/gpu-parts``
2. carry ``results/gpu-parts/manifest.json``, ``results/gpu-parts/<gguf>.part2of2``,
   ``results/gpu-parts/smollm2_greedy.json`` and ``.whl``; command (timeout 480 s)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \\
      && mkdir -p /tmp/kv && ln -sfn "$PWD/src" /tmp/kv/kvserve \\
      && export PYTHONPATH=/tmp/site:/tmp/kv PYTHONUNBUFFERED=1 KVSERVE_CACHE=/tmp/kvcache \\
      && python3 tools/gpu_check.py --assemble-gguf results/gpu-parts \\
      && python3 tools/gpu_check.py --golden results/gpu-parts --out $OUT/gpu_check.json

``--assemble-gguf DIR`` checks every part's size and SHA-256 against the
manifest (a missing or corrupted part is refused, naming it), joins them,
checks the whole file's SHA-256, and converts it with kvserve's own converter
(``kvserve.model.default_model.convert_gguf``) into the default model's cache
folder (or ``--model PATH``), built beside it and renamed into place.

``--quick``: small shapes and few repetitions.  Under Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, a CPU-only machine) the script always runs quick;
timings are labelled "simulator (not meaningful)"; the model sections are
skipped unless ``--e2e`` (every CUDA thread is then a Python thread: tens of
minutes for the default model, about 2 for the tiny checkpoint of
``tests/model/tiny_llama.py`` through ``--model``).
``--backend cpu`` runs the model sections on the CPU backend (float32, strict
golden rule): a check of this script, not of the GPU.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import numpy as np

    import kvserve  # noqa: F401 - the package must be importable before any section runs
except ModuleNotFoundError as exc:  # run outside the venv
    sys.exit(f"{exc}: run it with the project's venv: .venv/bin/python {sys.argv[0]} (make "
             "install creates it); on a GPU machine without one, see this file's docstring "
             "(PYTHONPATH with a kvserve -> src link and the carried wheels)")

REPO = Path(__file__).resolve().parents[1]
GOLDEN_FILE = "smollm2_greedy.json"
F32_REL = 1e-5
HALF_ULP_F16 = 2.0**-11
LOGIT_TOL = 1e-3  # shared/golden/README.md and tests/e2e (float32)
F16_LOGIT_TOL = 0.25  # see the module docstring, section 3
GOLDEN_TOP = 20  # logprobs asked of each golden step (EngineConfig.max_logprobs)
EOS_ID = 2
RMS_EPS = 1e-5
ROPE_THETA = 10000.0
SIMULATOR_SWITCH_INTERVAL_S = 2e-4  # as tests/cuda/conftest.py: barriers poll the GIL
#: Seconds an engine start and one request may take (GPU, simulator).
START_TIMEOUT_S = {"gpu": 300.0, "simulator": 3600.0}
REQUEST_TIMEOUT_S = {"gpu": 180.0, "simulator": 3600.0}
DEFAULT_BUDGET_S = {"gpu": 330.0, "simulator": 3600.0}
#: Files the engine reads from a checkpoint folder (as ``ensure_default_model`` checks).
CHECKPOINT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
MANIFEST = "manifest.json"
MANIFEST_SCHEMA = "kvserve.gpu_check.parts/1"
#: Largest part (MiB): with the ~3 MiB working tree and a few MiB of wheels
#: it stays under the device machine's 64 MiB a command.
DEFAULT_PART_MIB = 48
STATUSES = ("passed", "failed", "skipped", "error")
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
    """Every size of the kernel and engine sections."""

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


def _timeout(table: dict[str, float]) -> float:
    return table["simulator" if simulator_enabled() else "gpu"]


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


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


def environment_section(check: Check) -> dict:
    env = environment()
    if env["simulator"]:
        if not check.args.allow_simulator:
            raise SectionFailed("Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1): no GPU is "
                                "checked; --allow-simulator to check this script", env)
        return env
    if "gpu" not in env or env.get("numba_sees_gpu") is not True:
        cupy = env["cupy"] if "not importable" in env["cupy"] else f"sees {env.get('gpu', 'none')}"
        raise SectionFailed(f"no GPU: CuPy {cupy}; Numba sees one: "
                            f"{env.get('numba_sees_gpu', 'not asked')}", env)
    # the engine's start-up probe: a Numba kernel compiled through NVVM and
    # launched on CuPy's stream, a cuBLAS product, both read back; its one
    # line names what to install (NumPy too new for numba-cuda, no NVVM, a
    # driver older than the PTX, no cuBLAS)
    from kvserve.cuda.probe import run_probe

    probe = run_probe()
    env["probe"] = dataclasses.asdict(probe)
    if not probe.ok:
        raise SectionFailed(f"the CUDA probe failed: {probe.describe()}", env)
    return env


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


def copy_section(check: Check) -> dict:
    from kvserve.cuda.ops import array_module

    s = check.sizes
    timer = Timer(cupy_module(), s.warmup, s.repeats)
    copy = {"timing": timer.label, **copy_bandwidth(array_module(), timer, s.copy_bytes)}
    free_device_memory()
    if not (math.isfinite(copy["GB_s"]) and copy["GB_s"] > 0):
        raise SectionFailed(f"copy bandwidth {copy['GB_s']} GB/s", copy)
    check.copy_gbs = copy["GB_s"]
    return copy


def free_device_memory() -> None:
    gc.collect()
    cupy = cupy_module() if not simulator_enabled() else None
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()


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
                  dense: list[tuple[np.ndarray, np.ndarray]], scale: float, window: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Causal float64 attention of each new token over its sequence's context
    (with ``window`` > 0, the token at position p over keys p - window < j <= p).

    q: [T, nh, hd]; seqs[s] = (cached, new); dense[s] = (K, V) [ctx, nkv, hd].
    Query head h reads KV head h // (nh // nkv).  Returns (out, w @ |V|), both
    [T, nh, hd]; rows owned by no sequence are zero.  One GEMM per KV head over
    contiguous copies (a batched matmul over strided K took 10x as long).
    """
    T, nh, hd = q.shape
    out, terms = np.zeros((T, nh, hd)), np.zeros((T, nh, hd))
    for s, (cached, new) in enumerate(seqs):
        k, v = dense[s]
        nkv = k.shape[1]
        group, a = nh // nkv, int(qsl[s])
        qs = f64(q[a:a + new]).reshape(new, nkv, group, hd)
        rows = cached + np.arange(new).repeat(group)  # position of each (token, head) row
        keys = np.arange(cached + new)[None, :]
        hidden = keys > rows[:, None]  # [new * group, ctx]
        if window:
            hidden |= keys <= rows[:, None] - window
        for g in range(nkv):
            kg, vg = np.ascontiguousarray(k[:, g]), np.ascontiguousarray(v[:, g])  # [ctx, hd]
            logits = qs[:, g].reshape(new * group, hd) @ kg.T * scale
            logits[hidden] = -np.inf
            w = np.exp(logits - logits.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[a:a + new, g * group:(g + 1) * group] = (w @ vg).reshape(new, group, hd)
            terms[a:a + new, g * group:(g + 1) * group] = (w @ np.abs(vg)).reshape(new, group, hd)
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

    def gelu_tanh_and_mul():
        x = randn(rng, (T, 2 * m.intermediate), dtype, 2.0)
        dx = to(x)
        a, b = f64(x)[:, :m.intermediate], f64(x)[:, m.intermediate:]
        ref = 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))) * b
        return (lambda: ops.gelu_tanh_and_mul(dx),
                lambda out: (rel_err(host(out), ref), float_bound(dtype), 1.0,
                             "PyTorch gelu(approximate='tanh')"),
                x.nbytes * 3 // 2)

    bench.measure("embedding", dtype, f"{tag} V={vocab}", embedding)
    bench.measure("rms_norm", dtype, tag, rms_norm)
    bench.measure("fused_add_rms_norm", dtype, tag, fused_add_rms_norm)
    bench.measure("rotary_embedding", dtype, f"{tag} heads={m.heads}/{m.kv_heads}x{m.head_dim}",
                  rotary)
    bench.measure("silu_and_mul", dtype, f"{m.name} T={T} I={m.intermediate}", silu_and_mul)
    if hasattr(ops, "gelu_tanh_and_mul"):
        bench.measure("gelu_tanh_and_mul", dtype, f"{m.name} T={T} I={m.intermediate}",
                      gelu_tanh_and_mul)
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
                    seqs: list[tuple[int, int]], pad: int, bs: int, window: int = 0) -> tuple:
    q, cache, bt, sl, qsl, dense = paged_batch(rng, seqs, m.heads, m.kv_heads, m.head_dim, bs,
                                               dtype, pad)
    if window:  # the slots before each sequence's window: never to be read
        for s, (c, _) in enumerate(seqs):
            pos = np.arange(max(0, c + 1 - window))
            cache[bt[s, pos // bs], :, pos % bs] = np.nan
    scale = m.head_dim ** -0.5
    ref, terms = ref_attention(q, seqs, qsl, dense, scale, window)
    kap = kappa(terms, ref)
    del dense
    to = ops.to_device
    args = (to(q), to(cache), to(bt), to(sl), to(qsl), scale)
    item = np.dtype(dtype).itemsize
    nbytes = 2 * q.nbytes + sum(c + n for c, n in seqs) * 2 * m.kv_heads * m.head_dim * item

    def check(out):
        out = ops.to_numpy(out)
        note = f"{len(seqs)} seqs, contexts {min(sl)}-{max(sl)}" + (
            f", window {window}" if window else "")
        if pad and np.any(out[int(qsl[-1]):] != 0):
            return math.inf, float_bound(dtype, kap), kap, note + "; padding rows NOT zero"
        return rel_err(out, ref), float_bound(dtype, kap), kap, note + (
            f"; {pad} padding rows zero" if pad else "")
    windowed = {"window": window} if window else {}
    return lambda: ops.paged_attention(*args, **windowed), check, nbytes


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


def kernel_section(check: Check) -> dict:
    """Every CudaOps kernel in both dtypes, groups started until the deadline."""
    from kvserve.cuda.ops import CudaOps, array_module

    if check.engines is not None:
        check.engines.close_current()  # its KV cache and weights leave the device
    s = check.sizes
    timer = Timer(cupy_module(), s.warmup, s.repeats)
    copy_gbs = check.copy_gbs or copy_bandwidth(array_module(), timer, s.copy_bytes)["GB_s"]
    bench = KernelBench(timer, copy_gbs, np.random.default_rng(check.args.seed))
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
            if time.monotonic() > check.deadline:
                skipped.append(f"{name} {np.dtype(dtype).name}")
                continue
            run()
        free_device_memory()
    data = {"timing": timer.label, "copy_GB_s": copy_gbs, "partition_size": s.partition,
            "prefill_tile_q": s.tile_q, "rows": bench.rows, "skipped_for_time": skipped}
    failed = [f"{r['kernel']} {r['dtype']} {r['shape']}" for r in bench.rows if not r["pass"]]
    if failed:
        raise SectionFailed(f"{len(failed)} of {len(bench.rows)} kernel cases failed: "
                            f"{'; '.join(failed[:3])}" + (" ..." if len(failed) > 3 else ""), data)
    if skipped:
        raise SectionFailed(f"{len(skipped)} kernel groups not run (time budget): "
                            f"{', '.join(skipped)}", data, status="skipped")
    return data


def attention_group(bench: KernelBench, ops: Any, dtype: Any, m: Shape, s: Sizes) -> None:
    ratio = m.heads // m.kv_heads
    window = max(1, s.max_ctx // 4)  # sliding window (Gemma 3's local layers)
    for form, (seqs, pad) in attention_forms(bench.rng, s).items():
        tokens, longest = sum(n for _, n in seqs) + pad, max(c + n for c, n in seqs)
        for w in (0, window):
            bench.measure(f"paged_attention {form} gqa{ratio}" + (f" window={w}" if w else ""),
                          dtype,
                          f"{m.name} {m.heads}/{m.kv_heads}x{m.head_dim} T={tokens} "
                          f"ctx<={longest}",
                          lambda seqs=seqs, pad=pad, w=w: attention_setup(
                              bench.rng, ops, dtype, m, seqs, pad, s.block_size, w))


# --------------------------------------------------------------------------- sections


class SectionFailed(Exception):
    """A section's verdict other than passed, with what it measured so far.

    ``status``: ``failed`` or ``skipped``; ``reason``: one line; ``data``: the
    section's figures (kept in the JSON)."""

    def __init__(self, reason: str, data: dict | None = None, status: str = "failed") -> None:
        super().__init__(reason)
        self.reason, self.data, self.status = reason, data or {}, status


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class Report:
    """The results: rewritten to ``path`` (JSON) and ``<stem>.md`` after each change."""

    def __init__(self, path: Path, header: dict, allowed_skips: list[str]) -> None:
        self.path, self.md_path = path, path.with_suffix(".md")
        self.t0 = time.monotonic()
        self.data: dict[str, Any] = {**header, "allowed_skips": allowed_skips, "sections": {},
                                     "summary": {}}

    @property
    def sections(self) -> dict[str, dict]:
        return self.data["sections"]

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def write(self, finished: bool = False) -> None:
        if finished:
            self.data["finished"] = _now_iso()
        self.data["summary"] = summary(self.sections, self.data["allowed_skips"], finished)
        _write_atomic(self.path, json.dumps(_finite(self.data), indent=1, default=str) + "\n")
        _write_atomic(self.md_path, markdown(self.data) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _finite(obj: Any) -> Any:
    """JSON-safe: inf / NaN floats as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def summary(sections: dict[str, dict], allowed: list[str], finished: bool) -> dict:
    """``ok`` only when the run finished and every section passed (or was an allowed skip)."""
    by_status: dict[str, list[str]] = {s: [] for s in (*STATUSES, "running")}
    for name, entry in sections.items():
        by_status.setdefault(entry["status"], []).append(name)
    not_allowed = [n for n in by_status["skipped"] if n not in allowed]
    complete = finished and set(sections) == {name for name, _ in SECTIONS}
    ok = complete and not (by_status["failed"] or by_status["error"] or by_status["running"]
                           or not_allowed)
    return {"ok": ok, "finished": finished, **by_status, "skipped_not_allowed": not_allowed}


@dataclass
class Check:
    """What the sections share: arguments, sizes, the deadline, the report, the engine."""

    args: argparse.Namespace
    sizes: Sizes
    deadline: float
    report: Report
    copy_gbs: float | None = None
    engines: Any = None  # Engines, once a model section asks for one

    def section_data(self, name: str) -> dict:
        return self.report.sections.get(name, {}).get("data", {})


def run_sections(check: Check, selected: list[str]) -> None:
    """Every section in order; the report is written when each starts and ends.
    Fail fast: once ``environment`` has not passed (no GPU, the probe's
    kernel or product failed), every later section is skipped with that
    reason, in the run's first seconds."""
    budget = check.args.budget_s
    for name, fn in SECTIONS:
        at = check.report.elapsed()
        first = check.report.sections.get(SECTIONS[0][0], {})
        if name not in selected:
            entry: dict[str, Any] = {"status": "skipped", "reason": "not selected (--sections)"}
        elif name != SECTIONS[0][0] and first.get("status") not in (None, "passed", "skipped"):
            entry = {"status": "skipped",
                     "reason": f"{SECTIONS[0][0]} {first['status']}: {first.get('reason')}"}
        elif time.monotonic() > check.deadline:
            entry = {"status": "skipped", "reason": f"time budget: would start at {at} s, "
                                                    f"past --budget-s {budget:g}"}
        else:
            entry = {"status": "running", "started": _now_iso(), "start_s": at}
        check.report.sections[name] = entry
        if entry["status"] == "running":
            check.report.write()
            print(f"== {name}", file=sys.stderr, flush=True)
            entry.update(_run_one(check, fn))
            entry.update(ended=_now_iso(), end_s=check.report.elapsed())
            entry["seconds"] = round(entry["end_s"] - entry["start_s"], 1)
        print(f"== {name}: {entry['status']}" + (f" ({entry['reason']})" if entry.get("reason")
                                                 else ""), file=sys.stderr, flush=True)
        check.report.write()


def _run_one(check: Check, fn: Callable[[Check], dict]) -> dict:
    try:
        return {"status": "passed", "data": fn(check)}
    except SectionFailed as verdict:
        return {"status": verdict.status, "reason": verdict.reason, "data": verdict.data}
    except Exception as exc:  # noqa: BLE001 - one section must not stop the others
        return {"status": "error", "reason": first_line(exc), "traceback": traceback.format_exc()}


# --------------------------------------------------------------------------- model and golden


def resolve_model(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(checkpoint folder, None) or (None, the one line saying how to bring it).

    ``--model PATH``, else the default model's cache folder, only if already
    there: nothing is downloaded (a GPU machine may have no network)."""
    from kvserve.model.default_model import DEFAULT_MODEL_NAME, cache_dir

    folder = Path(args.model) if args.model else cache_dir() / DEFAULT_MODEL_NAME
    missing = [name for name in CHECKPOINT_FILES if not (folder / name).is_file()]
    if not missing:
        return str(folder), None
    if args.model:
        return None, (f"model: {folder} is not a checkpoint folder (no {', '.join(missing)}); "
                      "pass --model PATH of one, or leave --model out for the default model")
    return None, (f"model: the default model is not in {folder} and this check never downloads "
                  "it: on a machine that has it run `python tools/gpu_check.py --split-gguf "
                  "--parts-dir results/gpu-parts`, bring the parts and run `python "
                  "tools/gpu_check.py --assemble-gguf results/gpu-parts` here (tools/README.md, "
                  "gpu_check.py), or pass --model PATH")


def find_golden(path: str | None) -> Path | None:
    """``GOLDEN_FILE`` in ``--golden`` (a file or folder), else ``$KVSERVE_GOLDEN``,
    ``shared/golden`` in or beside the repository; None when none has it."""
    folders = [Path(path)] if path else []
    if not path and os.environ.get("KVSERVE_GOLDEN"):
        folders.append(Path(os.environ["KVSERVE_GOLDEN"]))
    if not path:
        folders += [REPO / "shared" / "golden", REPO.parent / "shared" / "golden"]
    for folder in folders:
        file = folder if folder.is_file() else folder / GOLDEN_FILE
        if file.is_file():
            return file
    return None


# --------------------------------------------------------------------------- GGUF parts


class PartsError(RuntimeError):
    """Parts that cannot be joined: the message names each missing or corrupted one."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def split_file(path: Path, parts_dir: Path, part_bytes: int,
               extras: tuple[Path, ...] = ()) -> dict:
    """Cut ``path`` into equal parts of at most ``part_bytes`` bytes in ``parts_dir``
    (``<name>.part<i>of<n>``), copy ``extras`` beside them, and write
    ``manifest.json`` last (file name, bytes and SHA-256 of the whole, each part
    and each extra).  Returns the manifest."""
    size = path.stat().st_size
    count = max(1, -(-size // part_bytes))
    each = -(-size // count)
    parts_dir.mkdir(parents=True, exist_ok=True)
    whole, parts = hashlib.sha256(), []
    with open(path, "rb") as src:
        for i in range(count):
            name, digest, written = f"{path.name}.part{i + 1}of{count}", hashlib.sha256(), 0
            with open(parts_dir / name, "wb") as dst:
                while written < each and (block := src.read(min(1 << 20, each - written))):
                    dst.write(block)
                    digest.update(block)
                    whole.update(block)
                    written += len(block)
            parts.append({"name": name, "bytes": written, "sha256": digest.hexdigest()})
    copied = []
    for extra in extras:
        shutil.copyfile(extra, parts_dir / extra.name)
        copied.append({"name": extra.name, "bytes": extra.stat().st_size,
                       "sha256": sha256_file(extra)})
    manifest = {"schema": MANIFEST_SCHEMA, "file": path.name, "bytes": size,
                "sha256": whole.hexdigest(), "parts": parts, "extras": copied}
    _write_atomic(parts_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(parts_dir: Path) -> dict:
    try:
        manifest = json.loads((parts_dir / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PartsError(f"{parts_dir / MANIFEST} is missing: carry it with each part") from None
    if manifest.get("schema") != MANIFEST_SCHEMA:
        raise PartsError(f"{parts_dir / MANIFEST}: not a {MANIFEST_SCHEMA} manifest")
    names = [manifest["file"]] + [e["name"] for e in manifest["parts"] + manifest["extras"]]
    if any(Path(n).name != n or n in ("", ".", "..") for n in names):
        raise PartsError(f"{parts_dir / MANIFEST}: a file name with a folder in it")
    return manifest


def _file_problem(parts_dir: Path, entry: dict) -> str | None:
    """Why a manifest entry's file is unusable (missing, its size, its SHA-256), or None."""
    path, name = parts_dir / entry["name"], entry["name"]
    if not path.is_file():
        return f"{name} is missing"
    if path.stat().st_size != entry["bytes"]:
        return (f"{name} has {path.stat().st_size} bytes, the manifest {entry['bytes']} "
                "(an incomplete copy)")
    if sha256_file(path) != entry["sha256"]:
        return f"{name}: SHA-256 differs from the manifest (corrupted)"
    return None


def join_parts(parts_dir: Path, dest: Path) -> dict:
    """Check every part and extra of ``parts_dir``'s manifest (present, its size,
    its SHA-256), join the parts into ``dest`` and check the whole file's
    SHA-256.  Raises PartsError naming every missing or corrupted file; then
    ``dest`` is not written.  Returns the manifest."""
    manifest = read_manifest(parts_dir)
    problems = [p for e in manifest["parts"] + manifest["extras"]
                if (p := _file_problem(parts_dir, e))]
    if problems:
        raise PartsError(f"{parts_dir}: {'; '.join(problems)}: copy them again")
    tmp, whole = dest.with_name(f".{dest.name}.joining"), hashlib.sha256()
    with open(tmp, "wb") as out:
        for entry in manifest["parts"]:
            with open(parts_dir / entry["name"], "rb") as src:
                while block := src.read(1 << 20):
                    out.write(block)
                    whole.update(block)
    if whole.hexdigest() != manifest["sha256"]:
        tmp.unlink()
        raise PartsError(f"{parts_dir}: the joined {manifest['file']}: SHA-256 differs from "
                         "the manifest (a part changed while joining?)")
    os.replace(tmp, dest)
    return manifest


def assemble_gguf(parts_dir: Path, target: Path) -> Path:
    """Join and check the parts (``join_parts``), convert the GGUF with
    ``kvserve.model.default_model.convert_gguf`` into a folder beside
    ``target`` and rename it into place (the GGUF kept in it, as
    ``ensure_default_model`` does).  A complete ``target`` holding the same
    GGUF is left as it is; any other existing ``target`` but an empty folder
    is refused."""
    from kvserve.model.default_model import convert_gguf

    manifest = read_manifest(parts_dir)
    have = target / manifest["file"]
    if all((target / n).is_file() for n in CHECKPOINT_FILES):
        if have.is_file() and sha256_file(have) == manifest["sha256"]:
            print(f"{target} already holds this model", flush=True)
            return target
        raise PartsError(f"{target} holds another checkpoint: remove it or pass --model FOLDER")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise PartsError(f"{target} exists and is not a checkpoint: remove it or pass --model "
                         "FOLDER")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".assemble-", dir=target.parent) as tmp:
        gguf = Path(tmp) / manifest["file"]
        join_parts(parts_dir, gguf)
        out = Path(tmp) / "checkpoint"
        convert_gguf(gguf, out)
        os.rename(gguf, out / gguf.name)
        if target.exists():  # an empty folder
            target.rmdir()
        os.rename(out, target)
    for extra in manifest["extras"]:
        print(f"{parts_dir / extra['name']}: checked", flush=True)
    print(f"assembled {manifest['file']} ({manifest['bytes']:,} bytes, SHA-256 checked) and "
          f"converted it into {target}", flush=True)
    return target


def split_command(args: argparse.Namespace) -> int:
    """``--split-gguf [PATH] --parts-dir DIR``: the parts, the golden file and the carry lists."""
    if not args.parts_dir:
        sys.exit("--split-gguf needs --parts-dir DIR (e.g. results/gpu-parts: git-ignored)")
    source = Path(args.split_gguf) if args.split_gguf else None
    if source is None:  # on the machine with network: may fetch
        from kvserve.model.default_model import ensure_default_gguf, ensure_default_model

        source = ensure_default_gguf(ensure_default_model())
    elif source.is_dir():
        found = sorted(source.glob("*.gguf"))
        if len(found) != 1:
            sys.exit(f"{source}: {len(found)} .gguf files; name the one to split")
        source = found[0]
    golden = find_golden(args.golden)
    parts_dir = Path(args.parts_dir)
    manifest = split_file(source, parts_dir, int(args.part_mib * 2**20),
                          extras=(golden,) if golden else ())
    for part in manifest["parts"]:
        print(f"{parts_dir / part['name']}: {part['bytes'] / 2**20:.1f} MiB", flush=True)
    if golden is None:
        print(f"note: {GOLDEN_FILE} not found (--golden PATH): the golden section will fail")
    print("device commands, one part each, each within 30 s of the one before (the machine "
          "stays warm 30 s):")
    for i, part in enumerate(manifest["parts"]):
        carry = [str(parts_dir / MANIFEST), str(parts_dir / part["name"])]
        if i == len(manifest["parts"]) - 1:
            carry += [str(parts_dir / e["name"]) for e in manifest["extras"]] + [".whl"]
        print(f"  {i + 1}. carry {json.dumps(carry)}")
    print(f"  the last one runs: python3 tools/gpu_check.py --assemble-gguf {parts_dir} && "
          f"python3 tools/gpu_check.py --golden {parts_dir} --out $OUT/gpu_check.json "
          "(whole command: tools/README.md, gpu_check.py)")
    return 0


def assemble_command(args: argparse.Namespace) -> int:
    from kvserve.model.default_model import DEFAULT_MODEL_NAME, cache_dir

    target = Path(args.model) if args.model else cache_dir() / DEFAULT_MODEL_NAME
    try:
        assemble_gguf(Path(args.assemble_gguf), target)
    except PartsError as exc:
        print(f"assemble: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


# --------------------------------------------------------------------------- the engine


@dataclass
class StepRecord:
    """One step as the engine's observer saw it, with the CUDA ops' counters then."""

    step_id: int
    seconds: float  # the worker's span of the step
    end: float  # monotonic
    phases: dict[str, float]
    batch_size: int
    prefill_tokens: int
    kv_tokens: int  # tokens of K/V the step's attention reads
    counters: tuple[int, int, int] | None  # launches, h2d, d2h


COUNTER_FIELDS = ("launches", "h2d", "d2h")


class StepRecorder:
    """Keeps every step and the ops' counters read the moment it ended.

    The counters are read in the worker's thread right after the runner's
    ``execute`` (with async scheduling the next step may start before the
    stats actor hears of this one); the step's timings come from the stats
    actor's ``observer.on_step``, matched by step id."""

    def __init__(self, engine: Any) -> None:
        self.steps: list[StepRecord] = []
        self.ops = engine.core.backend.ops
        counters = getattr(self.ops, "counters", None)
        self.missing = [f"{type(self.ops).__name__}.counters.{f}" for f in COUNTER_FIELDS
                        if not isinstance(getattr(counters, f, None), int | np.integer)]
        self._counters: dict[int, tuple[int, int, int] | None] = {}
        runner = engine.core.runner
        execute = runner.execute

        def recording_execute(output: Any) -> Any:
            result = execute(output)
            self._counters[output.step_id] = self.read()
            return result
        runner.execute = recording_execute
        stats = getattr(engine, "stats", None)
        observer = stats.observer if stats is not None else engine.observer
        original = observer.on_step

        def on_step(output: Any, start: float, end: float, times: Any = None) -> Any:
            step = original(output, start, end, times)
            self.steps.append(StepRecord(
                output.step_id, step.seconds, end, step.times.as_dict(), step.batch_size,
                step.num_prefill_tokens,
                sum(r.start_position + r.num_tokens for r in output.scheduled),
                self._counters.pop(output.step_id, None)))
            return step
        observer.on_step = on_step

    def read(self) -> tuple[int, int, int] | None:
        if self.missing:
            return None
        counters = self.ops.counters
        return tuple(int(getattr(counters, f)) for f in COUNTER_FIELDS)

    def reset_counters(self) -> None:
        if not self.missing and callable(getattr(self.ops, "reset_counters", None)):
            self.ops.reset_counters()


@dataclass
class Served:
    """A started engine with what the sections read of it."""

    engine: Any
    recorder: StepRecorder
    info: dict
    dtype: str
    eager: bool | None  # None: EngineConfig has no enforce_eager
    kv_cache_dtype: str = "auto"


def _has_enforce_eager() -> bool:
    from kvserve.config import EngineConfig

    return "enforce_eager" in {f.name for f in dataclasses.fields(EngineConfig)}


def engine_config(model: str, args: argparse.Namespace, dtype: str, eager: bool,
                  s: Sizes, kv_cache_dtype: str = "auto") -> Any:
    """EngineConfig of one engine; tolerates a config without the newer
    fields (``kv_cache_dtype`` is passed only when not ``auto``)."""
    from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig

    kv = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    try:
        cache = CacheConfig(gpu_memory_utilization=args.gpu_memory_utilization, **kv)
    except TypeError:
        if kv:
            raise SectionFailed("engine API missing: CacheConfig.kv_cache_dtype") from None
        cache = CacheConfig()
    scheduler = SchedulerConfig(max_num_seqs=max(s.decode_batches),
                                max_num_batched_tokens=max(s.step_budget, s.prefill_tokens))
    kwargs = dict(model=model, backend=args.backend, dtype=dtype, cache=cache,
                  scheduler=scheduler, logprobs_mode="raw_logits", max_logprobs=GOLDEN_TOP)
    if _has_enforce_eager():
        kwargs["enforce_eager"] = eager
    return EngineConfig(**kwargs)


class Engines:
    """The model served by ``AsyncEngine``, one engine at a time, on one event
    loop that outlives the sections (an engine belongs to its loop).  A start
    that failed is not tried again: later sections fail with its reason."""

    def __init__(self, check: Check, model: str) -> None:
        from kvserve.observability.log import configure_logging

        self.check, self.model = check, model
        self.loop = asyncio.new_event_loop()
        self.current: Served | None = None
        self.failed: dict[tuple[str, bool], str] = {}
        log_path = check.report.path.with_name(check.report.path.name + ".log")
        self.log_file = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - open until exit
        configure_logging("json", "info", stream=self.log_file)

    def run(self, coro: Any) -> Any:
        """``coro`` on the engines' loop, cut 60 s past the budget (a hung
        request must not carry the run far past its plan)."""
        left = max(60.0, self.check.deadline - time.monotonic() + 60.0)
        t0 = time.monotonic()
        try:
            return self.loop.run_until_complete(asyncio.wait_for(coro, left))
        except TimeoutError:
            if time.monotonic() - t0 < left - 1:
                raise  # an inner timeout (an engine start, one request)
            raise SectionFailed(f"cut after {left:.0f} s, 60 s past --budget-s") from None

    def get(self, dtype: str, eager: bool, any_eager: bool = False,
            kv_cache_dtype: str = "auto") -> Served:
        """The engine of ``dtype`` with (``eager``) or without CUDA graphs
        and a ``kv_cache_dtype`` KV cache; ``any_eager``: the current one of
        ``dtype`` and ``kv_cache_dtype`` will do."""
        if eager and not any_eager and not _has_enforce_eager():
            raise SectionFailed("engine API missing: EngineConfig.enforce_eager (vLLM's "
                                "--enforce-eager): CUDA graphs cannot be turned off")
        cur = self.current
        if (cur is not None and cur.dtype == dtype and cur.kv_cache_dtype == kv_cache_dtype
                and (any_eager or cur.eager in (eager, None))):
            return cur
        key = (dtype, eager, kv_cache_dtype)
        if key in self.failed:
            raise SectionFailed(self.failed[key])
        self.close_current()
        self._start(dtype, eager, kv_cache_dtype)
        return self.current

    def _start(self, dtype: str, eager: bool, kv_cache_dtype: str = "auto") -> None:
        """Start an engine as ``current`` and send it one warm-up request."""
        from kvserve.engine import AsyncEngine

        wanted = (f"{self.check.args.backend} {dtype}, {'eager' if eager else 'CUDA graphs'}"
                  + ("" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} KV cache"))
        config = engine_config(self.model, self.check.args, dtype, eager, self.check.sizes,
                               kv_cache_dtype)
        t0 = time.perf_counter()
        try:
            engine = self.run(asyncio.wait_for(AsyncEngine.start(config, stats_interval=0),
                                               _timeout(START_TIMEOUT_S)))
        except Exception as exc:  # noqa: BLE001 - the sections that need it fail with this
            if isinstance(exc, TimeoutError):
                _HUNG.append("engine start")
            key = (dtype, eager, kv_cache_dtype)
            self.failed[key] = f"engine ({wanted}) did not start: {first_line(exc)}"
            raise SectionFailed(self.failed[key]) from exc
        core = engine.core
        has_eager = _has_enforce_eager()
        graphs = getattr(core.runner, "graphs", None)
        buckets = sorted(graphs.buckets) if graphs is not None else None
        info = {"label": f"{self.check.args.backend} {dtype}, " + (
                    f"CUDA graphs of batch sizes {buckets}" if buckets else "no CUDA graphs")
                    + ("" if kv_cache_dtype == "auto" else f", {kv_cache_dtype} KV cache"),
                "kv_cache_dtype": kv_cache_dtype,
                "backend": _try(lambda: core.backend.name),
                "dtype": _try(lambda: str(core.backend.dtype)),
                "enforce_eager": eager if has_eager else "unknown: EngineConfig has no "
                                                         "enforce_eager",
                "cuda_graph_batch_sizes": buckets,
                "weights_bytes": _try(lambda: int(core.runner.model.weights_nbytes)),
                "kv_bytes_per_token": _try(lambda: int(core.plan.bytes_per_token)),
                "kv_cache_tokens": _try(lambda: core.plan.num_tokens),
                "max_model_len": _try(lambda: core.max_model_len),
                "start_s": round(time.perf_counter() - t0, 1)}
        self.current = Served(engine, StepRecorder(engine), info, dtype,
                              eager if has_eager else None, kv_cache_dtype)
        self.run(generate(engine, make_request("warmup", prompt_ids=range(100, 116),
                                               max_tokens=4)))

    def close_current(self) -> None:
        if self.current is None:
            return
        engine, self.current = self.current.engine, None
        try:
            self.run(asyncio.wait_for(engine.shutdown(), 60))
        except Exception:  # noqa: BLE001 - a stuck shutdown must not stop the check
            _HUNG.append("engine shutdown")
        del engine
        free_device_memory()

    def close(self) -> None:
        self.close_current()
        self.loop.close()
        self.log_file.flush()  # left open: a hung engine thread may still log


def model_dtype(args: argparse.Namespace) -> str:
    return "float16" if args.backend == "cuda" else "float32"


def served(check: Check, eager: bool = False, any_eager: bool = False,
           kv_cache_dtype: str = "auto") -> Served:
    """The engine a model section runs on; SectionFailed when the model is
    missing, skipped under the simulator without ``--e2e``."""
    model, missing = check.report.data["model"]["path"], check.report.data["model"]["missing"]
    if missing:
        raise SectionFailed(missing)
    if simulator_enabled() and check.args.backend == "cuda" and not check.args.e2e:
        raise SectionFailed("Numba's simulator takes tens of minutes over the model: --e2e "
                            "to run it anyway, or --backend cpu", status="skipped")
    if check.engines is None:
        check.engines = Engines(check, model)
    return check.engines.get(model_dtype(check.args), eager, any_eager, kv_cache_dtype)


def graphs_missing(check: Check, info: dict) -> str | None:
    """Why an engine meant to replay CUDA graphs does not (a GPU only: the
    simulator and the CPU backend have none), or None."""
    if check.args.backend != "cuda" or simulator_enabled() or info.get("cuda_graph_batch_sizes"):
        return None
    return ("CUDA graphs were not captured (the engine log's cuda_graphs line says why): "
            "its decode steps ran eagerly")


# --------------------------------------------------------------------------- requests


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
        request_id=f"{request_id}-{time.monotonic_ns()}", arrival_time=time.monotonic(),
        sampling_params=SamplingParams(temperature=0.0, **params), prompt=case.get("prompt"),
        messages=None if messages is None else tuple(messages),
        prompt_token_ids=None if prompt_ids is None else tuple(int(t) for t in prompt_ids))


async def generate(engine: Any, request: Any) -> Stream:
    """One request to its end; aborted (and TimeoutError) past REQUEST_TIMEOUT_S."""
    try:
        return await asyncio.wait_for(collect(engine, request), _timeout(REQUEST_TIMEOUT_S))
    except TimeoutError:
        await engine.abort(request.request_id)
        raise


# --------------------------------------------------------------------------- golden


def judge_golden(entry: dict, got: Stream, tol: float) -> dict:
    """The tests' rule (tests/e2e) at logit tolerance ``tol``: prompt ids equal,
    each golden first-step top-5 logit within ``tol`` of ours, tokens equal but
    for a divergence at our own near-tie (top-2 gap < ``tol``)."""
    want = entry["output_token_ids"]
    res: dict[str, Any] = {"case": entry["case"]["name"], "failed": got.failed,
                           "prompt_ids_equal": got.prompt_ids == tuple(entry["prompt_token_ids"]),
                           "tokens": f"{_common_prefix(want, got.tokens)}/{len(want)} equal"}
    golden_top = dict(zip(entry["first_step_top5_ids"], entry["first_step_top5_logits"]))
    ours = dict(got.logprobs[0][1]) if got.logprobs else {}
    res["top5_same_ids"] = set(list(ours)[:5]) == set(golden_top)
    diffs = [abs(ours[t] - v) if t in ours else math.inf for t, v in golden_top.items()]
    res["top5_max_abs_diff"] = max(diffs)
    res["top5_ok"] = max(diffs) <= tol
    res.update(_divergence(want, got, tol))
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


def _divergence(want: list[int], got: Stream, tol: float) -> dict:
    """First differing position and our top-2 gap there (< tol: allowed)."""
    i = _common_prefix(want, got.tokens)
    if i == min(len(want), len(got.tokens)):
        return {"first_divergence": None if len(want) == len(got.tokens) else i,
                "length": f"{len(got.tokens)} tokens, golden {len(want)}"}
    top = got.logprobs[i][1] if i < len(got.logprobs) else ()
    gap = float(top[0][1] - top[1][1]) if len(top) >= 2 else None
    return {"first_divergence": i, "got": got.tokens[i], "golden": want[i], "top2_gap": gap,
            "allowed_near_tie": gap is not None and gap < tol}


async def golden_run(engine: Any, cases: list[dict], tol: float) -> list[dict]:
    out = []
    for n, entry in enumerate(cases):
        try:
            got = await generate(engine, make_request(f"golden-{n}", case=entry["case"],
                                                      logprobs=GOLDEN_TOP,
                                                      max_tokens=entry["case"]["max_tokens"]))
            out.append(judge_golden(entry, got, tol))
        except Exception as exc:  # noqa: BLE001 - the next prompt still runs
            out.append({"case": entry["case"]["name"], "error": first_line(exc), "pass": False})
    return out


def golden_section(check: Check) -> dict:
    srv = served(check)
    file = find_golden(check.args.golden)
    if file is None:
        where = (check.args.golden if check.args.golden else
                 "$KVSERVE_GOLDEN or shared/golden in or beside the repository")
        raise SectionFailed(f"golden: no {GOLDEN_FILE} in {where}: pass --golden PATH (the "
                            "--split-gguf folder holds a copy)", {"engine": srv.info})
    cases = json.loads(file.read_text(encoding="utf-8"))[:check.args.golden_cases]
    tol = LOGIT_TOL if srv.dtype == "float32" else check.args.f16_logit_tol
    results = check.engines.run(golden_run(srv.engine, cases, tol))
    data = {"engine": srv.info, "file": str(file), "logit_tol": tol, "cases": results}
    failed = [c["case"] for c in results if not c["pass"]]
    if graphs_missing(check, srv.info):
        raise SectionFailed(graphs_missing(check, srv.info), data)
    if failed or not results:
        raise SectionFailed(f"{len(failed)} of {len(results)} golden prompts failed: "
                            f"{', '.join(failed)}", data)
    return data


# --------------------------------------------------------------------------- decode and prefill


def token_range(engine: Any) -> tuple[int, int]:
    """Random prompt ids: [1000, 30000) clipped to the model's and tokenizer's vocabularies."""
    high = min(30000, engine.core.model_config.vocab_size, engine.tokenizer.vocab_size)
    return min(1000, high // 4), high


async def decode_run(engine: Any, batch: int, s: Sizes, rng: np.random.Generator) -> dict:
    """``batch`` concurrent requests of s.decode_tokens greedy tokens (ignore_eos):
    tokens/s overall and over the window where every stream has had its first
    token and none its last (as the client sees them; events may carry several
    tokens)."""
    prompts = rng.integers(*token_range(engine), (batch, s.decode_prompt))
    t0 = time.perf_counter()
    streams = await asyncio.gather(*(generate(engine, make_request(
        f"decode-{batch}-{i}", prompt_ids=p, max_tokens=s.decode_tokens, ignore_eos=True))
        for i, p in enumerate(prompts)))
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
            "client_steady_tok_s": window / (end - start) if end > start and window else None,
            "client_steady_window_s": end - start,
            "ttft_s_median": statistics.median(st.times[0][0] - t0 for st in streams)}


def step_summary(steps: list[StepRecord], batch: int, info: dict,
                 copy_gbs: float | None) -> dict:
    """Over the decode steps of ``batch`` sequences (no prefill token): decode
    tokens/s (batch / the mean interval between consecutive steps' ends);
    medians of step time, phases, interval and HBM floor (module docstring);
    counters per step."""
    steps = [r for r in steps if r.prefill_tokens == 0 and r.batch_size == batch]
    if len(steps) < 2:
        raise RuntimeError(f"{len(steps)} decode steps of batch {batch} recorded (need 2)")
    med = statistics.median
    gaps = [b.end - a.end for a, b in zip(steps, steps[1:]) if b.step_id == a.step_id + 1]
    out: dict[str, Any] = {
        "decode_steps": len(steps), "tok_s": batch * len(gaps) / sum(gaps) if gaps else None,
        "step_s": med(r.seconds for r in steps),
        "interval_s": med(gaps) if gaps else None,
        "phases_s": {p: med(r.phases[p] for r in steps) for p in steps[0].phases},
        "kv_tokens_read": med(r.kv_tokens for r in steps)}
    weights, per_token = info.get("weights_bytes"), info.get("kv_bytes_per_token")
    if isinstance(weights, int) and isinstance(per_token, int) and copy_gbs:
        floor = med((weights + r.kv_tokens * per_token) / (copy_gbs * 1e9) for r in steps)
        out.update(hbm_floor_s=floor, floor_over_step=floor / out["step_s"],
                   floor_over_interval=floor / out["interval_s"] if out["interval_s"] else None)
    else:
        out["hbm_floor_s"] = (f"not computed: weights {weights}, KV bytes/token {per_token}, "
                              f"copy {copy_gbs} GB/s")
    out["per_step"] = _counters_per_step(steps)
    return out


def _counters_per_step(steps: list[StepRecord]) -> dict | None:
    """(last - first) / steps over the longest run of consecutive steps, its
    last two left out when it has five or more (after them nothing is in
    flight, so their readings lack the next step's work)."""
    best: list[StepRecord] = []
    run: list[StepRecord] = []
    for r in steps:
        if r.counters is None:
            return None
        run = run + [r] if run and r.step_id == run[-1].step_id + 1 else [r]
        best = run if len(run) > len(best) else best
    best = best[:-2] if len(best) >= 5 else best
    if len(best) < 2:
        return None
    n = len(best) - 1
    return {f: (b - a) / n for f, a, b in zip(COUNTER_FIELDS, best[0].counters,
                                               best[-1].counters)} | {"over_steps": n}


def measure_decode(check: Check, srv: Served, batch: int, rng: np.random.Generator) -> dict:
    """One ``decode_run`` with the steps it made summarized."""
    mark = len(srv.recorder.steps)
    srv.recorder.reset_counters()
    run = check.engines.run(decode_run(srv.engine, batch, check.sizes, rng))
    run["steps"] = step_summary(srv.recorder.steps[mark:], batch, srv.info, check.copy_gbs)
    return run


def decode_step_section(check: Check) -> dict:
    srv = served(check)
    run = measure_decode(check, srv, 1, np.random.default_rng(check.args.seed + 2))
    data = {"engine": srv.info, "method": "1 request: per decode step medians; counters: "
            "difference of readings k steps apart / k", **run}
    if srv.recorder.missing:
        raise SectionFailed(f"engine API missing: {', '.join(srv.recorder.missing)} (launches "
                            "and copies per step not measured)", data)
    if not isinstance(data["steps"]["hbm_floor_s"], float):
        raise SectionFailed(f"no HBM floor: {data['steps']['hbm_floor_s']}", data)
    if data["steps"]["per_step"] is None:
        raise SectionFailed("no two consecutive decode steps with counters", data)
    return data


def decode_batches(check: Check, srv: Served) -> tuple[dict, list[str]]:
    """``measure_decode`` at each of the sizes' batch sizes: (runs, errors)."""
    rng = np.random.default_rng(check.args.seed)
    runs: dict[str, Any] = {}
    for batch in check.sizes.decode_batches:
        try:
            runs[str(batch)] = measure_decode(check, srv, batch, rng)
        except Exception as exc:  # noqa: BLE001 - the other batch sizes still run
            runs[str(batch)] = {"error": first_line(exc)}
    return runs, [f"batch {b}: {r['error']}" for b, r in runs.items() if "error" in r]


def throughput_section(check: Check) -> dict:
    srv = served(check)
    runs, errors = decode_batches(check, srv)
    s = check.sizes
    data = {"engine": srv.info, "method": (
        f"N concurrent requests of {s.decode_prompt} random prompt tokens and "
        f"{s.decode_tokens} greedy output tokens (ignore_eos); tok/s = N / the mean interval "
        "of the steps where all N decode; client tok/s: the streams over that window"),
        "batches": runs}
    if errors:
        raise SectionFailed("; ".join(errors), data)
    return data


def graphs_vs_eager_section(check: Check) -> dict:
    throughput = check.section_data("throughput")
    graphs = throughput.get("batches", {})
    srv = served(check, eager=True)
    runs, errors = decode_batches(check, srv)
    rows = {b: _compare(graphs.get(b, {}), run) for b, run in runs.items()}
    data = {"engine": srv.info, "eager": runs, "comparison": rows}
    if errors:
        raise SectionFailed("; ".join(errors), data)
    missing = [b for b, row in rows.items() if row.get("graphs_tok_s") is None]
    if missing:
        raise SectionFailed(f"no CUDA-graphs figures at batch {', '.join(missing)}: the "
                            "throughput section did not measure them", data)
    no_graphs = graphs_missing(check, throughput["engine"])
    if no_graphs:
        raise SectionFailed(f"nothing to compare: {no_graphs}", data)
    return data


def _compare(graphs: dict, eager: dict) -> dict:
    """Graphs and eager figures of one batch size, with graphs / eager ratios."""
    def pick(run: dict, *path: str) -> Any:
        for key in path:
            run = run.get(key) if isinstance(run, dict) else None
        return run
    row = {}
    for name, path in (("tok_s", ("steps", "tok_s")), ("interval_s", ("steps", "interval_s")),
                       ("launches", ("steps", "per_step", "launches"))):
        g, e = pick(graphs, *path), pick(eager, *path)
        row.update({f"graphs_{name}": g, f"eager_{name}": e,
                    f"{name}_graphs_over_eager": g / e if g is not None and e else None})
    return row


async def prefill_run(engine: Any, s: Sizes, rng: np.random.Generator) -> dict:
    """Time to the first token of fresh s.prefill_tokens-token prompts (one step each)."""
    ttfts = []
    for i in range(s.prefill_reps):
        prompt = rng.integers(*token_range(engine), s.prefill_tokens)
        t0 = time.perf_counter()
        st = await generate(engine, make_request(f"prefill-{i}", prompt_ids=prompt,
                                                 max_tokens=1, ignore_eos=True))
        if st.failed or not st.times:
            raise RuntimeError(f"prefill request failed: {st.failed}")
        ttfts.append(st.times[0][0] - t0)
    ttft = statistics.median(ttfts)
    return {"prompt_tokens": s.prefill_tokens, "ttft_s": ttft, "tok_s": s.prefill_tokens / ttft,
            "ttfts_s": ttfts}


def prefill_section(check: Check) -> dict:
    srv = served(check, any_eager=True)
    mark = len(srv.recorder.steps)
    run = check.engines.run(prefill_run(srv.engine, check.sizes,
                                        np.random.default_rng(check.args.seed + 1)))
    steps = [r.seconds for r in srv.recorder.steps[mark:]
             if r.prefill_tokens == check.sizes.prefill_tokens]
    if steps:
        run.update(step_s=statistics.median(steps),
                   step_tok_s=check.sizes.prefill_tokens / statistics.median(steps))
    return {"engine": srv.info, **run}


# --------------------------------------------------------------------------- int8 KV cache


def _nan_vector(hd: int) -> np.ndarray:
    """The stored bytes of an int8 KV vector no kernel may read: codes 1, scale NaN."""
    return np.concatenate([np.ones(hd, np.int8), np.array([np.nan], "<f4").view(np.int8)])


def int8_paged_batch(rng: np.random.Generator, seqs: list[tuple[int, int]], nh: int, nkv: int,
                     hd: int, bs: int, dtype: Any, pad: int, window: int = 0) -> tuple:
    """``paged_batch`` over an int8 cache [num_blocks, 2, bs, nkv, hd + 4]:
    each sequence's K/V ``kv_quant.quantize``d into shuffled blocks; every
    other slot, and with ``window`` the slots before each sequence's window,
    a NaN-scale vector. Returns (q, cache, block_tables, seq_lens,
    query_start_loc, float64 (K, V) per sequence = ``kv_quant.dequantize``
    of what is stored)."""
    from kvserve.model import kv_quant

    blocks = [-(-(c + n) // bs) for c, n in seqs]
    num_blocks = sum(blocks) + 2
    perm = rng.permutation(num_blocks).astype(np.int32)
    cache = np.empty((num_blocks, 2, bs, nkv, hd + kv_quant.SCALE_BYTES), np.int8)
    cache[...] = _nan_vector(hd)
    bt = np.full((len(seqs), max(blocks) + 1), -1, np.int32)
    dense, used = [], 0
    for s, ((c, n), nb) in enumerate(zip(seqs, blocks)):
        bt[s, :nb] = perm[used:used + nb]
        used += nb
        lo = max(0, c + 1 - window) if window else 0
        stored = kv_quant.quantize(randn(rng, (c + n, 2, nkv, hd), np.float32))
        kv = f64(kv_quant.dequantize(stored))  # the reference masks keys before the window
        dense.append((kv[:, 0], kv[:, 1]))
        stored[:lo] = _nan_vector(hd)  # the kernels must not even load them
        pos = np.arange(c + n)
        cache[bt[s, pos // bs], :, pos % bs] = stored
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    q = randn(rng, (int(qsl[-1]) + pad, nh, hd), dtype)
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    return q, cache, bt, seq_lens, qsl, dense


def int8_write_kv_setup(rng: np.random.Generator, ops: Any, dtype: Any, m: Shape, T: int,
                        block_size: int) -> tuple:
    """``write_kv`` into an int8 cache: K/V as strided views of a fused qkv
    output, shuffled slots (1/16 skipped); the cache must hold
    ``kv_quant.quantize`` of each vector (in float32) byte for byte."""
    from kvserve.model import kv_quant

    nh, nkv, hd = m.heads, m.kv_heads, m.head_dim
    num_blocks = 2 * -(-T // block_size) + 1
    qkv = randn(rng, (T, (nh + 2 * nkv) * hd), dtype, 3.0)
    qkv[0, nh * hd:(nh + 1) * hd] = 0  # a zero vector: scale 0, codes 0
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[1::16] = -1
    k = qkv[:, nh * hd:(nh + nkv) * hd].reshape(T, nkv, hd).astype(np.float32)
    v = qkv[:, (nh + nkv) * hd:].reshape(T, nkv, hd).astype(np.float32)
    expected = np.zeros((num_blocks, 2, block_size, nkv, hd + kv_quant.SCALE_BYTES), np.int8)
    keep = slots >= 0
    expected[slots[keep] // block_size, 0, slots[keep] % block_size] = kv_quant.quantize(k[keep])
    expected[slots[keep] // block_size, 1, slots[keep] % block_size] = kv_quant.quantize(v[keep])
    d_qkv, d_slots = ops.to_device(qkv), ops.to_device(slots)
    dk = d_qkv[:, nh * hd:(nh + nkv) * hd].reshape(T, nkv, hd)
    dv = d_qkv[:, (nh + nkv) * hd:].reshape(T, nkv, hd)
    cache = ops.allocate_kv_cache(num_blocks, block_size, nkv, hd, kv_cache_dtype="int8")

    def check(_):
        got = ops.to_numpy(cache)
        same = bool(np.array_equal(got, expected))
        return (0.0 if same else math.inf), 0.0, 1.0, (
            "bytes equal kv_quant.quantize" if same else
            f"{int((got != expected).sum())} bytes differ from kv_quant.quantize")
    item = np.dtype(dtype).itemsize
    return (lambda: ops.write_kv(dk, dv, cache, d_slots), check,
            int(keep.sum()) * 2 * nkv * (hd * item + hd + kv_quant.SCALE_BYTES) + 8 * T)


def int8_attention_setup(rng: np.random.Generator, ops: Any, dtype: Any, m: Shape,
                         seqs: list[tuple[int, int]], pad: int, bs: int, window: int = 0
                         ) -> tuple:
    """``paged_attention`` over an int8 cache (``int8_paged_batch``) against
    float64 attention over its dequantized K/V; bound as ``attention_setup``."""
    q, cache, bt, sl, qsl, dense = int8_paged_batch(rng, seqs, m.heads, m.kv_heads, m.head_dim,
                                                    bs, dtype, pad, window)
    scale = m.head_dim ** -0.5
    ref, terms = ref_attention(q, seqs, qsl, dense, scale, window)
    kap = kappa(terms, ref)
    del dense
    to = ops.to_device
    args = (to(q), to(cache), to(bt), to(sl), to(qsl), scale)
    nbytes = 2 * q.nbytes + sum(c + n for c, n in seqs) * 2 * m.kv_heads * (m.head_dim + 4)

    def check(out):
        out = ops.to_numpy(out)
        note = f"{len(seqs)} seqs, contexts {min(sl)}-{max(sl)}" + (
            f", window {window}" if window else "")
        if pad and np.any(out[int(qsl[-1]):] != 0):
            return math.inf, float_bound(dtype, kap), kap, note + "; padding rows NOT zero"
        return rel_err(out, ref), float_bound(dtype, kap), kap, note
    windowed = {"window": window} if window else {}
    return lambda: ops.paged_attention(*args, **windowed), check, nbytes


def fused_decode_setup(rng: np.random.Generator, ops: Any, dtype: Any, m: Shape,
                       contexts: list[int], bs: int, kv_cache_dtype: str) -> tuple:
    """One layer of a planned decode step (``prepare_step``, then
    ``rope_kv_attention``: the fused RoPE + KV write + attention kernel, and
    the split-K reduction past a partition) over a ``kv_cache_dtype`` cache
    holding the earlier K/V. int8: the new V must be stored as
    ``kv_quant.quantize``'s bytes, and the output must equal float64
    attention with the RoPE'd q over ``kv_quant.dequantize`` of the cache
    the step left; auto: the output against the float64 K/V as stored."""
    from kvserve.model import kv_quant
    from kvserve.model.input_batch import BatchInputs
    from kvserve.model.llama import AttentionMetadata
    from kvserve.model.ops import StepGeometry, build_rope_cache

    nh, nkv, hd = m.heads, m.kv_heads, m.head_dim
    N, quant = len(contexts), kv_quant.is_quantized(kv_cache_dtype)
    per_seq = -(-max(contexts) // bs)
    num_blocks = N * per_seq + 1
    table = (1 + rng.permutation(num_blocks - 1)).reshape(N, per_seq).astype(np.int32)
    positions = np.array(contexts, np.int64) - 1
    width = hd + (kv_quant.SCALE_BYTES if quant else 0)
    cache = np.zeros((num_blocks, 2, bs, nkv, width), np.int8 if quant else dtype)
    for s, ctx in enumerate(contexts):
        pos = np.arange(ctx - 1)
        kv = randn(rng, (ctx - 1, 2, nkv, hd), np.float32 if quant else dtype)
        cache[table[s, pos // bs], :, pos % bs] = kv_quant.quantize(kv) if quant else kv
    slots = (table[np.arange(N), positions // bs] * bs + positions % bs).astype(np.int64)
    batch = BatchInputs(input_ids=np.zeros(N, np.int64), positions=positions, slot_mapping=slots,
                        block_tables=table, seq_lens=np.array(contexts, np.int32),
                        query_start_loc=np.arange(N + 1, dtype=np.int32),
                        logits_indices=np.arange(N, dtype=np.int64),
                        sample_ids=tuple(map(str, range(N))))
    rope = build_rope_cache(hd, max(contexts) + 1, ROPE_THETA)
    qkv = randn(rng, (N, (nh + 2 * nkv) * hd), dtype)
    step = ops.prepare_step(batch, StepGeometry(16, rope.shape[0], num_blocks, bs))
    d_cache, d_qkv, d_rope = ops.to_device(cache), ops.to_device(qkv), ops.to_device(rope)
    attn = AttentionMetadata(step.slot_mapping, step.block_tables, step.seq_lens,
                             step.query_start_loc, plan=step)

    def run():
        return ops.rope_kv_attention(d_qkv, step.positions, d_rope, d_cache, attn, hd ** -0.5,
                                     nh, nkv, hd)

    def check(out):
        out, stored = ops.to_numpy(out), ops.to_numpy(d_cache)
        tab = f64(rope.astype(dtype))
        x = f64(qkv)
        q, _ = ref_rope(x[:, :nh * hd].reshape(N, nh, hd), positions, tab)
        b, o = slots // bs, slots % bs
        note = f"{N} seqs, contexts {min(contexts)}-{max(contexts)}, {kv_cache_dtype} cache"
        if quant:
            v_new = qkv[:, (nh + nkv) * hd:].reshape(N, nkv, hd).astype(np.float32)
            if not np.array_equal(stored[b, 1, o], kv_quant.quantize(v_new)):
                return math.inf, 0.0, 1.0, note + "; new V NOT stored as kv_quant.quantize"
            stored = kv_quant.dequantize(stored)
        dense = []
        for s, ctx in enumerate(contexts):
            j = np.arange(ctx)
            kv = f64(stored[table[s, j // bs], :, j % bs])  # [ctx, 2, nkv, hd]
            dense.append((kv[:, 0], kv[:, 1]))
        ref, terms = ref_attention(q, [(c - 1, 1) for c in contexts], np.arange(N + 1), dense,
                                   hd ** -0.5)
        kap = kappa(terms, ref)
        return rel_err(out, ref), float_bound(dtype, kap), kap, note
    nbytes = sum(contexts) * 2 * nkv * (width if quant else hd * np.dtype(dtype).itemsize)
    return run, check, nbytes + qkv.nbytes


def kv_int8_kernel_cases(bench: KernelBench, s: Sizes) -> dict:
    """The int8 cases of ``kv_int8_section`` (rows in ``bench``); returns the
    fused decode's int8 / float timing comparison."""
    from kvserve.cuda.ops import CudaOps

    m, rng = s.attention[1], bench.rng  # SmolLM2's attention (GQA 3)
    window = max(1, s.max_ctx // 4)
    for dtype in (np.float16, np.float32):
        ops = CudaOps(dtype=dtype, partition_size=s.partition, prefill_tile_q=s.tile_q)
        model = s.models[0]
        bench.measure("write_kv int8", dtype, f"{model.name} T={s.tokens} "
                      f"kv={model.kv_heads}x{model.head_dim}",
                      lambda: int8_write_kv_setup(rng, ops, dtype, model, s.tokens,
                                                  s.block_size))
        for form, (seqs, pad) in attention_forms(rng, s).items():
            if dtype == np.float32 and form != "decode split-K":
                continue
            for w in (0, window):
                bench.measure(
                    f"paged_attention int8 {form}" + (f" window={w}" if w else ""), dtype,
                    f"{m.name} {m.heads}/{m.kv_heads}x{m.head_dim} ctx<="
                    f"{max(c + n for c, n in seqs)}",
                    lambda seqs=seqs, pad=pad, w=w: int8_attention_setup(
                        rng, ops, dtype, m, seqs, pad, s.block_size, w))
        free_device_memory()
    dtype = np.float16
    ops = CudaOps(dtype=dtype, partition_size=s.partition, prefill_tile_q=s.tile_q)
    contexts = [int(c) for c in rng.integers(s.max_ctx // 2, s.max_ctx + 1, s.splitk_seqs)]
    timing = {}
    for kv in ("int8", "auto"):
        name = f"rope_kv_attention fused decode, {kv} cache"
        bench.measure(name, dtype, f"{m.name} {m.heads}/{m.kv_heads}x{m.head_dim} "
                      f"N={len(contexts)} ctx<={max(contexts)}",
                      lambda kv=kv: fused_decode_setup(rng, ops, dtype, m, contexts,
                                                       s.block_size, kv))
        row = bench.rows[-1]
        timing[kv] = {"median_us": row.get("median_us"), "bytes": row.get("bytes"),
                      "GB_s": row.get("GB_s")}
    free_device_memory()
    i8, f16 = timing["int8"].get("median_us"), timing["auto"].get("median_us")
    return {"contexts": contexts, "dtype": "float16", **{f"{k}_cache": v for k, v in
                                                          timing.items()},
            "time_int8_over_float": i8 / f16 if i8 and f16 else None}


def kv_int8_section(check: Check) -> dict:
    """The int8 KV cache on the GPU: kernels against the NumPy reference,
    the fused decode's time over int8 and float caches, then (with a model)
    a decode batch on an int8-cache engine against the float one."""
    from kvserve.cuda.ops import array_module

    if check.engines is not None:
        check.engines.close_current()  # its KV cache and weights leave the device
    s = check.sizes
    timer = Timer(cupy_module(), s.warmup, s.repeats)
    copy_gbs = check.copy_gbs or copy_bandwidth(array_module(), timer, s.copy_bytes)["GB_s"]
    bench = KernelBench(timer, copy_gbs, np.random.default_rng(check.args.seed + 31))
    data: dict[str, Any] = {"timing": timer.label, "copy_GB_s": copy_gbs}
    data["fused_decode"] = kv_int8_kernel_cases(bench, s)
    data["rows"] = bench.rows
    failed = [f"{r['kernel']} {r['dtype']} {r['shape']}" for r in bench.rows if not r["pass"]]
    if failed:
        raise SectionFailed(f"{len(failed)} of {len(bench.rows)} int8 KV cases failed: "
                            f"{'; '.join(failed[:3])}" + (" ..." if len(failed) > 3 else ""), data)
    batch = max(s.decode_batches)
    rng = np.random.default_rng(check.args.seed + 32)
    engines = {}
    for kv in ("auto", "int8"):
        try:
            srv = served(check, kv_cache_dtype=kv)
        except SectionFailed as exc:
            raise SectionFailed(f"engine comparison not run ({kv} KV cache): {exc.reason}",
                                data, status=exc.status) from None
        run = measure_decode(check, srv, batch, np.random.default_rng(rng.integers(1 << 31)))
        engines[kv] = {"engine": srv.info, **run}
        data["engines"] = engines
    if check.engines is not None:
        check.engines.close_current()
    steps = {kv: engines[kv]["steps"] for kv in engines}
    data["engine_comparison"] = {
        "batch": batch,
        **{f"{kv}_{name}": steps[kv].get(name) for kv in steps
           for name in ("step_s", "interval_s", "tok_s")},
        **{f"{kv}_kv_cache_tokens": engines[kv]["engine"].get("kv_cache_tokens")
           for kv in engines},
        "step_int8_over_auto": (steps["int8"]["step_s"] / steps["auto"]["step_s"]
                                if steps["auto"].get("step_s") else None)}
    no_graphs = graphs_missing(check, engines["int8"]["engine"])
    if no_graphs:
        raise SectionFailed(f"int8 KV cache engine: {no_graphs}", data)
    return data


#: (name, function) in the order they run: most important first.
SECTIONS: list[tuple[str, Callable[[Check], dict]]] = [
    ("environment", environment_section),
    ("copy_bandwidth", copy_section),
    ("golden", golden_section),
    ("decode_step", decode_step_section),
    ("throughput", throughput_section),
    ("graphs_vs_eager", graphs_vs_eager_section),
    ("prefill", prefill_section),
    ("kv_int8", kv_int8_section),
    ("kernels", kernel_section),
]


# --------------------------------------------------------------------------- Markdown


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if not isinstance(value, int | float) else format(value * scale, spec)


def _rate(value: Any) -> str:
    """Tokens/s: whole numbers with separators, three digits below 100."""
    if not isinstance(value, int | float):
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown(data: dict) -> str:
    """The summary: a verdict, one row per section, then each section's figures."""
    sm, sections = data["summary"], data["sections"]
    verdict = ("OK" if sm.get("ok") else "FAILED (exit status 1)" if sm.get("finished")
               else "INCOMPLETE (still running, or cut short)")
    lines = [f"# gpu_check: {verdict}", "",
             f"{data.get('device', '-')}; model {data['model']['path'] or 'missing'}; "
             f"started {data['started']}; budget {data['budget_s']:g} s"
             + ("; **simulator: timings not meaningful**" if data["simulator"] else ""), "",
             "| section | status | seconds | reason |", "|---|---|---:|---|"]
    for name, entry in sections.items():
        reason = (entry.get("reason") or "").replace("|", "/")
        lines.append(f"| {name} | {entry['status']} | {_fmt(entry.get('seconds'), '.1f')} | "
                     f"{reason} |")
    for name, render in RENDERERS:
        section_data = sections.get(name, {}).get("data")
        if section_data:
            try:
                lines += ["", *render(section_data)]
            except Exception as exc:  # noqa: BLE001 - the JSON has it; the summary goes on
                lines += ["", f"{name}: figures not rendered ({first_line(exc)}); see the JSON"]
    return "\n".join(lines)


def _copy_lines(d: dict) -> list[str]:
    return [f"Copy bandwidth (device to device, read + write): {_fmt(d.get('GB_s'), ',.0f')} "
            f"GB/s ({d.get('timing')})"]


def _golden_lines(d: dict) -> list[str]:
    lines = [f"Golden ({d['engine']['label']}; logit tolerance {d.get('logit_tol', '-')}):"]
    for c in d.get("cases", []):
        lines.append(f"- {c['case']}: {'PASS' if c['pass'] else 'FAIL'} " + _case_detail(c))
    return lines


def _case_detail(c: dict) -> str:
    if "error" in c or c.get("failed"):
        return c.get("error") or f"request failed: {c['failed']}"
    parts = [f"tokens {c['tokens']}", f"top-5 max |dlogit| {_fmt(c['top5_max_abs_diff'], '.1e')}"
             + ("" if c["top5_same_ids"] else " (top-5 ids differ)")]
    if c.get("first_divergence") is not None:
        parts.append(f"diverges at {c['first_divergence']} (top-2 gap "
                     f"{_fmt(c.get('top2_gap'), '.2e')}: "
                     f"{'near-tie, allowed' if c.get('allowed_near_tie') else 'not a near-tie'})")
    if not c["prompt_ids_equal"]:
        parts.append("prompt ids differ")
    if c.get("text_equal") is False or c.get("finish_ok") is False:
        parts.append("text or finish reason differs")
    return "; ".join(parts)


DECODE_HEADER = ["| batch | tok/s | client tok/s | step ms | interval ms | HBM floor ms "
                 "| floor / interval | launches / step | H2D / step | D2H / step |",
                 "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def _decode_row(batch: str, run: dict) -> str:
    if "error" in run:
        return f"| {batch} | ERROR: {run['error'].replace('|', '/')} | | | | | | | | |"
    st, per = run["steps"], run["steps"].get("per_step") or {}
    return (f"| {batch} | {_rate(st.get('tok_s'))} | {_rate(run.get('client_steady_tok_s'))} | "
            f"{_fmt(st['step_s'], '.2f', 1e3)} | "
            f"{_fmt(st.get('interval_s'), '.2f', 1e3)} | {_fmt(st.get('hbm_floor_s'), '.3f', 1e3)}"
            f" | {_fmt(st.get('floor_over_interval'), '.3f')} | {_fmt(per.get('launches'), '.1f')}"
            f" | {_fmt(per.get('h2d'), '.1f')} | {_fmt(per.get('d2h'), '.1f')} |")


def _decode_step_lines(d: dict) -> list[str]:
    if "steps" not in d:
        return []
    phases = ", ".join(f"{p} {v * 1e3:.2f}" for p, v in d["steps"]["phases_s"].items())
    return [f"Decode step ({d['engine']['label']}; {d['method']}); phases ms: {phases}", "",
            *DECODE_HEADER, _decode_row("1", d)]


def _throughput_lines(d: dict) -> list[str]:
    return [f"Decode throughput ({d['engine']['label']}; {d['method']}):", "", *DECODE_HEADER,
            *(_decode_row(b, run) for b, run in d.get("batches", {}).items())]


def _eager_lines(d: dict) -> list[str]:
    lines = [f"Eager ({d['engine']['label']}):", "", *DECODE_HEADER,
             *(_decode_row(b, run) for b, run in d.get("eager", {}).items()), "",
             "| batch | tok/s graphs / eager | interval graphs / eager | launches graphs / eager |",
             "|---:|---:|---:|---:|"]
    for b, row in d.get("comparison", {}).items():
        lines.append(f"| {b} | {_fmt(row['tok_s_graphs_over_eager'], '.2f')} | "
                     f"{_fmt(row['interval_s_graphs_over_eager'], '.2f')} | "
                     f"{_fmt(row['launches_graphs_over_eager'], '.2f')} |")
    return lines


def _prefill_lines(d: dict) -> list[str]:
    if "tok_s" not in d:
        return []
    return [f"Prefill ({d['engine']['label']}): {d['prompt_tokens']:,}-token prompt: "
            f"{_rate(d['tok_s'])} tok/s (TTFT median {d['ttft_s'] * 1e3:,.1f} ms; the step "
            f"{_fmt(d.get('step_s'), ',.1f', 1e3)} ms, {_rate(d.get('step_tok_s'))} tok/s)"]


def _kv_int8_lines(d: dict) -> list[str]:
    fused = d.get("fused_decode", {})
    lines = _kernel_lines({"timing": d.get("timing"), "copy_GB_s": d.get("copy_GB_s"),
                           "rows": d.get("rows", [])})
    lines[0] = "int8 KV cache: " + lines[0]
    lines += ["", f"Fused decode ({fused.get('dtype')}, {len(fused.get('contexts', []))} "
              f"sequences): int8 / float cache time "
              f"{_fmt(fused.get('time_int8_over_float'), '.3f')}"]
    cmp = d.get("engine_comparison")
    if cmp:
        lines += ["", f"Engines at batch {cmp['batch']}:", "",
                  "| KV cache | step ms | interval ms | tok/s | KV-cache tokens |",
                  "|---|---:|---:|---:|---:|"]
        for kv in ("auto", "int8"):
            lines.append(f"| {kv} | {_fmt(cmp.get(f'{kv}_step_s'), '.2f', 1e3)} | "
                         f"{_fmt(cmp.get(f'{kv}_interval_s'), '.2f', 1e3)} | "
                         f"{_rate(cmp.get(f'{kv}_tok_s'))} | "
                         f"{_fmt(cmp.get(f'{kv}_kv_cache_tokens'), ',.0f')} |")
        lines.append(f"step time int8 / auto: {_fmt(cmp.get('step_int8_over_auto'), '.3f')}")
    return lines


def _kernel_lines(kernels: dict) -> list[str]:
    lines = [f"Kernels (timing: {kernels.get('timing')}; copy "
             f"{_fmt(kernels.get('copy_GB_s'), '.1f')} GB/s)", "",
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
    return lines


RENDERERS: list[tuple[str, Callable[[dict], list[str]]]] = [
    ("copy_bandwidth", _copy_lines), ("golden", _golden_lines),
    ("decode_step", _decode_step_lines), ("throughput", _throughput_lines),
    ("graphs_vs_eager", _eager_lines), ("prefill", _prefill_lines),
    ("kv_int8", _kv_int8_lines), ("kernels", _kernel_lines),
]


# --------------------------------------------------------------------------- main


def _names(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    known = [name for name, _ in SECTIONS]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; known: {known}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The flags (each has a row in tools/README.md, gpu_check.py)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json",
                   help="JSON results (Markdown: <stem>.md; engine log: <out>.log)")
    p.add_argument("--sections", type=_names, default=None, metavar="A,B",
                   help="run only these sections (the others are recorded as skipped)")
    p.add_argument("--allow-skip", type=_names, action="extend", default=[], metavar="A,B",
                   help="sections whose skip does not fail the check (recorded in the JSON)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="sections (and kernel groups) that would start after this many seconds "
                        "are skipped (default 330; 3600 on the simulator)")
    p.add_argument("--model", help="checkpoint folder (default: the default model, if already "
                                   "converted; never downloaded); with --assemble-gguf: where to")
    p.add_argument("--golden", help=f"folder or file of {GOLDEN_FILE}")
    p.add_argument("--golden-cases", type=int, default=None, help="only the first N golden prompts")
    p.add_argument("--f16-logit-tol", type=float, default=F16_LOGIT_TOL,
                   help="golden logit tolerance at float16 (float32: 1e-3)")
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    p.add_argument("--allow-simulator", action="store_true",
                   help="let the environment section pass under Numba's simulator (a check of "
                        "this script)")
    p.add_argument("--e2e", action="store_true", help="run the model sections on the simulator")
    p.add_argument("--backend", choices=("cuda", "cpu"), default="cuda",
                   help="backend of the model sections (cpu: to check this script)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    bring = p.add_argument_group("bringing the default model (module docstring)")
    bring.add_argument("--split-gguf", nargs="?", const="", default=None, metavar="PATH",
                       help="cut a GGUF (a file, or a folder holding one; default: the default "
                            "model's, fetched if needed) into parts under --parts-dir")
    bring.add_argument("--parts-dir", help="folder of the parts (e.g. results/gpu-parts)")
    bring.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB,
                       help=f"largest part, MiB (default {DEFAULT_PART_MIB})")
    bring.add_argument("--assemble-gguf", metavar="DIR",
                       help="check, join and convert the parts of DIR into the default model's "
                            "folder (or --model)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.part_mib <= 0:
        parser.error("--part-mib must be > 0")
    return args


def check_command(args: argparse.Namespace) -> int:
    simulated = simulator_enabled()
    if simulated:
        sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL_S)
    if args.budget_s is None:
        args.budget_s = DEFAULT_BUDGET_S["simulator" if simulated else "gpu"]
    sizes = QUICK if args.quick or simulated else FULL
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model, missing = resolve_model(args)
    golden = find_golden(args.golden)
    report = Report(out_path, {
        "schema": "kvserve.gpu_check/2", "started": _now_iso(), "argv": sys.argv[1:],
        "device": _try(_device_line), "simulator": simulated, "budget_s": args.budget_s,
        "sizes": "quick" if sizes is QUICK else "full",
        "model": {"path": model, "missing": missing},
        "golden_file": str(golden) if golden else None}, args.allow_skip)
    check = Check(args, sizes, time.monotonic() + args.budget_s, report)
    try:
        run_sections(check, args.sections or [name for name, _ in SECTIONS])
    finally:
        if check.engines is not None:
            check.engines.close()
        report.write(finished=True)
    print(report.md_path.read_text(encoding="utf-8"))
    ok = report.data["summary"]["ok"]
    print(f"gpu_check: {'ok' if ok else 'FAILED'} (results: {out_path}, {report.md_path})",
          flush=True)
    return 0 if ok else 1


def _device_line() -> str:
    cupy = cupy_module() if not simulator_enabled() else None
    if cupy is None:
        return "no GPU (Numba's simulator)" if simulator_enabled() else "no GPU"
    props = cupy.cuda.runtime.getDeviceProperties(0)
    return f"{props['name'].decode()}, {props['totalGlobalMem'] / 2**30:.0f} GiB"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.split_gguf is not None:
        return split_command(args)
    if args.assemble_gguf:
        return assemble_command(args)
    code = check_command(args)
    if _HUNG:  # an engine thread may still be running: do not wait for it
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
