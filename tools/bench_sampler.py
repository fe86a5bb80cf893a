"""Milliseconds per ``kvserve.model.sampler.sample`` call, batched vs the old per-row sampler.

For R rows of V float32 logits (standard normal x 3, a new block each call;
the copy is not timed) and four cases: greedy; temperature 0.8 alone;
temperature 0.8 / top_p 0.95; the same plus repetition 1.1, presence 0.5
and frequency 0.3 penalties over a 200-token prompt and a 200-token output
history per row. Prints the median over ``--iters`` calls (one untimed
warm-up call first) as a Markdown table, with the load average before.

The old column runs ``src/model/sampler.py`` as of ``--old-rev`` (the last
per-row sampler by default), loaded from ``git show`` into a temporary
module; it is left out, with a note, when git or that revision is missing.

Usage::

    python tools/bench_sampler.py                       # R in 1 8 32 64, V 49152
    python tools/bench_sampler.py --rows 64 --iters 50 --old-iters 3
    python tools/bench_sampler.py --no-old
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

from kvserve.core.sampling_params import SamplingParams
from kvserve.model import sampler as new_sampler

REPO = Path(__file__).resolve().parents[1]
#: Commit of the last per-row sampler (60865b6, "Sampler: top-p before min-p ...").
OLD_REV = "60865b6"

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_p": dict(temperature=0.8, top_p=0.95),
    "top_p+penalties": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=0.3),
}


def load_old(rev: str) -> tuple[ModuleType | None, str]:
    """The sampler module at ``rev``, or (None, why not)."""
    try:
        source = subprocess.run(["git", "show", f"{rev}:src/model/sampler.py"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, f"old sampler not loaded (git show {rev}: {exc})"
    path = Path(tempfile.mkdtemp(prefix="kvserve-old-sampler-")) / "old_sampler.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("kvserve_old_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module, f"old = src/model/sampler.py at {rev}"


def make_states(module: ModuleType, rows: int, vocab: int, case: dict, history: int,
                seed: int) -> list:
    rng = np.random.default_rng(seed)
    states = []
    for r in range(rows):
        params = SamplingParams(seed=seed + r, max_tokens=None, **case)
        prompt = rng.integers(0, vocab, history).tolist()
        output = rng.integers(0, vocab, history).tolist()
        states.append(module.SamplingState.create(params, prompt, output, (2,),
                                                  np.random.default_rng(seed)))
    return states


def time_calls(module: ModuleType, rows: int, vocab: int, case: dict, iters: int,
               history: int, seed: int) -> float:
    """Median milliseconds of ``module.sample`` over ``iters`` calls."""
    rng = np.random.default_rng(seed)
    states = make_states(module, rows, vocab, case, history, seed)
    blocks = [(rng.standard_normal((rows, vocab)) * 3).astype(np.float32) for _ in range(2)]
    module.sample(blocks[0].copy(), states)  # warm-up (builds lazy state)
    times = []
    for i in range(iters):
        logits = blocks[i % 2].copy()
        start = time.perf_counter()
        module.sample(logits, states)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=20, help="timed calls per cell (new)")
    parser.add_argument("--old-iters", type=int, default=5, help="timed calls per cell (old)")
    parser.add_argument("--history", type=int, default=200, help="prompt and output tokens")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--old-rev", default=OLD_REV, help="git revision of the old sampler")
    parser.add_argument("--no-old", action="store_true", help="time the new sampler only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    old, note = (None, "old column skipped (--no-old)") if args.no_old else load_old(args.old_rev)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"V = {args.vocab}, median of {args.iters} (new) / {args.old_iters} (old) calls; "
          f"{note}; load average {load[0]:.2f} on {os.cpu_count()} CPUs" if load else note)
    print()
    print("| case | rows | old ms | new ms | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name in args.cases:
        for rows in args.rows:
            new_ms = time_calls(new_sampler, rows, args.vocab, CASES[name], args.iters,
                                args.history, args.seed)
            if old is None:
                print(f"| {name} | {rows} | - | {new_ms:.2f} | - |", flush=True)
                continue
            old_ms = time_calls(old, rows, args.vocab, CASES[name], args.old_iters,
                                args.history, args.seed)
            print(f"| {name} | {rows} | {old_ms:.2f} | {new_ms:.2f} | {old_ms / new_ms:.1f}x |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
