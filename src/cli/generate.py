"""``kvserve generate``: one prompt's completion, in-process; the answer on
standard output and, at the default ``--log-level error``, nothing else but
errors and one line when the start is slow."""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
import uuid

from kvserve.cli.argtypes import POSITIVE_INT
from kvserve.cli.engine_args import ENGINE_GROUPS, add_engine_args
from kvserve.cli.engine_config import settled_config
from kvserve.cli.errors import StartupError, die
from kvserve.cli.launch import refuse_unfit_max_model_len, run_loop, start_engine
from kvserve.cli.model_arg import require_model_folder
from kvserve.cli.parsing import Flag, add_arguments, argument_groups

HELP = ("generate a completion for one prompt, in-process; prints the answer and nothing else "
        "(errors aside) unless asked with -v or --log-level")
USAGE = "%(prog)s [options] prompt"
#: Seconds a quiet ``kvserve generate`` may start before it says why it waits.
GENERATE_NOTICE_S = 5.0
GENERATE_NOTICE = ("kvserve: loading the model and compiling its kernels (a first start with "
                   "new flags takes minutes; `kvserve warmup` with the same flags does it "
                   "ahead; -v shows the progress)")

#: The one request's sampling (the ``request`` group).
REQUEST_FLAGS: tuple[Flag, ...] = (
    (("--max-tokens",), dict(type=POSITIVE_INT, default=64)),
    (("--temperature",), dict(type=float, default=0.0)),
    (("--raw",), dict(action="store_true", help="no chat template: a plain completion")),
)
#: ``-v``: the start-up lines back, after the engine's observability flags.
VERBOSE_FLAGS: tuple[Flag, ...] = (
    (("-v", "--verbose"), dict(
        dest="log_level", action="store_const", const="info",
        help="log the start-up and statistics lines too (--log-level info; default: only "
             "the answer, and errors)")),
)


def configure(parser: argparse.ArgumentParser) -> None:
    """``generate``'s prompt, its request's sampling, and the engine's flags
    (``--log-level error`` by default, ``-v`` for info)."""
    parser.add_argument("prompt", help="the user message (or, with --raw, the prompt)")
    add_arguments(parser.add_argument_group("request", "the one request's sampling"),
                  REQUEST_FLAGS)
    groups = argument_groups(parser, ENGINE_GROUPS)
    add_engine_args(groups, log_level="error")
    add_arguments(groups["observability"], VERBOSE_FLAGS)


def run(args: argparse.Namespace) -> int:
    """Run ``kvserve generate``; returns the exit status."""
    return run_loop(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    """``kvserve generate``: the answer on stdout, and nothing on stderr at
    its default ``--log-level error`` but errors, and one line
    (``GENERATE_NOTICE``) when the start takes over ``GENERATE_NOTICE_S``."""
    # lazy: the engine's message types bring the core with them; the other commands skip them
    from kvserve.actors.messages import GenerateRequest, RequestFailed, RequestOutput
    from kvserve.core.sampling_params import SamplingParams

    if args.model is not None:
        require_model_folder(args.model)
    quiet = args.log_level in ("error", "critical")
    notice = threading.Timer(GENERATE_NOTICE_S, print, (GENERATE_NOTICE,),
                             {"file": sys.stderr, "flush": True})
    notice.daemon = True
    if quiet:
        notice.start()  # a thread: the start may hold the event loop
    try:
        engine_config = await asyncio.to_thread(settled_config, args)
        engine = await start_engine(engine_config, stats_interval=args.stats_interval)
        await refuse_unfit_max_model_len(args, engine)
    except StartupError as exc:
        die(str(exc))
    finally:
        notice.cancel()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    request = GenerateRequest(
        request_id=uuid.uuid4().hex, sampling_params=params, arrival_time=time.monotonic(),
        prompt=args.prompt if args.raw else None,
        messages=None if args.raw else ({"role": "user", "content": args.prompt},))
    status = 0
    try:
        async for event in engine.generate(request):
            if isinstance(event, RequestFailed):
                print(f"error: {event.message}", file=sys.stderr)
                status = 1
            elif isinstance(event, RequestOutput):
                print(event.text, end="", flush=True)
        print()
    finally:
        await engine.shutdown()
    return status
