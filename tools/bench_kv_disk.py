#!/usr/bin/env python3
"""One KV block read from the disk tier against the same block recomputed,
for the default model (issue 31): is a disk hit worth it?

1. Reading: ``--blocks`` blocks of the default model's layout (16 tokens, all
   layers) written by ``DiskTier`` to a folder under ``--dir``, then read back
   by ``DiskTier.read`` (checks included): from the page cache, and again
   after dropping each file from it (``posix_fadvise(DONTNEED)`` on that file
   only). Float32 blocks and int8 blocks (codes with their scales).
2. Recomputing: an engine without prefix caching prefills prompts of 17 and
   113 tokens (1 and 7 blocks + the last token), ``--trials`` times each
   after a warm-up; the ``forward`` phase seconds of each step, from
   ``/metrics``. One block alone costs the 17-token step; inside a longer
   prefill, the difference divided by 6. Both ``--kv-cache-dtype`` values.

Medians. Prints one JSON record (also to ``--out``) with the load average.

    python tools/bench_kv_disk.py --out docs/benchmarks/2026-12-02-kv-disk.json
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

BLOCK = 16


def read_seconds(shape, dtype, data, blocks: int, directory: str) -> dict:
    """Median seconds of ``DiskTier.read`` from the page cache and after
    dropping each file from it, and the file's bytes."""
    from kvserve.kv_offload.disk_tier import DiskTier

    folder = tempfile.mkdtemp(dir=directory)
    tier = DiskTier(folder, shape, dtype, "bench", 2**40)
    hashes = [os.urandom(32) for _ in range(blocks)]
    for block_hash in hashes:
        tier.write(block_hash, data)
    cached, dropped = [], []
    for block_hash in hashes:
        t0 = time.perf_counter()
        tier.read(block_hash)
        cached.append(time.perf_counter() - t0)
    for block_hash in hashes:
        fd = os.open(tier.path_of(block_hash), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        t0 = time.perf_counter()
        tier.read(block_hash)
        dropped.append(time.perf_counter() - t0)
    tier.close()
    shutil.rmtree(folder)
    return {"file_bytes": tier.file_bytes, "read_page_cache_s": statistics.median(cached),
            "read_dropped_s": statistics.median(dropped)}


async def recompute_seconds(model: str, kv_cache_dtype: str, trials: int) -> dict:
    """Median forward seconds of a 17- and a 113-token prefill step."""
    from kvserve.actors.messages import GenerateRequest
    from kvserve.config import CacheConfig, EngineConfig
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine import AsyncEngine
    from kvserve.observability.metrics import parse_metrics_text

    engine = await AsyncEngine.start(EngineConfig(model=model, cache=CacheConfig(
        kv_cache_memory=64 * 2**20, enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype)))

    def forward() -> float:
        samples = parse_metrics_text(engine.metrics.render().decode())
        return sum(v for labels, v in samples["kvserve:step_phase_seconds_sum"]
                   if labels.get("phase") == "forward")

    ids = engine.tokenizer.encode("word " * 400)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    result, count = {}, 0
    try:
        for blocks in (1, 7):
            times = []
            for trial in range(trials + 1):
                count += 1
                before = forward()
                async for _ in engine.generate(GenerateRequest(
                        f"b{count}", params, time.monotonic(),
                        prompt_token_ids=tuple(ids[:BLOCK * blocks + 1]))):
                    pass
                await asyncio.sleep(0.05)  # the step's statistics reach /metrics
                if trial:  # the first is a warm-up
                    times.append(forward() - before)
            result[blocks] = statistics.median(times)
    finally:
        await engine.shutdown()
    return {"prefill_17_tokens_s": result[1], "prefill_113_tokens_s": result[7],
            "per_block_in_prefill_s": (result[7] - result[1]) / 6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from kvserve.model.default_model import ensure_default_model
    from kvserve.model.kv_quant import quantize
    from kvserve.model.loader import load_model_config

    model = ensure_default_model()
    config = load_model_config(model)
    shape = (config.num_hidden_layers, 2, BLOCK, config.num_key_value_heads, config.head_dim)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    from kvserve.bench.replay import git_info

    record = {"command": "python tools/bench_kv_disk.py", **git_info(), "blocks": args.blocks,
              "trials": args.trials, "load_before": os.getloadavg()[0], "rows": []}
    for name, data in (("float32", x), ("int8", quantize(x))):
        row = {"kv_cache_dtype": "auto" if name == "float32" else "int8", "block": name}
        row.update(read_seconds(data.shape, data.dtype, data, args.blocks, args.dir))
        row.update(asyncio.run(recompute_seconds(str(model), row["kv_cache_dtype"],
                                                 args.trials)))
        record["rows"].append(row)
    record["load_after"] = os.getloadavg()[0]
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
