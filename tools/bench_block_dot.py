#!/usr/bin/env python3
"""Micro-benchmark: block-weight decode products, float dequantization vs Q8 activations.

For the default model's GGUF weights (layer 0's Q4_1 projections and the
Q8_0 tied LM head), at M = 1, 4, 32 rows and 1 and 2 Numba threads, the
best of ``--repeats`` times of

- ``kvserve.cpu.block_ops.linear_blocks`` (float32 activations, blocks
  dequantized to float in registers; what ``CpuOps`` serves today), and
- ``kvserve.cpu.block_dot_ops.linear_blocks_q8`` (activations quantized to
  Q8 blocks, integer dot products; the quantization is inside the timing)
  with the per-row kernels of ``block_dot_kernels`` (``q8_dot_ms``), and
- the same with the panels of ``kvserve.cpu.panel_kernels`` (``q8_panels_ms``;
  the weight's packing is outside the timing, as the server packs once),
  only on a CPU with their dot product (AVX512-VNNI; AVX2 for q4 weights),

with ``os.getloadavg()`` before and after each row (the 2-core machine is
shared). Also the error of the Q8 path against the float one on the same
activations. Writes JSON (``--out``) and prints a Markdown table.

``--quality`` instead runs ``tools/quality.py --schemes q4`` twice in this
process, the second time with ``block_ops.linear_blocks`` replaced by the
Q8 path for every row count (prefill included, as llama.cpp does), and
adds both tables to the JSON. No engine or model file is changed.

    python tools/bench_block_dot.py
    python tools/bench_block_dot.py --quality --window 256
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numba
import numpy as np

from kvserve.cpu import block_dot_kernels as bdk
from kvserve.cpu import block_dot_ops as bdo
from kvserve.cpu import block_ops as bo
from kvserve.cpu import panel_kernels as pk
from kvserve.cpu.kernels import CHEAP_PARALLEL_REGIONS
from kvserve.cpu.parallel import PARALLEL_MIN_MACS, parallel_chunks
from kvserve.model import ggml_blocks as gb

REPO = Path(__file__).resolve().parents[1]
GGUF = Path.home() / ".cache/kvserve/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
#: (label, GGUF tensors stacked along N): the brief's shapes and the fused ones the model runs.
PRODUCTS = [
    ("o_proj 576x576", ["blk.0.attn_output.weight"]),
    ("qkv fused 960x576", ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"]),
    ("up 1536x576", ["blk.0.ffn_up.weight"]),
    ("gate_up fused 3072x576", ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]),
    ("down 576x1536", ["blk.0.ffn_down.weight"]),
    ("lm_head 49152x576", ["token_embd.weight"]),
]


def load_weights(path: Path) -> dict[str, gb.BlockQuantizedWeight]:
    import gguf

    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type.name in gb.BLOCK_KINDS:
            shape = tuple(int(s) for s in reversed(t.shape))
            out[t.name] = gb.from_gguf_bytes(np.asarray(t.data), t.tensor_type.name, shape).map(
                np.ascontiguousarray)
    return out


def best_ms(fn, repeats: int, budget_s: float) -> float:
    fn()  # compile / warm caches
    best, start = float("inf"), time.perf_counter()
    for i in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if i >= 2 and time.perf_counter() - start > budget_s:
            break
    return best * 1e3


def bench(args: argparse.Namespace) -> dict:
    weights = load_weights(Path(args.gguf))
    rng = np.random.default_rng(0)
    rows = []
    for label, names in PRODUCTS:
        w = gb.concat_rows([weights[n] for n in names]) if len(names) > 1 else weights[names[0]]
        n, k = w.shape
        for m in args.rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            y_float = bo.linear_blocks(x, w, num_threads=1)
            pk.HAS_PANELS = pk.HAS_Q8_PANELS = False  # the per-row kernels
            y_q8 = bdo.linear_blocks_q8(x, w, num_threads=1)
            err = float(np.abs(y_q8 - y_float).max())
            panels = (pk.CPU_DOT == "vnni" or pk.CPU_DOT and w.kind == "q4") \
                and n % pk.LANES == 0
            for threads in args.threads:
                load_before = os.getloadavg()
                f_ms = best_ms(lambda: bo.linear_blocks(x, w, num_threads=threads),
                               args.repeats, args.budget)
                pk.HAS_PANELS = pk.HAS_Q8_PANELS = False
                q_ms = best_ms(lambda: bdo.linear_blocks_q8(x, w, num_threads=threads),
                               args.repeats, args.budget)
                pk.HAS_PANELS, pk.HAS_Q8_PANELS = pk.CPU_DOT is not None, pk.CPU_DOT == "vnni"
                p_ms = best_ms(lambda: bdo.linear_blocks_q8(x, w, num_threads=threads),
                               args.repeats, args.budget) if panels else None
                row = {"product": label, "ggml_type": w.ggml_type, "N": n, "K": k, "M": m,
                       "threads": threads,
                       "parallel": bool(parallel_chunks((m, k), n, threads)),
                       "float_dequant_ms": round(f_ms, 4), "q8_dot_ms": round(q_ms, 4),
                       "q8_panels_ms": None if p_ms is None else round(p_ms, 4),
                       "speedup": round(f_ms / q_ms, 2),
                       "max_abs_err_vs_float": err,
                       "rel_err_vs_float": err / float(np.abs(y_float).max()),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
                rows.append(row)
                print(f"{label:24s} M={m:2d} t={threads} float {f_ms:8.3f} ms  q8 {q_ms:8.3f} ms "
                      f" panels {p_ms or float('nan'):8.3f} ms"
                      f" x{f_ms / q_ms:5.2f}  rel err {row['rel_err_vs_float']:.2e}  "
                      f"load {load_before[0]:.2f}", file=sys.stderr, flush=True)
    return {"rows": rows}


def quality(args: argparse.Namespace) -> dict:
    """tools/quality.py --schemes q4, plain and with the Q8 activation path."""
    sys.path.insert(0, str(REPO / "tools"))
    import quality as quality_tool

    results = {}
    original = bo.linear_blocks

    def q8_everywhere(x, w, bias=None, num_threads=None):
        return bdo.linear_blocks_q8(x, w, bias, num_threads)

    for name, fn in (("q4", original), ("q4_q8_activations", q8_everywhere)):
        bo.linear_blocks = fn
        out = Path(args.quality_dir) / f"quality-{name}.json"
        argv = ["quality.py", "--schemes", "q4", "--window", str(args.window),
                "--max-tokens", str(args.max_tokens), "--out", str(out)]
        saved, sys.argv = sys.argv, argv
        load_before = os.getloadavg()
        try:
            t = time.perf_counter()
            quality_tool.main()
            seconds = time.perf_counter() - t
        finally:
            sys.argv = saved
            bo.linear_blocks = original
        results[name] = {"table": json.loads(out.read_text())["rows"], "seconds": round(seconds, 1),
                         "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    return results


def machine() -> dict:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not flags:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        model = platform.processor()
    import llvmlite.binding as llvm

    return {"cpu": model, "llvm_cpu": llvm.get_host_cpu_name(),
            "isa": {f: f" {f}" in flags for f in ("avx2", "fma", "avx512f", "avx512_vnni",
                                                  "avx_vnni")},
            "block_dot_avx2_intrinsics": bdk.HAS_AVX2,
            # NUMBA_CPU_NAME / _FEATURES compile for another CPU than the host's
            "numba_target": {"cpu_name": numba.config.CPU_NAME,
                             "cpu_features": numba.config.CPU_FEATURES},
            "panel_dot": pk.CPU_DOT, "panel_lanes": pk.LANES, "cores": os.cpu_count(),
            "numba": numba.__version__, "numba_threads": numba.config.NUMBA_NUM_THREADS,
            "threading_layer_cheap_regions": CHEAP_PARALLEL_REGIONS,
            "parallel_min_macs": PARALLEL_MIN_MACS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default=str(GGUF))
    p.add_argument("--rows", type=int, nargs="*", default=[1, 4, 32])
    p.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--budget", type=float, default=1.5, help="seconds per timing at most")
    p.add_argument("--out", default=str(REPO / "docs/benchmarks/2026-12-02-block-dot.json"))
    p.add_argument("--quality", action="store_true", help="also run tools/quality.py twice")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--quality-dir", default="/tmp")
    args = p.parse_args()
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc["machine"] = machine()
    if args.quality:
        doc["quality"] = quality(args)
        doc["quality_args"] = {"window": args.window, "max_tokens": args.max_tokens}
    else:
        doc.update(bench(args))
        doc["args"] = {k: v for k, v in vars(args).items() if k not in ("out", "quality_dir")}
    doc["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    if "rows" in doc:
        print("| product | M | threads | float ms | q8 ms | q8 panels ms | speedup | rel err "
              "| load |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in doc["rows"]:
            panels = r.get("q8_panels_ms")
            print(f"| {r['product']} | {r['M']} | {r['threads']} | {r['float_dequant_ms']:.3f} | "
                  f"{r['q8_dot_ms']:.3f} | {'-' if panels is None else f'{panels:.3f}'} | "
                  f"{r['speedup']:.2f} | {r['rel_err_vs_float']:.1e} | "
                  f"{r['loadavg_before'][0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
