"""Starting an engine from the command line: the first two log lines (the
version and the non-default options), the event loop, and the engine's
start with the errors a user's settings cause as one line."""

from __future__ import annotations

import argparse
import asyncio

import structlog

from kvserve.cli.errors import StartupError
from kvserve.cli.parsing import kvserve_version
from kvserve.config import EngineConfig

log = structlog.get_logger("kvserve.cli")


def non_default_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The options of ``args`` that differ from ``parser``'s defaults, by
    destination name, as vLLM's ``non-default args`` line shows them; the
    API key hidden, positional arguments (the prompt) left out. Where two
    flags write one destination (``-v`` and ``--log-level``), the first's
    default counts, as in argparse."""
    changed, seen = {}, set()
    for action in parser._actions:
        if (not action.option_strings or action.default is argparse.SUPPRESS
                or action.dest in seen or not hasattr(args, action.dest)):
            continue
        seen.add(action.dest)
        default = action.default
        if isinstance(default, str) and action.type is not None:
            default = action.type(default)  # argparse converts string defaults too
        value = getattr(args, action.dest)
        if value != default:
            changed[action.dest] = "<hidden>" if action.dest == "api_key" else value
    return changed


def log_start(changed: dict) -> None:
    """The first two lines of a start, as vLLM's: the version and the
    options that differ from the defaults (``non_default_args``)."""
    version = kvserve_version()
    log.info("version", version=version, message=f"kvserve {version}")
    log.info("non_default_args", args=changed, message=f"non-default args: {changed}")


def run_loop(coro):
    """Run ``coro`` to its end on uvloop when it is installed, else asyncio's loop."""
    try:
        import uvloop  # lazy: optional, and only the commands that run a loop need it
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def start_engine(config: EngineConfig, *args, **kwargs):
    """``AsyncEngine.start``, with the errors a user's settings cause at load
    time (no such file, a model the settings cannot serve, no backend) as a
    ``StartupError`` (one line) instead of a traceback."""
    # lazy: the engine loads NumPy and the backends (after the thread pools' environment)
    from kvserve.engine import AsyncEngine
    from kvserve.model.backend import BackendUnavailable

    try:
        return await AsyncEngine.start(config, *args, **kwargs)
    except (FileNotFoundError, ValueError, BackendUnavailable) as exc:
        raise StartupError(str(exc)) from None


async def refuse_unfit_max_model_len(args: argparse.Namespace, engine) -> None:
    """Shut ``engine`` down and raise ``StartupError`` when it serves fewer
    tokens than ``--max-model-len`` asked for."""
    asked, served = args.max_model_len, getattr(engine, "max_model_len", None)
    if asked is None or served is None or served >= asked:
        return
    await engine.shutdown()
    raise StartupError(f"--max-model-len {asked} does not fit: the KV cache holds "
                       f"{served} tokens; give --max-model-len {served} or less, or more "
                       "memory (--gpu-memory-utilization, --kv-cache-memory)")
