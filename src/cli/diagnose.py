"""``kvserve diagnose --url URL``: a running server's bottleneck from two
scrapes of its ``/metrics`` (the rules of ``kvserve.observability.diagnosis``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from kvserve.cli.argtypes import POSITIVE_FLOAT
from kvserve.cli.parsing import Flag, add_arguments

HELP = "diagnose a running server's bottleneck from two scrapes of its /metrics"

DIAGNOSE_FLAGS: tuple[Flag, ...] = (
    (("--url",), dict(required=True, help="server base URL (or the /metrics URL)")),
    (("--interval",), dict(type=POSITIVE_FLOAT, default=10.0,
                           help="seconds between the two scrapes")),
    (("--json",), dict(action="store_true", help="print JSON")),
)


def configure(parser: argparse.ArgumentParser, with_targets: bool = True) -> None:
    """``diagnose``'s flags; ``with_targets``: also the latency targets
    (``kvserve.observability.analysis``), which only this command needs."""
    add_arguments(parser, DIAGNOSE_FLAGS)
    if with_targets:
        # lazy: the log analyser is tooling, kept off the serving path
        from kvserve.observability.analysis import add_target_arguments

        add_target_arguments(parser)


def _get_text(url: str, timeout: float = 10.0) -> str:
    """The body of ``GET url`` (stdlib only: the server installs no HTTP
    client); ``OSError`` for a refused connection or an error status."""
    from urllib.request import urlopen  # lazy: http.client, for this command alone

    with urlopen(url, timeout=timeout) as response:  # noqa: S310 - a URL the user gave
        return response.read().decode("utf-8")


def run(args: argparse.Namespace) -> int:
    """Run ``kvserve diagnose``: two scrapes, the rules of ``kvserve.observability.diagnosis``."""
    # lazy: the diagnosis rules and prometheus_client's parser, for this command alone
    from kvserve.observability.diagnosis import busy_summary, diagnose, features_from_scrapes
    from kvserve.observability.metrics import parse_metrics_text

    url = args.url.rstrip("/")
    if not url.endswith("/metrics"):
        url += "/metrics"
    print(f"Scraping {url} now and again in {args.interval:g} s...", file=sys.stderr,
          flush=True)
    try:
        before = parse_metrics_text(_get_text(url))
        time.sleep(args.interval)
        after = parse_metrics_text(_get_text(url))
    except OSError as exc:  # urllib's URLError and HTTPError are OSErrors
        print(f"kvserve diagnose: error: cannot scrape {url}: {exc}", file=sys.stderr)
        return 2
    features = features_from_scrapes(before, after, seconds=args.interval)
    features.ttft_target, features.tpot_target = args.ttft_target, args.tpot_target
    verdicts = diagnose(features)
    if args.json:
        print(json.dumps({"bottleneck": verdicts[0].kind if verdicts else None,
                          "verdicts": [v.to_dict() for v in verdicts],
                          "features": asdict(features)}, indent=2, default=str))
        return 0
    print(f"Window of {args.interval:g} s: {features.num_requests} requests finished, "
          f"{features.preemptions} preemptions.")
    if not verdicts:
        print(busy_summary(features, args.interval)
              or "No bottleneck: the server was idle in this window.")
    for verdict in verdicts:
        print()
        print(verdict.markdown())
    return 0
