"""``kvserve bench``: replay a JSONL trace against a server (the replay
client, ``kvserve.bench.replay``; it needs the bench extra)."""

from __future__ import annotations

import argparse
import sys

HELP = "replay a JSONL trace against a server (tools/replay.py; see tools/README.md)"


def configure(parser: argparse.ArgumentParser, with_arguments: bool = True) -> None:
    """``bench``'s flags, which the replay client declares; ``with_arguments``
    False leaves them out (another command is parsed: the client, which
    loads NumPy, stays unimported)."""
    if with_arguments:
        # lazy: the replay client is tooling that loads NumPy, kept off the serving path
        from kvserve.bench.replay import add_arguments

        add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``kvserve bench``; a missing bench extra is one line and exit status 2."""
    try:
        # lazy: the replay client is tooling that loads NumPy, kept off the serving path
        from kvserve.bench.replay import run_cli

        return run_cli(args)
    except ModuleNotFoundError as exc:  # the bench extra is not installed
        print(f"kvserve bench: error: {exc.name} is missing; install the bench "
              "extra: pip install 'kvserve[bench]'", file=sys.stderr)
        return 2
