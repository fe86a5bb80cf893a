"""``kvserve plan``: weights, KV cache size and concurrency from
``config.json`` and the safetensors headers, without loading weights."""

from __future__ import annotations

import argparse
import json
import sys

from kvserve.cli.argtypes import POSITIVE_FLOAT, POSITIVE_INT, memory_size
from kvserve.cli.engine_args import DTYPES
from kvserve.cli.model_arg import fetch_default_model
from kvserve.cli.parsing import Flag, add_arguments
from kvserve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, parse_size
from kvserve.core.parallel import parse_partition
from kvserve.kv_format import KV_CACHE_DTYPES

HELP = "print weights, KV cache size and concurrency without loading weights"

#: The model and the request length, first in ``--help``.
MODEL_FLAGS: tuple[Flag, ...] = (
    (("--model",), dict(
        default=None,
        help="checkpoint folder (default: the default model, fetched if needed)")),
    (("--max-model-len",), dict(
        type=POSITIVE_INT, default=None,
        help="request length for the concurrency figure, in tokens "
             "(default: the model's max_position_embeddings)")),
)
#: The memory to plan for: the CPU's KV bytes or a GPU's size (one of them).
MEMORY_FLAGS: tuple[Flag, ...] = (
    (("--kv-cache-memory",), dict(
        type=memory_size, default=None, metavar="SIZE",
        help="CPU backend: bytes for KV blocks, e.g. 1GiB (default 1GiB)")),
    (("--gpu-memory-gib",), dict(
        type=POSITIVE_FLOAT, default=None,
        help="GPU: total GPU memory in GiB, to plan for the cuda backend "
             "(default: none, plan for the CPU backend)")),
)
#: The rest, as ``serve``'s flags of the same names.
PLAN_FLAGS: tuple[Flag, ...] = (
    (("--gpu-memory-utilization",), dict(
        type=POSITIVE_FLOAT, default=None,
        help="GPU: fraction of the GPU memory to use (default 0.9)")),
    (("--dtype",), dict(
        default="auto", choices=DTYPES,
        help="weights and KV dtype, as serve's: auto = float32 on the CPU, "
             "float16 on a GPU")),
    (("--block-size",), dict(
        type=POSITIVE_INT, default=16,
        help="tokens per KV block")),
    (("--kv-cache-dtype",), dict(
        choices=KV_CACHE_DTYPES, default="auto",
        help="as serve's: int8 costs head_dim + 4 bytes per K or V vector")),
    (("--max-num-batched-tokens",), dict(
        type=POSITIVE_INT, default=None,
        help="step token budget, as serve's (default: 128 on the CPU, 2048 on "
             "a GPU): the GPU's activation estimate, and the blocks a "
             "sliding-window layer holds")),
    (("--max-num-seqs",), dict(
        type=POSITIVE_INT, default=64,
        help="GPU: most sequences per step, for the activation estimate")),
    (("-tp", "--tensor-parallel-size"), dict(
        type=POSITIVE_INT, default=1, metavar="T",
        help="as serve's: each layer's heads and MLP columns over T "
             "devices; prints each device's share")),
    (("-pp", "--pipeline-parallel-size"), dict(
        type=POSITIVE_INT, default=1, metavar="P",
        help="as serve's: the layers in P contiguous stages")),
    (("--pp-layer-partition",), dict(
        default=None, metavar="N,N,...",
        help="layers per pipeline stage, e.g. 16,14 (default: vLLM's even split)")),
    (("--json",), dict(
        action="store_true",
        help="print one JSON object")),
)


def configure(parser: argparse.ArgumentParser) -> None:
    """``kvserve plan``: capacity arithmetic from config.json and safetensors headers."""
    add_arguments(parser, MODEL_FLAGS)
    add_arguments(parser.add_mutually_exclusive_group(), MEMORY_FLAGS)
    add_arguments(parser, PLAN_FLAGS)


def run(args: argparse.Namespace) -> int:
    """Run ``kvserve plan``; prints the table (or JSON) and returns the exit
    status (2 with a message on standard error for bad flags or memory that
    holds no KV block)."""
    # lazy: the capacity arithmetic, for this command alone (keeps the others' start light)
    from kvserve.core.plan import format_plan, plan_capacity

    try:
        if args.gpu_memory_utilization is not None and args.gpu_memory_gib is None:
            raise ValueError("--gpu-memory-utilization needs --gpu-memory-gib")
        partition = (None if args.pp_layer_partition is None
                     else parse_partition(args.pp_layer_partition))
        model = args.model
        if model is None:
            model = str(fetch_default_model())
        plan = plan_capacity(
            model, max_model_len=args.max_model_len,
            kv_cache_memory=None if args.kv_cache_memory is None
            else parse_size(args.kv_cache_memory),
            gpu_memory_gib=args.gpu_memory_gib,
            gpu_memory_utilization=args.gpu_memory_utilization or 0.9,
            dtype=None if args.dtype == "auto" else args.dtype,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[
                "cpu" if args.gpu_memory_gib is None else "cuda"],
            max_num_seqs=args.max_num_seqs, kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size, pp_layer_partition=partition)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0
