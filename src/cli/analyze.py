"""``kvserve analyze LOGFILE``: a kvserve JSON log's phase breakdown,
percentiles, bottleneck diagnosis, Markdown report and plots (the log
analyser, ``kvserve.observability.analysis``; its plots need the bench extra)."""

from __future__ import annotations

import argparse
import sys

HELP = ("analyse a kvserve JSON log: phase breakdown, percentiles, bottleneck diagnosis, "
        "Markdown report and plots")


def configure(parser: argparse.ArgumentParser, with_arguments: bool = True) -> None:
    """``analyze``'s flags, which the analyser declares; ``with_arguments``
    False leaves them out (another command is parsed: the analyser stays
    unimported)."""
    if with_arguments:
        # lazy: the log analyser is tooling, kept off the serving path
        from kvserve.observability.analysis import add_arguments

        add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``kvserve analyze``; a missing bench extra (plotting) is one line
    and exit status 2."""
    try:
        # lazy: the log analyser is tooling, kept off the serving path
        from kvserve.observability.analysis import run as run_analysis

        return run_analysis(args)
    except ModuleNotFoundError as exc:  # the bench extra is not installed
        print(f"kvserve analyze: error: {exc.name} is missing; install the bench "
              "extra: pip install 'kvserve[bench]' (or pass --no-plots)", file=sys.stderr)
        return 2
