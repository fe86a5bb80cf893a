#!/usr/bin/env python3
"""A model of one decode step on the GPU, kernel by kernel: what the first GPU run is compared with.

Issue 46 asks for the step's bytes, launches and expected time per kernel on
an H100 and an H200 before anything runs there. This is arithmetic, not a
measurement: for a model's ``config.json``, a batch of ``--batch`` decode
tokens over ``--context`` keys each, in float16 (the GPU backend's dtype)
with a float16 KV cache, it lists every launch of a decode step as
``kvserve.cuda`` makes it (``CudaOps``: Numba kernels; CuPy/cuBLAS for the
products, the LM head and the sampler's argmax) with the bytes it must move
(weights, activations, K/V read and written), and its time on each GPU as

    max(bytes / bandwidth, floor)

- ``bandwidth``: the device-to-device copy rate the lent machines measured
  (``.library/device/KINDS.md``, counting bytes read and written: H100
  about 3.0 TB/s, H200 about 4.3 TB/s);
- ``floor``: the shortest time a kernel launched from a CUDA graph takes,
  ``--floor-us`` (2 us by default: an assumption, not measured here; a
  kernel's launch latency and its tail on a mostly idle GPU).

The sum is the step's expected time; its bytes over the bandwidth the HBM
floor. ``tools/gpu_check.py``'s per-kernel table is what it will meet.

    python tools/gpu_step_model.py                       # the default model
    python tools/gpu_step_model.py --model PATH --batch 32 --context 1024 --out rec.json
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

#: Device-to-device copy rates measured on the lent machines (bytes read +
#: written per second; .library/device/KINDS.md, 2026-11-13 and 2026-11-04).
BANDWIDTH = {"H100": 3.0e12, "H200": 4.3e12}
#: Bytes of a float16 value (weights, activations, KV cache on the GPU).
F16 = 2
#: Keys per split-K partition of the fused decode kernel (``CudaOps``' default).
PARTITION_SIZE = 512


@dataclass
class Kernel:
    """One kind of launch in a decode step: how many, and the bytes each moves."""

    name: str
    what: str
    launches: int
    bytes_each: float

    def seconds(self, bandwidth: float, floor: float) -> float:
        """Expected seconds of all its launches: each max(bytes / bandwidth, floor)."""
        return self.launches * max(self.bytes_each / bandwidth, floor)


def step_kernels(cfg, batch: int, context: int) -> list[Kernel]:
    """The launches of one decode step of ``batch`` tokens, each over
    ``context`` keys, for a ``ModelConfig`` (Llama-family layout; Gemma's
    sandwich and q/k norms ride in the same launches: issue 46, item 5)."""
    B, H, L = batch, cfg.hidden_size, cfg.num_hidden_layers
    nh, nkv, hd, inter = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                          cfg.intermediate_size)
    qkv_width = (nh + 2 * nkv) * hd
    row = B * H * F16  # one [B, H] activation
    kv_read = B * context * nkv * hd * 2 * F16  # every key and value of the context
    parts = -(-context // PARTITION_SIZE)
    kernels = [
        Kernel("embedding", "table rows of the batch's tokens", 1, 2 * row + B * 8),
        Kernel("rms_norm", "the first layer's input norm", 1, 2 * row + H * F16),
        Kernel("linear qkv", "cuBLAS: the fused QKV product", L,
               qkv_width * H * F16 + row + B * qkv_width * F16),
        Kernel("decode_fused", "RoPE + KV write + attention of the GQA group", L,
               kv_read + B * qkv_width * F16 + B * nh * hd * F16),
        Kernel("linear o_proj", "cuBLAS: the output product", L,
               H * nh * hd * F16 + B * nh * hd * F16 + row),
        Kernel("fused_add_rms_norm", "residual add + the MLP's input norm", L,
               4 * row + H * F16),
        Kernel("linear gate_up", "cuBLAS: the fused gate and up product", L,
               2 * inter * H * F16 + row + B * 2 * inter * F16),
        Kernel("silu_and_mul", "the MLP's activation", L, B * 3 * inter * F16),
        Kernel("linear down", "cuBLAS: the down product", L,
               H * inter * F16 + B * inter * F16 + row),
        Kernel("fused_add_rms_norm", "residual add + the next layer's input norm", L - 1,
               4 * row + H * F16),
        Kernel("fused_add_rms_norm", "residual add + the final norm", 1, 4 * row + H * F16),
        Kernel("linear lm_head", "cuBLAS: the vocabulary product", 1,
               cfg.vocab_size * H * F16 + row + B * cfg.vocab_size * F16),
        Kernel("argmax", "CuPy: the greedy sampler", 1, B * cfg.vocab_size * F16 + B * 8),
    ]
    if parts > 1:  # split-K: the partitions' results combined
        kernels.insert(4, Kernel("decode_reduce", "split-K reduction", L,
                                 B * nh * (parts * (hd + 2) * 4 + hd * F16)))
    return kernels


def model_table(cfg, batch: int, context: int, floor: float) -> dict:
    """The step's rows and totals per GPU (``BANDWIDTH``) as a JSON-ready dict."""
    kernels = step_kernels(cfg, batch, context)
    rows = []
    for k in kernels:
        row = asdict(k)
        row["bytes"] = k.launches * k.bytes_each
        for gpu, bandwidth in BANDWIDTH.items():
            row[f"{gpu}_us"] = k.seconds(bandwidth, floor) * 1e6
        rows.append(row)
    total_bytes = sum(r["bytes"] for r in rows)
    totals = {"launches": sum(k.launches for k in kernels), "bytes": total_bytes}
    for gpu, bandwidth in BANDWIDTH.items():
        totals[f"{gpu}_us"] = sum(r[f"{gpu}_us"] for r in rows)
        totals[f"{gpu}_hbm_floor_us"] = total_bytes / bandwidth * 1e6
    return {"batch": batch, "context": context, "floor_us": floor * 1e6,
            "bandwidth_bytes_per_s": BANDWIDTH, "rows": rows, "totals": totals}


