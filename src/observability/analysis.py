"""Log analysis: kvserve's JSON-lines log -> phase breakdown, percentiles,
throughput over time, a bottleneck diagnosis, a Markdown report and plots.

Used by ``kvserve analyze LOGFILE`` and ``tools/analyze_logs.py``. Reads the
events of ``kvserve.observability.stats_logger``: ``request_finished`` (one record per
sequence: queue/prefill/decode/TTFT/E2E/TPOT seconds, tokens, priority,
class), ``request_scheduled`` (KV usage at admission), ``request_preempted``,
``engine_stats`` (periodic: running, waiting, KV usage, throughput) and, if
the log was written at debug level, ``step``. Lines that are not JSON (or
not kvserve events) are skipped. The rules are ``kvserve.observability.diagnosis``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kvserve.observability.diagnosis import (KV_HIGH, TPOT_TARGET_S, TTFT_TARGET_S, Features,
                                            Verdict, diagnose, host_note)

PHASES = ("queue_s", "prefill_s", "ttft_s", "tpot_s", "e2e_s")
PROMPT_BUCKETS = (128, 512, 1024, 2048)


@dataclass
class LogData:
    """The events of one log, grouped."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    scheduled: list[dict[str, Any]] = field(default_factory=list)
    preemptions: list[dict[str, Any]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)
    t0: float | None = None  # epoch seconds of the first event
    num_lines: int = 0  # non-empty lines read
    num_events: int = 0  # of them, JSON objects with an ``event`` (kvserve's log lines)


def _epoch(event: dict[str, Any]) -> float | None:
    stamp = event.get("timestamp")
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def read_log(lines: Iterable[str]) -> LogData:
    """Group the kvserve events of a JSON-lines log."""
    data = LogData()
    for line in lines:
        line = line.strip()
        data.num_lines += bool(line)
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(event, dict):
            continue
        name = event.get("event")
        data.num_events += isinstance(name, str)
        t = _epoch(event)
        if t is not None:
            event["_t"] = t
            data.t0 = t if data.t0 is None else min(data.t0, t)
        target = {"request_finished": data.requests, "request_scheduled": data.scheduled,
                  "request_preempted": data.preemptions, "engine_stats": data.stats,
                  "step": data.steps, "request_received": data.received}.get(name)
        if target is not None:
            target.append(event)
    for request in data.requests:  # finished at arrival + e2e
        if request.get("arrival_time") is not None:
            data.t0 = request["arrival_time"] if data.t0 is None \
                else min(data.t0, request["arrival_time"])
    return data


def load_log(path: str | Path) -> LogData:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return read_log(handle)


# ----------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of ``values``; None if empty."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(values: Sequence[float]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def _moments(xs: Sequence[float], ys: Sequence[float]) -> tuple[int, float, float, float]:
    """(pairs, Sxx, Syy, Sxy) of the pairs where both values are known."""
    pairs = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if not pairs:
        return 0, 0.0, 0.0, 0.0
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    sxx = sum((x - mx) ** 2 for x, _ in pairs)
    syy = sum((y - my) ** 2 for _, y in pairs)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    return len(pairs), sxx, syy, sxy


def correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation of paired values (None for < 3 pairs or no spread)."""
    n, sxx, syy, sxy = _moments(xs, ys)
    if n < 3 or sxx <= 0 or syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of y on x (None for < 2 pairs or no spread in x)."""
    n, sxx, _, sxy = _moments(xs, ys)
    return None if n < 2 or sxx <= 0 else sxy / sxx


