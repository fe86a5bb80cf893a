"""The soak's accounting and report: the end-of-run checks (health, idle
gauges, fds, RSS growth, every request accounted for, no failure
outcomes), the result dict (``--json``) and the summary table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from kvserve.testing.soak_send import FAILURES, OUTCOMES, Attempt
from kvserve.testing.soak_server import GAUGES, Server, idle_gauges, rss_mib, wait_until


@dataclass
class Check:
    """One end-of-run check: ``PASS``, ``FAIL`` or ``not checked``."""

    name: str
    status: str
    detail: str = ""


@dataclass
class Baseline:
    """The server after warm-up: fds, RSS (MiB) and KV usage (0..1)."""

    fds: int | None
    rss_mib: float | None
    kv_usage: float


async def measure_baseline(server: Server, deadline: float) -> Baseline:
    """Wait (until ``deadline``) for the server to be idle, then read its fds, RSS and KV."""
    _, gauges = await wait_until(server.gauges, idle_gauges(0.0), deadline)
    kv = (gauges or {}).get(GAUGES[2], 0.0)
    rss = rss_mib(server.pid) if server.pid else None
    return Baseline(await server.fds(), rss, kv)


async def check_health(server: Server, deadline: float) -> Check:
    """``/health`` answers 200 by ``deadline``."""
    ok, status = await wait_until(server.health, lambda s: s == 200, deadline)
    return Check("health", "PASS" if ok else "FAIL", f"/health {status}")


async def check_gauges(server: Server, base: Baseline, deadline: float) -> Check:
    """Nothing running or waiting and KV usage back to the baseline by ``deadline``."""
    ok, g = await wait_until(server.gauges, idle_gauges(base.kv_usage), deadline)
    if g is None:
        return Check("idle gauges", "FAIL", "/metrics did not answer")
    if not g:
        return Check("idle gauges", "not checked", "no kvserve gauges in /metrics")
    detail = (f"running {g.get(GAUGES[0], 0):g}, waiting {g.get(GAUGES[1], 0):g}, "
              f"kv {g.get(GAUGES[2], 0):.3f} (baseline {base.kv_usage:.3f})")
    return Check("idle gauges", "PASS" if ok else "FAIL", detail)


async def check_fds(server: Server, base: Baseline, tolerance: int, deadline: float) -> Check:
    """Open fds back to the baseline (+``tolerance``) by ``deadline``."""
    if base.fds is None:
        return Check("fds", "not checked", "no server pid")
    ok, now = await wait_until(server.fds, lambda n: n is not None and n <= base.fds + tolerance,
                               deadline)
    if now is None:
        return Check("fds", "FAIL", f"server process {server.pid} is gone")
    return Check("fds", "PASS" if ok else "FAIL", f"{base.fds} -> {now} (tolerance +{tolerance})")


def check_rss(base: Baseline, peak: float | None, limit_mib: float) -> Check:
    """Peak RSS minus the baseline's at most ``limit_mib``."""
    if base.rss_mib is None or peak is None:
        return Check("rss growth", "not checked", "no server pid")
    growth = peak - base.rss_mib
    return Check("rss growth", "PASS" if growth <= limit_mib else "FAIL",
                 f"{growth:+.1f} MiB (limit {limit_mib:g})")


def check_accounted(granted: int, attempts: list[Attempt]) -> Check:
    """Every request the budget granted ended as exactly one known outcome."""
    unknown = Counter(a.outcome for a in attempts if a.outcome not in OUTCOMES)
    ok = len(attempts) == granted and not unknown
    detail = f"{len(attempts)} outcomes for {granted} requests" + (
        f"; unknown outcomes {dict(unknown)}" if unknown else "")
    return Check("accounted", "PASS" if ok else "FAIL", detail)


