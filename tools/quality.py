#!/usr/bin/env python3
"""Quality gate: perplexity and greedy agreement of quantization schemes against float.

For the reference (``--quantization none``) and each ``--schemes`` entry, in
one process and one after the other: perplexity of ``--text`` (default: the
shipped public-domain text, ``tests/data/public_domain_en.txt``) in windows
of ``--window`` tokens, and teacher-forced greedy agreement with the
reference's ``--max-tokens`` greedy tokens on ``--prompts`` (a file, one
prompt per line; default ``kvserve.testing.quality.DEFAULT_PROMPTS``), and
the decode match: how much of those tokens the scheme's own greedy decode
reproduces before it diverges (the measure that sees ``w4a8``'s Q8
activations, which only decode steps take). Prints a
Markdown table last; ``--out`` writes it as JSON. See ``kvserve.testing.quality``
for the definitions.

A scheme ``QUANT:KV`` also sets ``--kv-cache-dtype KV`` (``none:int8``: float
weights over an int8 KV cache; ``w4a8:int8``: both); the reference stays
``none`` over the float cache.

    python tools/quality.py                              # none vs int8, w8a8
    python tools/quality.py --schemes int8 --window 256 --out results/quality.json
    python tools/quality.py --schemes none:int8 q4:int8 w4a8 w4a8:int8
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.testing.quality import (DEFAULT_PROMPTS, agreement, decode_match, greedy_tokens,
                                     perplexity, start_engine)

REPO = Path(__file__).resolve().parents[1]


def engine_config(args: argparse.Namespace, scheme: str) -> EngineConfig:
    """The engine of one ``--schemes`` entry: ``QUANT`` or ``QUANT:KV_CACHE_DTYPE``."""
    quantization, _, kv_dtype = scheme.partition(":")
    return EngineConfig(model=args.model, backend=args.backend, quantization=quantization,
                        cache=CacheConfig(kv_cache_memory=256 * 2**20,
                                          kv_cache_dtype=kv_dtype or "auto"),
                        scheduler=SchedulerConfig(max_num_batched_tokens=args.window))


async def evaluate(args: argparse.Namespace) -> list[dict]:
    prompts_text = (Path(args.prompts).read_text().splitlines() if args.prompts
                    else list(DEFAULT_PROMPTS))
    rows, reference = [], None
    for scheme in ["none", *args.schemes]:
        engine = await start_engine(engine_config(args, scheme))
        try:
            tokenizer = engine.tokenizer
            text_ids = tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
            prompts = [tokenizer.encode(p) for p in prompts_text if p.strip()]
            ppl = await perplexity(engine, text_ids, args.window)
            row = {"scheme": scheme, "weights_bytes": engine.core.runner.model.weights_nbytes,
                   "perplexity": ppl.value, "tokens_scored": ppl.num_tokens,
                   "seconds": round(ppl.seconds, 2)}
            if reference is None:
                reference = await greedy_tokens(engine, prompts, args.max_tokens)
                row["agreement"] = row["decode_match"] = 1.0
            else:
                row["agreement"] = asdict(await agreement(engine, prompts, reference))["value"]
                row["decode_match"] = (await decode_match(engine, prompts, reference)).value
            rows.append(row)
            print(f"{scheme}: {row}", file=sys.stderr, flush=True)
        finally:
            await engine.shutdown()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the default model)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--schemes", nargs="*", default=["int8", "w8a8", "q4"])
    p.add_argument("--text", default=str(REPO / "tests" / "data" / "public_domain_en.txt"))
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prompts", default=None)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.model is None:
        from kvserve.model.default_model import ensure_default_model
        args.model = str(ensure_default_model())
    rows = asyncio.run(evaluate(args))
    base = rows[0]["perplexity"]
    print(f"\nload average: {os.getloadavg()[0]:.2f}; text {Path(args.text).name}, window "
          f"{args.window}; agreement over {args.max_tokens} greedy tokens per prompt\n")
    print("| scheme | weights MiB | perplexity | vs none | greedy agreement | decode match |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['scheme']} | {r['weights_bytes'] / 2**20:.1f} | {r['perplexity']:.3f} | "
              f"{r['perplexity'] / base - 1:+.2%} | {r['agreement']:.3f} | "
              f"{r['decode_match']:.3f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