def markdown(table: dict) -> str:
    """The table as Markdown (times in us, bytes in MB of 10**6)."""
    lines = ["| kernel | what | launches | MB | H100 (us) | H200 (us) |",
             "|---|---|---|---|---|---|"]
    for r in table["rows"]:
        lines.append(f"| `{r['name']}` | {r['what']} | {r['launches']} | "
                     f"{r['bytes'] / 1e6:.2f} | {r['H100_us']:.1f} | {r['H200_us']:.1f} |")
    t = table["totals"]
    lines.append(f"| **step** | | {t['launches']} | {t['bytes'] / 1e6:.2f} | "
                 f"{t['H100_us']:.1f} | {t['H200_us']:.1f} |")
    lines.append(f"| HBM floor | bytes / bandwidth | | | {t['H100_hbm_floor_us']:.1f} | "
                 f"{t['H200_hbm_floor_us']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="a model folder (config.json); default: the default model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--floor-us", type=float, default=2.0,
                        help="the shortest time of one launch from a graph, in microseconds "
                             "(an assumption)")
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.context < 1 or args.floor_us < 0:
        parser.error("--batch and --context must be at least 1, --floor-us not negative")
    from kvserve.model.loader import load_model_config

    if args.model is None:
        from kvserve.model.default_model import ensure_default_model
        folder = ensure_default_model()
    else:
        folder = Path(args.model)
    cfg = load_model_config(folder)
    table = model_table(cfg, args.batch, args.context, args.floor_us * 1e-6)
    table["model"] = cfg.name
    table["command"] = "python tools/gpu_step_model.py " + " ".join(argv or sys.argv[1:])
    table["note"] = "a model of the step (arithmetic), not a measurement"
    print(f"{cfg.name}: decode step of {args.batch} token(s) over {args.context} keys, "
          f"float16, launch floor {args.floor_us} us\n")
    print(markdown(table))
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
