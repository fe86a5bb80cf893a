"""``kvserve warmup``: start the engine of these flags once and stop it, so
that a later ``serve`` or ``generate`` with the same flags starts from the
compiled-kernel cache."""

from __future__ import annotations

import argparse
import asyncio
import time

from kvserve.cli.engine_args import ENGINE_GROUPS, add_engine_args
from kvserve.cli.engine_config import settled_config
from kvserve.cli.errors import StartupError, die
from kvserve.cli.launch import run_loop, start_engine
from kvserve.cli.model_arg import require_model_folder
from kvserve.cli.parsing import argument_groups

HELP = ("load the model and compile its kernels for these flags, then exit: a later serve or "
        "generate with the same flags starts from the compiled cache")


def configure(parser: argparse.ArgumentParser) -> None:
    """``warmup``'s flags: the engine's, as ``serve`` and ``generate`` take them."""
    add_engine_args(argument_groups(parser, ENGINE_GROUPS), log_level="info")


def run(args: argparse.Namespace) -> int:
    """Run ``kvserve warmup``; returns the exit status."""
    return run_loop(_warmup(args))


async def _warmup(args: argparse.Namespace) -> int:
    """``kvserve warmup``: start the engine of these flags (loading the
    weights compiles and caches every kernel they use, ``startup_step``
    lines), stop it, and print the seconds it took."""
    if args.model is not None:
        require_model_folder(args.model)
    t0 = time.monotonic()
    try:
        engine_config = await asyncio.to_thread(settled_config, args)
        engine = await start_engine(engine_config, stats_interval=0)
    except StartupError as exc:
        die(str(exc))
    seconds = time.monotonic() - t0
    await engine.shutdown()
    print(f"kvserve warmup: the engine of these flags started in {seconds:.1f} s; its "
          "compiled kernels are cached for the next start")
    return 0
