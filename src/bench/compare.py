"""Compare two replay result JSONs metric by metric; exit 1 on a regression.

Each compared metric has a direction (latencies: lower is better;
throughputs and goodput: higher is better; error rate: lower, compared
absolutely) and a threshold: the relative change allowed in the bad direction
(0.10 = 10 %). A change beyond it is a REGRESSION; the exit status is 1 if
any metric regressed, else 0 (2 for unusable input).

Thresholds: ``--latency-threshold`` (all TTFT/TPOT/ITL/E2E statistics),
``--throughput-threshold``, ``--error-rate-threshold`` (absolute), and
``--threshold NAME=FRAC`` for one family (``ttft``) or one metric
(``ttft_ms.p99``). ``--latency-floor-ms`` ignores latency increases smaller
than that many milliseconds (timer and scheduler noise on tiny values).
``--preset generous`` (latency x3, throughput -67 %, floor 50 ms) is what
``make bench`` uses: machines are noisy, so that gate only catches big
regressions.

The machine (issue 33): a result that recorded its machine
(``replay --calibrate``: the load average before and after the run and
``kvserve.bench.calibration``'s figures) is judged in units of that
calibration when the baseline has one too: the current run's throughputs
are divided, and its latencies multiplied, by ``speed`` = current
``gemm_gflops`` / baseline ``gemm_gflops`` (a machine at half the
baseline's GEMM rate is expected at half its throughput). And with
``--max-load L``, a run whose 1-minute load average exceeded L before or
after it is not judged at all: "machine too busy to judge", exit status
``BUSY`` (3), neither a pass nor a regression.

    python tools/compare.py baseline.json current.json [--by-class] [--max-load 3]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

LATENCY_FAMILIES = ("ttft", "tpot", "itl", "e2el")
LATENCY_STATS = ("mean", "median", "p90", "p99")
THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput")

#: Exit status of a run too busy to judge (``--max-load``).
BUSY = 3

PRESETS = {
    "default": {"latency": 0.10, "throughput": 0.10, "error_rate": 0.0, "floor_ms": 0.0},
    "generous": {"latency": 2.00, "throughput": 0.67, "error_rate": 0.0, "floor_ms": 50.0},
}


@dataclass
class Row:
    """One compared metric."""

    group: str
    metric: str
    baseline: float | None
    current: float | None
    change: float | None  # relative (or absolute for error_rate)
    limit: float
    status: str  # ok, REGRESSION, improved, missing


def _get(summary: dict, path: str):
    node = summary
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def metric_specs(summary_a: dict, summary_b: dict) -> list[tuple[str, str]]:
    """(metric path, kind) pairs: kind is ``lower``, ``higher`` or ``abs_lower``."""
    specs = [(f"{fam}_ms.{st}", "lower") for fam in LATENCY_FAMILIES for st in LATENCY_STATS]
    specs += [(name, "higher") for name in THROUGHPUTS]
    if "goodput" in summary_a and "goodput" in summary_b:
        specs.append(("goodput.request_goodput", "higher"))
    specs.append(("error_rate", "abs_lower"))
    return specs


def threshold_for(metric: str, kind: str, opts: dict, overrides: dict[str, float]) -> float:
    if metric in overrides:
        return overrides[metric]
    family = metric.split("_ms.")[0] if "_ms." in metric else metric.split(".")[0]
    if family in overrides:
        return overrides[family]
    if kind == "abs_lower":
        return opts["error_rate"]
    return opts["latency"] if "_ms." in metric else opts["throughput"]


def machine_speed(base: dict, cur: dict) -> float | None:
    """The current machine's speed against the baseline's: the ratio of
    their calibrated GEMM rates (``machine.calibration.gemm_gflops``), or
    None when either result has none."""
    rates = [((r.get("machine") or {}).get("calibration") or {}).get("gemm_gflops")
             for r in (base, cur)]
    if not all(isinstance(x, (int, float)) and x > 0 for x in rates):
        return None
    return rates[1] / rates[0]


def run_load(result: dict) -> float | None:
    """The highest 1-minute load average recorded around the run
    (``machine.loadavg_before`` / ``loadavg_after``), or None."""
    machine = result.get("machine") or {}
    loads = [machine.get(k) for k in ("loadavg_before", "loadavg_after")]
    ones = [x[0] for x in loads if isinstance(x, (list, tuple)) and x]
    return max(ones) if ones else None


def compare_summaries(base: dict, cur: dict, group: str, opts: dict,
                      overrides: dict[str, float], speed: float | None = None) -> list[Row]:
    """Compare one pair of summaries (as in a result's ``summary.overall``);
    ``speed`` (``machine_speed``): the current values are first scaled to
    the baseline's machine (throughputs / speed, latencies x speed)."""
    rows = []
    for metric, kind in metric_specs(base, cur):
        b, c = _get(base, metric), _get(cur, metric)
        if speed is not None and c is not None and kind != "abs_lower":
            c = c * speed if kind == "lower" else c / speed
        limit = threshold_for(metric, kind, opts, overrides)
        if b is None or c is None or (isinstance(b, float) and math.isnan(b)) \
                or (isinstance(c, float) and math.isnan(c)):
            status = "missing" if (b is None) != (c is None) else "n/a"
            rows.append(Row(group, metric, b, c, None, limit, status))
            continue
        if kind == "abs_lower":
            change = c - b
            bad = change > limit + 1e-12
            good = change < 0
        else:
            change = (c - b) / b if b else (0.0 if c == b else math.inf)
            if kind == "lower":
                bad = change > limit and (c - b) >= opts["floor_ms"]
                good = change < -limit
            else:
                bad = change < -limit
                good = change > limit
        rows.append(Row(group, metric, b, c, change, limit,
                        "REGRESSION" if bad else "improved" if good else "ok"))
    return rows


def compare_results(base: dict, cur: dict, opts: dict, overrides: dict[str, float],
                    by_class: bool = False) -> list[Row]:
    """Compare two result JSONs: overall, and per class if asked (classes in both)."""
    speed = machine_speed(base, cur)
    rows = compare_summaries(base["summary"]["overall"], cur["summary"]["overall"], "overall",
                             opts, overrides, speed)
    if by_class:
        bc, cc = base["summary"].get("by_class", {}), cur["summary"].get("by_class", {})
        for cls in sorted(set(bc) & set(cc)):
            rows += compare_summaries(bc[cls], cc[cls], f"class:{cls}", opts, overrides, speed)
    return rows


def format_table(rows: list[Row]) -> str:
    def num(v) -> str:
        if v is None:
            return "-"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"

    header = f"{'group':<16} {'metric':<28} {'baseline':>11} {'current':>11} {'change':>9} " \
             f"{'limit':>8}  status"
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.change is None:
            change = "-"
        elif r.metric == "error_rate":
            change = f"{r.change:+.3f}"
        else:
            change = f"{r.change * 100:+.1f}%" if math.isfinite(r.change) else "inf"
        limit = f"{r.limit:.3f}" if r.metric == "error_rate" else f"{r.limit * 100:.0f}%"
        lines.append(f"{r.group:<16} {r.metric:<28} {num(r.baseline):>11} {num(r.current):>11} "
                     f"{change:>9} {limit:>8}  {r.status}")
    return "\n".join(lines)


def parse_overrides(items: list[str] | None) -> dict[str, float]:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bad --threshold {item!r}: use NAME=FRACTION, e.g. ttft=0.2")
        out[name.strip()] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compare", description=__doc__.splitlines()[0])
    p.add_argument("baseline")
    p.add_argument("current")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--latency-threshold", type=float, default=None,
                   help="allowed relative latency increase (default 0.10; generous 2.0)")
    p.add_argument("--throughput-threshold", type=float, default=None,
                   help="allowed relative throughput decrease (default 0.10; generous 0.67)")
    p.add_argument("--error-rate-threshold", type=float, default=None,
                   help="allowed absolute error-rate increase (default 0)")
    p.add_argument("--latency-floor-ms", type=float, default=None,
                   help="ignore latency increases below this many ms")
    p.add_argument("--threshold", action="append", default=None, metavar="NAME=FRAC",
                   help="per family (ttft) or metric (ttft_ms.p99); repeatable")
    p.add_argument("--by-class", action="store_true", help="also compare each class")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--max-load", type=float, default=None,
                   help="above this 1-minute load average around the current run: no verdict, "
                        f"'machine too busy to judge', exit status {BUSY}")
    args = p.parse_args(argv)
    opts = dict(PRESETS[args.preset])
    for key, value in (("latency", args.latency_threshold), ("throughput", args.throughput_threshold),
                       ("error_rate", args.error_rate_threshold),
                       ("floor_ms", args.latency_floor_ms)):
        if value is not None:
            opts[key] = value
    try:
        overrides = parse_overrides(args.threshold)
        with open(args.baseline, encoding="utf-8") as f:
            base = json.load(f)
        with open(args.current, encoding="utf-8") as f:
            cur = json.load(f)
        rows = compare_results(base, cur, opts, overrides, args.by_class)
    except (OSError, ValueError, KeyError) as exc:
        print(f"compare: error: {exc}", file=sys.stderr)
        return 2
    load = run_load(cur)
    if args.max_load is not None and load is not None and load > args.max_load:
        print(f"machine too busy to judge: the load average reached {load:.2f} around the run "
              f"(--max-load {args.max_load:g}); no verdict (exit status {BUSY})")
        return BUSY
    speed = machine_speed(base, cur)
    if not args.json:
        print("machine: " + (f"current GEMM rate {speed:.2f}x the baseline's: current figures "
                             "scaled to the baseline's machine" if speed is not None else
                             "no calibration in both results: raw figures compared")
              + (f"; load average up to {load:.2f}" if load is not None else ""))
    regressions = [r for r in rows if r.status == "REGRESSION"]
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
    else:
        print(format_table(rows))
        print(f"\n{len(regressions)} regression(s) in {len(rows)} metrics "
              f"(latency limit {opts['latency']:.0%}, throughput limit {opts['throughput']:.0%}, "
              f"latency floor {opts['floor_ms']:g} ms)")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