def summarize(values: Sequence[float]) -> dict[str, float | None | int]:
    xs = [v for v in values if v is not None]
    return {"n": len(xs), "mean": mean(xs), "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99)}


def prompt_bucket(tokens: int) -> str:
    lower = 0
    for upper in PROMPT_BUCKETS:
        if tokens < upper:
            return f"{lower}-{upper - 1}"
        lower = upper
    return f">={lower}"


def _completed(data: LogData) -> list[dict[str, Any]]:
    """Finished requests that produced a token (phase times known)."""
    return [r for r in data.requests if r.get("ttft_s") is not None]


def group_stats(requests: Sequence[dict[str, Any]], key) -> dict[str, dict[str, dict]]:
    """``{group: {phase: summary}}`` for ``key(request) -> group``."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in requests:
        groups.setdefault(str(key(r)), []).append(r)
    return {g: {p: summarize([r.get(p) for r in rs]) for p in PHASES}
            for g, rs in sorted(groups.items())}


def _bucket_order(name: str) -> int:
    return int(name.lstrip(">=").split("-")[0])


# ------------------------------------------------------------------ time series


@dataclass
class Series:
    """Time series (seconds since the first event) for plots and the report."""

    t: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    source: str = "none"


def load_series(data: LogData) -> Series:
    """Queue depth and KV usage over time: from ``step`` events (debug logs),
    else ``engine_stats`` lines, else ``request_scheduled`` events."""
    t0 = data.t0 or 0.0
    series = Series()
    if data.steps:
        series.source = "step"
        rows = [(e["_t"], e.get("num_waiting"), e.get("num_running"), e.get("kv_cache_usage"))
                for e in data.steps if "_t" in e]
    elif data.stats:
        series.source = "engine_stats"
        rows = [(e["_t"], e.get("num_waiting"), e.get("num_running"),
                 e.get("kv_cache_usage_mean", e.get("kv_cache_usage")))
                for e in data.stats if "_t" in e]
    else:
        series.source = "request_scheduled"
        rows = [(e["_t"], e.get("num_waiting"), e.get("num_running"), e.get("kv_cache_usage"))
                for e in data.scheduled if "_t" in e]
    for t, w, r, kv in sorted(rows, key=lambda row: row[0]):
        series.t.append(t - t0)
        series.waiting.append(w if w is not None else math.nan)
        series.running.append(r if r is not None else math.nan)
        series.kv_usage.append(kv if kv is not None else math.nan)
    return series


def throughput_over_time(data: LogData, bin_s: float | None = None) -> list[dict[str, float]]:
    """Rows of (start second, prompt tok/s, generation tok/s, finished requests)."""
    t0 = data.t0 or 0.0
    if data.stats:
        return [{"t_s": round(e["_t"] - t0, 3),
                 "prompt_tokens_per_s": e.get("prompt_throughput", 0.0),
                 "generation_tokens_per_s": e.get("generation_throughput", 0.0),
                 "running": e.get("num_running"), "waiting": e.get("num_waiting"),
                 "kv_cache_usage": e.get("kv_cache_usage")}
                for e in data.stats if "_t" in e]
    ends = [(r["arrival_time"] + r["e2e_s"], r.get("prompt_tokens", 0), r.get("output_tokens", 0))
            for r in data.requests if r.get("arrival_time") and r.get("e2e_s") is not None]
    if not ends:
        return []
    span = max(e[0] for e in ends) - t0
    bin_s = bin_s or max(span / 10, 1.0)
    rows: dict[int, list[float]] = {}
    for end, prompt, out in ends:
        row = rows.setdefault(int((end - t0) // bin_s), [0, 0, 0])
        row[0] += prompt
        row[1] += out
        row[2] += 1
    return [{"t_s": round(i * bin_s, 3), "prompt_tokens_per_s": v[0] / bin_s,
             "generation_tokens_per_s": v[1] / bin_s, "finished": v[2]}
            for i, v in sorted(rows.items())]


# ------------------------------------------------------------------- features


def features_from_log(data: LogData) -> Features:
    """The diagnosis features of a log."""
    reqs = _completed(data)
    by_arrival = sorted(reqs, key=lambda r: r.get("arrival_time") or 0.0)
    queue = [r.get("queue_s") for r in by_arrival]
    ttft = [r.get("ttft_s") for r in by_arrival]
    prompts = [r.get("prompt_tokens") for r in by_arrival]
    third = max(len(by_arrival) // 3, 1)
    kv_samples = ([e.get("kv_cache_usage") for e in data.steps] if data.steps else
                  [e.get("kv_cache_usage_mean") for e in data.stats if e.get("num_steps")])
    kv_samples += [e.get("kv_cache_usage") for e in data.scheduled]
    kv_samples = [v for v in kv_samples if v is not None]
    kv_max_candidates = kv_samples + [e.get("kv_cache_usage_max") for e in data.stats
                                      if e.get("kv_cache_usage_max") is not None]
    waiting = ([e.get("num_waiting") for e in data.steps] + [e.get("max_waiting")
               for e in data.stats] + [e.get("num_waiting") for e in data.scheduled])
    waiting = [w for w in waiting if w is not None]
    preemptions = len(data.preemptions) or sum(r.get("preemptions") or 0 for r in data.requests)
    decode_steps = [e.get("step_s") for e in data.steps
                    if not e.get("prefill_tokens") and e.get("decode_tokens")]
    mixed_steps = [e.get("step_s") for e in data.steps
                   if e.get("prefill_tokens") and e.get("decode_tokens")]
    p10, p90 = percentile(prompts, 10), percentile(prompts, 90)
    buckets = group_stats(reqs, lambda r: prompt_bucket(r.get("prompt_tokens") or 0))
    ttft_by_bucket = {f"ttft_p50_s[prompt {b}]": s["ttft_s"]["p50"]
                      for b, s in sorted(buckets.items(), key=lambda kv: _bucket_order(kv[0]))}
    tpots = [r.get("tpot_s") for r in reqs]
    per_token = slope(prompts, ttft)
    return Features(
        source="logs", num_requests=len(reqs),
        ttft_mean=mean(ttft), ttft_p50=percentile(ttft, 50), ttft_p90=percentile(ttft, 90),
        e2e_mean=mean([r.get("e2e_s") for r in reqs]),
        queue_mean=mean(queue), queue_p50=percentile(queue, 50), queue_p90=percentile(queue, 90),
        queue_ttft_corr=correlation(queue, ttft),
        queue_first_third_mean=mean(queue[:third]) if by_arrival else None,
        queue_last_third_mean=mean(queue[-third:]) if by_arrival else None,
        max_waiting=max(waiting) if waiting else None,
        prefill_mean=mean([r.get("prefill_s") for r in reqs]),
        prompt_tokens_mean=mean(prompts),
        prompt_ttft_corr=correlation(prompts, ttft),
        prompt_spread=(p90 / p10) if p10 and p90 else None,
        ttft_per_1k_prompt_tokens=None if per_token is None else per_token * 1000,
        preemptions=preemptions,
        preempted_requests=sum(1 for r in data.requests if (r.get("preemptions") or 0) > 0),
        kv_usage_max=max(kv_max_candidates) if kv_max_candidates else None,
        kv_usage_mean=mean(kv_samples),
        kv_high_fraction=(sum(1 for v in kv_samples if v >= KV_HIGH) / len(kv_samples)
                          if kv_samples else None),
        tpot_p10=percentile(tpots, 10), tpot_p50=percentile(tpots, 50),
        tpot_p90=percentile(tpots, 90),
        decode_step_s=mean(decode_steps), mixed_step_s=mean(mixed_steps),
        max_concurrency=max_concurrency(data),
        extra={"ttft_by_bucket": ttft_by_bucket})


def max_concurrency(data: LogData) -> int | None:
    """Most requests running (first scheduled .. finished) at the same time."""
    spans = []
    for r in data.requests:
        if r.get("arrival_time") is None or r.get("queue_s") is None \
                or r.get("inference_s") is None:
            continue
        start = r["arrival_time"] + r["queue_s"]
        spans += [(start, 1), (start + r["inference_s"], -1)]
    if not spans:
        return None
    best = current = 0
    for _, step in sorted(spans, key=lambda s: (s[0], s[1])):  # ends before starts
        current += step
        best = max(best, current)
    return best


# ---------------------------------------------------------------------- report


@dataclass
class Analysis:
    data: LogData
    features: Features
    verdicts: list[Verdict]
    report: str
    plots: list[Path] = field(default_factory=list)

    @property
    def bottleneck(self) -> str | None:
        """The primary verdict's kind, or None (no bottleneck)."""
        return self.verdicts[0].kind if self.verdicts else None


def analyze(data: LogData, out_dir: str | Path | None = None, plots: bool = True,
            ttft_target: float = TTFT_TARGET_S, tpot_target: float = TPOT_TARGET_S) -> Analysis:
    """Analyse ``data``; with ``out_dir``, write ``report.md``,
    ``requests.csv`` and the PNG plots there. ``ttft_target`` /
    ``tpot_target``: seconds (``diagnosis.TTFT_TARGET_S`` / ``TPOT_TARGET_S``)."""
    features = features_from_log(data)
    features.ttft_target, features.tpot_target = ttft_target, tpot_target
    verdicts = diagnose(features)
    written: list[Path] = []
    if out_dir is not None and plots:
        written = make_plots(data, Path(out_dir))
    report = render_report(data, features, verdicts, written)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(report, encoding="utf-8")
        write_requests_csv(data, out / "requests.csv")
    return Analysis(data, features, verdicts, report, written)


def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _phase_table(title: str, groups: dict[str, dict[str, dict]], order=None) -> list[str]:
    names = sorted(groups, key=order) if order else list(groups)
    lines = [f"### {title}", "",
             "| group | n | " + " | ".join(f"{p[:-2]} mean / p50 / p90 / p99 (s)" for p in PHASES)
             + " |", "|---|---|" + "---|" * len(PHASES)]
    for g in names:
        stats = groups[g]
        cells = [" / ".join(_f(stats[p][k]) for k in ("mean", "p50", "p90", "p99"))
                 for p in PHASES]
        lines.append(f"| {g} | {stats['ttft_s']['n']} | " + " | ".join(cells) + " |")
    return lines + [""]


REQUEST_COLUMNS = ("request_id", "request_class", "priority", "stream", "prompt_tokens",
                   "cached_tokens", "output_tokens", "preemptions", "finish_reason", "queue_s",
                   "prefill_s", "decode_s", "ttft_s", "tpot_s", "e2e_s")


def write_requests_csv(data: LogData, path: Path) -> None:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(REQUEST_COLUMNS)
        for r in sorted(data.requests, key=lambda r: r.get("arrival_time") or 0.0):
            writer.writerow([r.get(c) for c in REQUEST_COLUMNS])


def render_report(data: LogData, features: Features, verdicts: list[Verdict],
                  plots: Sequence[Path] = (), max_rows: int = 100) -> str:
    reqs = _completed(data)
    lines = ["# kvserve log analysis", "",
             f"{len(data.requests)} finished requests ({len(reqs)} with a first token), "
             f"{len(data.stats)} engine_stats lines, {len(data.steps)} step events, "
             f"{features.preemptions} preemptions.", "", "## Diagnosis", ""]
    if verdicts:
        lines.append(f"**Bottleneck: {verdicts[0].title}** (`{verdicts[0].kind}`)"
                     + (f"; also: {', '.join(v.kind for v in verdicts[1:])}"
                        if len(verdicts) > 1 else "") + "")
        lines.append("")
        for verdict in verdicts:
            lines += [verdict.markdown(), ""]
    else:
        lines += ["**No bottleneck**: queue time is a small part of TTFT, TTFT does not grow "
                  "with prompt length, no preemptions, and no decode interference between "
                  "concurrent requests -- the server is lightly loaded.",
                  "", f"- queue share of TTFT: {_f(features.queue_share)}",
                  f"- prefill share of E2E: {_f(features.prefill_share_of_e2e)}",
                  f"- preemptions: {features.preemptions}",
                  f"- TPOT p10 / p90 (s): {_f(features.tpot_p10)} / {_f(features.tpot_p90)}",
                  f"- most requests running at once: {_f(features.max_concurrency)}", ""]
    note = host_note(features)
    if note:
        lines += [f"Note: {note}", ""]
    lines += ["## Latency by group", ""]
    lines += _phase_table("All requests", group_stats(reqs, lambda r: "all"))
    lines += _phase_table("By workload class (X-Request-Class)",
                          group_stats(reqs, lambda r: r.get("request_class") or "-"))
    lines += _phase_table("By prompt length (tokens)",
                          group_stats(reqs, lambda r: prompt_bucket(r.get("prompt_tokens") or 0)),
                          order=_bucket_order)
    lines += _phase_table("By priority", group_stats(reqs, lambda r: r.get("priority", 0)))
    lines += _phase_table("By streaming", group_stats(
        reqs, lambda r: {True: "stream", False: "no stream"}.get(r.get("stream"), "unknown")))
    rows = throughput_over_time(data)
    lines += ["## Throughput over time", "",
              "| t (s) | prompt tok/s | generation tok/s | running | waiting | KV usage |",
              "|---|---|---|---|---|---|"]
    for row in rows[:max_rows]:
        lines.append(f"| {row['t_s']:.1f} | {_f(row['prompt_tokens_per_s'], 1)} | "
                     f"{_f(row['generation_tokens_per_s'], 1)} | {_f(row.get('running'))} | "
                     f"{_f(row.get('waiting'))} | {_f(row.get('kv_cache_usage'))} |")
    lines += ["", "## Per-request phases", "",
              "| request | class | prio | prompt | cached | output | preempt | queue s | "
              "prefill s | decode s | TTFT s | TPOT s | E2E s | finish |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ordered = sorted(data.requests, key=lambda r: r.get("arrival_time") or 0.0)
    for r in ordered[:max_rows]:
        lines.append(" | ".join(["", str(r.get("request_id")), str(r.get("request_class") or "-"),
                                 str(r.get("priority", 0)), str(r.get("prompt_tokens")),
                                 str(r.get("cached_tokens")), str(r.get("output_tokens")),
                                 str(r.get("preemptions")), _f(r.get("queue_s")),
                                 _f(r.get("prefill_s")), _f(r.get("decode_s")),
                                 _f(r.get("ttft_s")), _f(r.get("tpot_s")), _f(r.get("e2e_s")),
                                 str(r.get("finish_reason")), ""]).strip())
    if len(ordered) > max_rows:
        lines.append(f"\n({len(ordered) - max_rows} more rows in requests.csv)")
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------- plots


def make_plots(data: LogData, out_dir: Path) -> list[Path]:
    """Latency CDFs, queue depth and KV usage over time, TTFT vs prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    reqs = _completed(data)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for phase in PHASES:
        xs = sorted(r[phase] for r in reqs if r.get(phase) is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=phase[:-2])
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Latency CDFs")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out_dir / "latency_cdf.png"))

    series = load_series(data)
    fig, ax1 = plt.subplots(figsize=(7, 4.5))
    ax1.plot(series.t, series.waiting, label="waiting", color="tab:red")
    ax1.plot(series.t, series.running, label="running", color="tab:blue")
    ax1.set_xlabel("seconds since start")
    ax1.set_ylabel("requests")
    ax2 = ax1.twinx()
    ax2.plot(series.t, [v * 100 for v in series.kv_usage], label="KV usage %",
             color="tab:green", linestyle="--")
    ax2.set_ylabel("KV cache usage %")
    ax2.set_ylim(0, 105)
    handles = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax1.legend(handles, [h.get_label() for h in handles], loc="upper right")
    ax1.set_title(f"Queue depth and KV usage over time (from {series.source})")
    written.append(_save(fig, out_dir / "queue_kv_over_time.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([r.get("prompt_tokens") for r in reqs], [r["ttft_s"] for r in reqs], s=14,
               label="TTFT")
    ax.scatter([r.get("prompt_tokens") for r in reqs], [r.get("queue_s") for r in reqs], s=10,
               marker="x", label="queue")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("seconds")
    ax.set_title("TTFT vs prompt length")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out_dir / "ttft_vs_prompt.png"))

    rows = throughput_over_time(data)
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot([r["t_s"] for r in rows], [r["prompt_tokens_per_s"] for r in rows],
                label="prompt tok/s")
        ax.plot([r["t_s"] for r in rows], [r["generation_tokens_per_s"] for r in rows],
                label="generation tok/s")
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("tokens/s")
        ax.set_title("Throughput over time")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out_dir / "throughput_over_time.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``kvserve analyze LOGFILE [--out DIR] [--json] [--no-plots]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="kvserve analyze", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser) -> None:
    parser.add_argument("logfile", help="kvserve JSON-lines log (stderr of kvserve serve)")
    parser.add_argument("--out", default=None,
                        help="folder for report.md, requests.csv and the PNG plots "
                             "(default: LOGFILE's name + '.analysis')")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--json", action="store_true",
                        help="print the verdicts and features as JSON instead of the report")
    add_target_arguments(parser)


def _seconds(text: str) -> float:
    """A target in seconds: a positive finite number (argparse's type)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def add_target_arguments(parser) -> None:
    """``--ttft-target`` and ``--tpot-target`` (seconds; ``analyze`` and ``diagnose``)."""
    parser.add_argument("--ttft-target", type=_seconds, default=TTFT_TARGET_S, metavar="S",
                        help="median time to first token the server should meet, seconds "
                             "(a target_missed verdict above it)")
    parser.add_argument("--tpot-target", type=_seconds, default=TPOT_TARGET_S, metavar="S",
                        help="median time per output token the server should meet, seconds "
                             f"(default {TPOT_TARGET_S:g}: {1 / TPOT_TARGET_S:g} tokens/s per "
                             "request)")


def run(args) -> int:
    from dataclasses import asdict

    path = Path(args.logfile)
    if not path.is_file():
        import sys
        print(f"kvserve analyze: error: no such file {path}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else path.with_name(path.name + ".analysis")
    data = load_log(path)
    if data.num_events == 0:
        import sys
        what = (f"its {data.num_lines:,} lines hold no kvserve JSON event" if data.num_lines
                else "it is empty")
        print(f"kvserve analyze: error: cannot read {path}: {what} (a terminal's console log? "
              "start the server with --log-format json and analyse that log)", file=sys.stderr)
        return 2
    result = analyze(data, out, plots=not args.no_plots, ttft_target=args.ttft_target,
                     tpot_target=args.tpot_target)
    if args.json:
        print(json.dumps({"bottleneck": result.bottleneck,
                          "verdicts": [v.to_dict() for v in result.verdicts],
                          "features": asdict(result.features), "out": str(out)},
                         indent=2, default=str))
    else:
        print(result.report)
        print(f"(report, requests.csv and plots in {out})")
    return 0
