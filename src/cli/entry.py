"""The ``kvserve`` command itself: its parser of sub-commands (each declared
by its own module) and ``main``, which parses, sets up logging and runs the
sub-command."""

from __future__ import annotations

import argparse
import sys

from kvserve.cli import (analyze, bench, diagnose, fetch_model, generate, plan, serve,
                         warmup)
from kvserve.cli.launch import log_start, non_default_args
from kvserve.cli.parsing import HelpFormatter, Parser, kvserve_version
from kvserve.observability.log import configure_logging
from kvserve.thread_env import apply_thread_pool_env

#: Sub-commands whose arguments live in tooling modules (NumPy, the replay
#: client): those modules are imported only to parse their own command.
TOOL_COMMANDS = ("analyze", "bench")
#: Sub-commands that start an engine: they log the version and the
#: non-default options first.
ENGINE_COMMANDS = ("serve", "generate", "warmup")
#: Each sub-command's ``run(args) -> exit status``.
RUNNERS = {"serve": serve.run, "generate": generate.run, "warmup": warmup.run,
           "fetch-model": fetch_model.run, "plan": plan.run, "diagnose": diagnose.run,
           "analyze": analyze.run, "bench": bench.run}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvserve`` argument parser with its sub-commands.

    ``command``: the sub-command about to be parsed (``main`` passes the
    first word of argv). The arguments of ``analyze`` and ``bench`` are added
    only for that command or for None (every command: docs and tests), so
    ``kvserve serve`` never imports the log analyser or the bench client.
    ``serve`` and ``generate`` list their flags in argument groups
    (``SERVE_GROUPS``), every default shown (``HelpFormatter``)."""
    parser = Parser(prog="kvserve", description="kvserve LLM serving engine",
                    formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvserve {kvserve_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command_parser(name: str, help: str, **kwargs) -> argparse.ArgumentParser:  # noqa: A002
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter,
                              **kwargs)

    serve.configure(command_parser("serve", serve.HELP, usage=serve.USAGE))
    generate.configure(command_parser("generate", generate.HELP, usage=generate.USAGE))
    warmup.configure(command_parser("warmup", warmup.HELP))
    fetch_model.configure(command_parser("fetch-model", fetch_model.HELP))
    plan.configure(command_parser("plan", plan.HELP))
    analyze.configure(command_parser("analyze", analyze.HELP), command in (None, "analyze"))
    diagnose.configure(command_parser("diagnose", diagnose.HELP), command in (None, "diagnose"))
    bench.configure(command_parser("bench", bench.HELP), command in (None, "bench"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvserve`` command; returns the exit status.

    ``serve`` and ``generate`` log the version and the non-default options
    first (``log_start``); every mistake a user can fix ends in one line
    on stderr and exit status 2, not a traceback."""
    apply_thread_pool_env()  # before anything loads NumPy (build_parser does)
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), "")
    parser = build_parser(command)
    args = parser.parse_args(argv)
    configure_logging(getattr(args, "log_format", "auto"), getattr(args, "log_level", "info"))
    if args.command in ENGINE_COMMANDS:
        changed = non_default_args(parser.command_parser(args), args)  # as given
        if args.command == "serve":
            serve.check_replica_flags(args)  # flags that contradict each other: a usage error
        log_start(changed)
    return RUNNERS[args.command](args)