def check_outcomes(counts: Counter) -> Check:
    """No request ended in a failure outcome (``FAILURES``)."""
    bad = {k: counts[k] for k in OUTCOMES if k in FAILURES and counts[k]}
    return Check("no failures", "FAIL" if bad else "PASS",
                 ", ".join(f"{k} {v}" for k, v in bad.items()) or "0 failure outcomes")


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated
    between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(attempts: list[Attempt], duration_s: float, base: Baseline,
              rss_samples: list[tuple[float, float]], fds_after: int | None,
              checks: list[Check], granted: int) -> dict:
    """The result dict (the ``--json`` file); ``passed`` decides the exit status.
    ``rss_samples``: (seconds, MiB) of the server's RSS from the baseline on;
    ``granted``: the requests the budget granted (``accounted``)."""
    peak = max((mib for _, mib in rss_samples), default=None)
    counts = Counter(a.outcome for a in attempts)
    itl_ms = [g * 1000.0 for a in attempts if a.kind == "probe" for g in a.itl]
    by_kind: dict[str, dict[str, int]] = {}
    for a in attempts:
        by_kind.setdefault(a.kind, {}).setdefault(a.outcome, 0)
        by_kind[a.kind][a.outcome] += 1
    return {
        "outcomes": {k: counts[k] for k in OUTCOMES},
        "total": len(attempts),
        "accounted": {"requests": granted, "outcomes": len(attempts)},
        "failures": sum(counts[k] for k in FAILURES),
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(len(attempts) / duration_s, 3) if duration_s > 0 else None,
        "probe_itl_ms": {"n": len(itl_ms), "p50": percentile(itl_ms, 50),
                         "p99": percentile(itl_ms, 99)},
        "rss_mib": {"baseline": base.rss_mib, "peak": peak,
                    "end": rss_samples[-1][1] if rss_samples else None,
                    "growth": None if peak is None or base.rss_mib is None
                    else peak - base.rss_mib,
                    "samples": [(t, round(mib, 1)) for t, mib in rss_samples]},
        "fds": {"before": base.fds, "after": fds_after},
        "checks": [asdict(c) for c in checks],
        "by_kind": by_kind,
        "failure_examples": [asdict(a) | {"itl": None} for a in attempts
                             if a.outcome in FAILURES][:20],
        "passed": all(c.status != "FAIL" for c in checks),
    }


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def format_table(result: dict) -> str:
    """The one summary table printed at the end."""
    rows: list[tuple[str, str]] = []
    for name, count in result["outcomes"].items():
        rows.append((f"  {name}" + (" (failure)" if name in FAILURES else ""), str(count)))
    itl = result["probe_itl_ms"]
    rss = result["rss_mib"]
    accounted = result["accounted"]
    rows += [("total requests", str(result["total"])),
             ("requests granted / outcomes",
              f"{accounted['requests']} / {accounted['outcomes']}"),
             ("duration (s)", _num(result["duration_s"])),
             ("requests/s", _num(result["requests_per_s"], ".2f")),
             (f"probe ITL p50 / p99 (ms, n={itl['n']})",
              f"{_num(itl['p50'])} / {_num(itl['p99'])}"),
             ("RSS baseline / peak / end (MiB)",
              f"{_num(rss['baseline'])} / {_num(rss['peak'])} / {_num(rss['end'])}"),
             ("RSS growth (MiB)", _num(rss["growth"], "+.1f")),
             ("fds before / after", f"{_num(result['fds']['before'], 'd')} / "
                                    f"{_num(result['fds']['after'], 'd')}")]
    rows += [(f"check {c['name']}", f"{c['status']}  {c['detail']}") for c in result["checks"]]
    rows.append(("result", "PASS" if result["passed"] else "FAIL"))
    width = max(len(label) for label, _ in rows) + 2
    lines = ["=" * 22 + " kvserve soak " + "=" * 22, f"{'outcome':<{width}}count"]
    lines += [f"{label:<{width}}{value}" for label, value in rows]
    return "\n".join(lines)
