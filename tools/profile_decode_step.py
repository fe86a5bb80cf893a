"""Where a CPU decode step of a model goes: compiled kernels or Python.

Loads the default model (SmolLM2-135M; ``--model`` another, e.g. ``gemma-3-270m``) in-process on the CPU backend, float32
``--quantization q4`` and ``w4a8``, and runs decode-only steps (``--batch`` sequences,
one new token each, ``--context`` cached tokens, random K/V) through
``LlamaModel.forward`` (layers and LM head), with the fused decode path on
and off (``KVSERVE_CPU_FUSED_DECODE=0``; ``layer``: one compiled call per layer),
the modes' steps interleaved so that the machine's load hits them alike.

Per configuration it reports, per step:

- ``forward_ms``: median wall time of a plain forward;
- ``kernel_ms``: the sum of the time spent inside compiled (Numba) calls, with
  every Numba dispatcher of the ``kvserve.cpu`` kernel modules wrapped by a
  timer (a call from Python; calls between compiled functions are not seen);
- ``overhead_ms``: the median over profiled steps of the step's wall time
  less its kernel time: the Python side (op wrappers' checks, allocations,
  NumPy glue, dispatch; the timers add about 1 us per call, included here);
- ``op_calls``: calls of ``Ops`` methods, ``kernel_calls``: compiled calls.

Usage:  .venv/bin/python tools/profile_decode_step.py [--quantization none q4]
        [--batch 1 8] [--query 1 9] [--threads 1 2] [--modes 0 1] [--context 256]
        [--steps 30] [--json out.json]

``--query 9``: steps of 9 new tokens per sequence, as a verification of 8
speculative tokens (every token's logits).

Record ``uptime`` next to the numbers: on a shared 2-core machine the load
moves them.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

from kvserve.thread_env import apply_thread_pool_env

apply_thread_pool_env()  # before NumPy / Numba load

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from collections import Counter  # noqa: E402

import numpy as np  # noqa: E402
from numba.core.registry import CPUDispatcher  # noqa: E402

from kvserve.cpu import (block_dot_kernels, block_kernels, decode_layer, int8,  # noqa: E402
                         kernels, kquant_kernels, prefill_attention, quant_kernels,
                         panel_kernels)
from kvserve.cpu.ops import CpuOps  # noqa: E402
from kvserve.model.default_model import ensure_default_model  # noqa: E402
from kvserve.model.gguf_model import resolve_model  # noqa: E402
from kvserve.model.llama import AttentionMetadata, LlamaModel  # noqa: E402
from kvserve.model.loader import load_checkpoint_weights, load_model_config  # noqa: E402

KERNEL_MODULES = (kernels, block_kernels, block_dot_kernels, quant_kernels, int8,
                  prefill_attention, decode_layer, panel_kernels, kquant_kernels)
BLOCK_SIZE = 16


class KernelTimer:
    """Wraps every Numba dispatcher attribute of ``KERNEL_MODULES`` while active."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.by_name: Counter = Counter()
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, fn, name: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.seconds += dt
                self.calls += 1
                self.by_name[name] += dt
        return timed

    def __enter__(self) -> KernelTimer:
        for module in KERNEL_MODULES:
            for name, value in list(vars(module).items()):
                if isinstance(value, CPUDispatcher):
                    self._saved.append((module, name, value))
                    setattr(module, name, self._wrap(value, name))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, value in self._saved:
            setattr(module, name, value)
        self._saved.clear()


class CountingOps:
    """A proxy of the model's ``Ops`` counting its method calls."""

    def __init__(self, ops) -> None:
        self._ops = ops
        self.calls: Counter = Counter()

    def __getattr__(self, name):
        value = getattr(self._ops, name)
        if not callable(value) or name.startswith("_"):
            return value

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return value(*args, **kwargs)
        return counted


def load_model(path, quantization: str, ops: CpuOps) -> LlamaModel:
    config = load_model_config(path)
    weights = load_checkpoint_weights(path, config, quantization)
    return LlamaModel(config, weights, ops, quantization)


