#!/usr/bin/env python3
"""Greedy tokens of kvserve and of llama.cpp's server on the same GGUF, compared.

For each prompt (token ids from the GGUF's own tokenizer, no template, no
BOS unless the tokenizer adds one), both engines decode ``--tokens`` tokens
greedily with EOS ignored: llama.cpp's ``llama-server`` (``/completion``
with the prompt as token ids, top-k 1, ``n_probs`` 2 for its top-2 log
probabilities) and kvserve in-process (``build_engine_core`` with its
default scheme for a GGUF, ``logprobs`` 2). The sequences must be equal up to
the first position where llama.cpp's own top-2 margin (in log probability)
is below ``--margin``: a near-tie may flip between two correct
implementations whose float sums differ in order, and after a flip the texts
go their own ways. Exit status 1 when a sequence diverges earlier.

Usage::

    .venv/bin/python tools/tokens_vs_llamacpp.py /tmp/models/synthetic-1b-Q4_K_M.gguf \\
        --out docs/benchmarks/2026-12-06-gguf-kquants-1b-tokens.json
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import json
import shlex
import sys
import urllib.request
from pathlib import Path

PROMPTS = ("The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a land far away,", "The quick brown fox jumps over")


def llamacpp_tokens(binary: Path, gguf: Path, prompts: list[list[int]], n: int) -> list[dict]:
    """``{"tokens", "margins"}`` per prompt from ``llama-server`` (2 threads)."""
    from kvserve.bench.server import ServerProcess

    command = (f"{shlex.quote(str(binary))} -m {shlex.quote(str(gguf))} -t 2 -c 2048 "
               "--host 127.0.0.1 --port {port}")
    out = []
    with ServerProcess(command=command, health_paths=("/health",)) as server:
        for ids in prompts:
            body = {"prompt": ids, "n_predict": n, "temperature": 0, "n_probs": 2,
                    "samplers": ["top_k"], "top_k": 1, "cache_prompt": False,
                    "return_tokens": True, "post_sampling_probs": False}
            request = urllib.request.Request(server.base_url + "/completion",
                                             json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                reply = json.load(response)
            tops = [[t["logprob"] for t in p.get("top_logprobs", [])]
                    for p in reply.get("completion_probabilities", [])]
            out.append({"tokens": reply["tokens"],
                        "margins": [round(t[0] - t[1], 4) if len(t) > 1 else None
                                    for t in tops]})
    return out


def kvserve_tokens(model: str, prompts: list[list[int]], n: int) -> list[dict]:
    """``{"tokens", "margins"}`` per prompt from kvserve in-process."""
    from kvserve.cli import default_quantization
    from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvserve.core.request import Request
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.model.gguf_model import resolve_model
    from kvserve.startup import build_engine_core

    core = build_engine_core(EngineConfig(
        model=resolve_model(model), quantization=default_quantization("auto", model, "cpu"),
        num_threads=2, cache=CacheConfig(kv_cache_memory=256 * 2**20),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8,
                                  max_model_len=1024, async_scheduling=False)))
    requests = [Request(str(i), list(ids), SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2), eos_token_ids=())
        for i, ids in enumerate(prompts)]
    tops: dict[str, list] = {r.request_id: [] for r in requests}
    for request in requests:
        core.scheduler.add_request(request)
    while core.scheduler.has_unfinished_requests():
        step = core.scheduler.schedule()
        result = core.runner.execute(step)
        for name, entries in result.logprobs.items():
            tops[name] += [[value for _, value in top[:2]] for _, top in entries]
        core.scheduler.update_from_output(step, result.sampled, result.draft_token_ids)
    return [{"tokens": list(r.output_token_ids),
             "margins": [round(t[0] - t[1], 4) for t in tops[r.request_id]]}
            for r in requests]


def compare(llama: dict, kv: dict, margin: float) -> dict:
    """First divergence, and whether llama.cpp's margin there allows it."""
    first = next((i for i, (a, b) in enumerate(zip(llama["tokens"], kv["tokens"])) if a != b),
                 None)
    ok = first is None or (llama["margins"][first] is not None
                           and llama["margins"][first] < margin)
    return {"first_divergence": first, "equal_tokens": len(llama["tokens"]) if first is None
            else first, "llamacpp_margin_there": None if first is None
            else llama["margins"][first], "ok": ok}


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    from kvserve.model.default_model import cache_dir
    from kvserve.model.gguf_model import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--margin", type=float, default=0.05)
    parser.add_argument("--llamacpp-dir", type=Path, default=cache_dir() / "llama.cpp")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    folder = Path(resolve_model(str(args.gguf)))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    llama = llamacpp_tokens(args.llamacpp_dir / "build" / "bin" / "llama-server", args.gguf,
                            prompts, args.tokens)
    kv = kvserve_tokens(str(args.gguf), prompts, args.tokens)
    rows = [{"prompt": p, "prompt_ids": ids, "llamacpp": a, "kvserve": b,
             **compare(a, b, args.margin)}
            for p, ids, a, b in zip(PROMPTS, prompts, llama, kv)]
    result = {"gguf": str(args.gguf), "tokens": args.tokens, "margin": args.margin,
              "prompts": rows, "ok": all(r["ok"] for r in rows)}
    for r in rows:
        print(f"{r['prompt'][:40]!r:44} equal {r['equal_tokens']:2}/{args.tokens}, "
              f"llama.cpp margin at the split {r['llamacpp_margin_there']}, "
              f"{'ok' if r['ok'] else 'DIVERGED ABOVE THE MARGIN'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