def decode_inputs(model: LlamaModel, batch: int, context: int, rng, query: int = 1):
    """KV caches with ``context`` random cached tokens per sequence and one step of
    ``query`` new tokens per sequence (1: decode; more: a speculative
    verification, every token's logits)."""
    cfg = model.config
    per_seq = (context + query + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = batch * per_seq + 1
    caches = [model.ops.allocate_kv_cache(num_blocks, BLOCK_SIZE, cfg.num_key_value_heads,
                                          cfg.head_dim) for _ in range(cfg.num_hidden_layers)]
    for c in caches:
        c[...] = rng.standard_normal(c.shape, dtype=np.float32) * 0.5
    tables = rng.permutation(num_blocks)[:batch * per_seq].astype(np.int32) \
        .reshape(batch, per_seq)
    positions = np.tile(np.arange(context, context + query, dtype=np.int64), batch)
    seq_of = np.repeat(np.arange(batch), query)
    slots = tables[seq_of, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE \
        + positions % BLOCK_SIZE
    attn = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             seq_lens=np.full(batch, context + query, np.int32),
                             query_start_loc=np.arange(0, batch * query + 1, query,
                                                       dtype=np.int32))
    ids = rng.integers(0, cfg.vocab_size, batch * query).astype(np.int64)
    return ids, positions, attn, caches, np.arange(batch * query, dtype=np.int64)


def measure(model: LlamaModel, batch: int, context: int, steps: int, warmup: int,
            modes: list[str], query: int = 1) -> dict[str, dict]:
    """Each mode's numbers; the modes' steps interleaved (one step of each in
    turn), so that a change of the machine's load hits them alike."""
    rng = np.random.default_rng(0)
    ids, positions, attn, caches, rows = decode_inputs(model, batch, context, rng, query)

    backend = model.ops  # the CpuOps itself (the profiled steps put a counting proxy there)

    def step(mode):
        if backend.fused_decode != mode:  # what KVSERVE_CPU_FUSED_DECODE=mode gives
            backend.fused_decode = mode
            model.choose_decode_path()
        return model.forward(ids, positions, attn, caches, rows)

    for _ in range(warmup):
        for mode in modes:
            step(mode)
    plain = {m: [] for m in modes}
    for _ in range(steps):
        for mode in modes:
            t0 = time.perf_counter()
            step(mode)
            plain[mode].append(time.perf_counter() - t0)
    ops = model.ops
    counting = {m: CountingOps(ops) for m in modes}
    profiled = {m: [] for m in modes}
    overhead = {m: [] for m in modes}
    kernel = {m: [] for m in modes}
    kcalls = {m: [] for m in modes}
    by_name = {m: Counter() for m in modes}
    try:
        with KernelTimer() as timer:
            for _ in range(steps):
                for mode in modes:
                    model.ops = counting[mode]
                    timer.seconds, timer.calls, timer.by_name = 0.0, 0, by_name[mode]
                    t0 = time.perf_counter()
                    step(mode)
                    dt = time.perf_counter() - t0
                    profiled[mode].append(dt)
                    kernel[mode].append(timer.seconds)
                    overhead[mode].append(dt - timer.seconds)
                    kcalls[mode].append(timer.calls)
    finally:
        model.ops = ops
    out = {}
    for m in modes:
        med = {k: statistics.median(v[m]) * 1e3
               for k, v in (("fwd", plain), ("prof", profiled), ("kern", kernel),
                            ("over", overhead))}
        out[m] = {"forward_ms": round(med["fwd"], 3),
                  "forward_ms_min": round(min(plain[m]) * 1e3, 3),
                  "profiled_forward_ms": round(med["prof"], 3),
                  "kernel_ms": round(med["kern"], 3), "overhead_ms": round(med["over"], 3),
                  "overhead_ms_min": round(min(overhead[m]) * 1e3, 3),
                  "op_calls": sum(counting[m].calls.values()) // steps,
                  "op_calls_by_name": {k: v // steps
                                       for k, v in sorted(counting[m].calls.items())},
                  "kernel_calls": int(statistics.median(kcalls[m])),
                  "kernel_ms_by_name": {k: round(v * 1e3 / steps, 3)
                                        for k, v in by_name[m].most_common()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", nargs="+", default=["none", "q4"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--modes", nargs="+", default=["0", "1"],
                    help="KVSERVE_CPU_FUSED_DECODE values: 0 (op path), 1 (fused), layer")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--query", nargs="+", type=int, default=[1],
                    help="new tokens per sequence: 1 a decode step, more a speculative "
                         "verification (every token's logits)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--model", default=None,
                    help="what `kvserve serve --model` takes (default: the default model)")
    args = ap.parse_args()
    path = Path(resolve_model(args.model)) if args.model else ensure_default_model()
    results = []
    for quant in args.quantization:
        ops = CpuOps()
        model = load_model(path, quant, ops)
        for threads in args.threads:
            ops.num_threads = threads
            for batch, query in ((b, q) for b in args.batch for q in args.query):
                load = os.getloadavg()
                rows = measure(model, batch, args.context, args.steps, args.warmup, args.modes,
                               query)
                for mode, numbers in rows.items():
                    row = {"quantization": quant, "threads": threads, "batch": batch,
                           "query": query, "context": args.context, "fused": mode, **numbers,
                           "loadavg_before": [round(x, 2) for x in load],
                           "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
                    results.append(row)
                    print(f"{quant:4} t={threads} b={batch} q={query} fused={mode:5} "
                          f"fwd {row['forward_ms']:7.2f} ms (min {row['forward_ms_min']:7.2f})  "
                          f"kernels {row['kernel_ms']:7.2f}  overhead {row['overhead_ms']:6.2f}"
                          f"  ops {row['op_calls']:4}  kcalls {row['kernel_calls']:4}  "
                          f"load {row['loadavg_after']}", flush=True)
        del model
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
