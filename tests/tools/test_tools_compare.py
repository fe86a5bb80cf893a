"""compare.py flags an injected 30 % TTFT regression and passes identical
results; sweep's saturation point and plot."""

from __future__ import annotations

import copy
import json

import numpy as np

from kvserve.bench.compare import main as compare_main
from kvserve.bench.replay import RequestResult, summarize_all
from kvserve.bench.sweep import plot_sweep, saturation_index


def _result(ttft_factor: float = 1.0) -> dict:
    rng = np.random.default_rng(0)
    results = []
    for i in range(50):
        ttft = float(rng.uniform(0.1, 0.4)) * ttft_factor
        itl = [float(g) for g in rng.uniform(0.04, 0.06, size=9)]
        results.append(RequestResult(id=f"r{i}", cls="short_qa" if i % 2 else "rag",
                                     success=True, status=200, ttft=ttft, itl=itl,
                                     e2el=ttft + sum(itl), tpot=sum(itl) / 9, content_events=10,
                                     output_tokens=10, prompt_tokens=50))
    return {"schema": "kvserve.bench.result/1",
            "summary": summarize_all(results, 10.0, {"ttft": 500})}


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_identical_results_pass(tmp_path, capsys):
    base = _write(tmp_path, "a.json", _result())
    cur = _write(tmp_path, "b.json", copy.deepcopy(_result()))
    assert compare_main([base, cur, "--by-class"]) == 0
    out = capsys.readouterr().out
    assert "REGRESSION" not in out and "ttft_ms.p99" in out and "0 regression(s)" in out


def test_injected_ttft_regression_is_flagged(tmp_path, capsys):
    base = _write(tmp_path, "a.json", _result())
    cur = _write(tmp_path, "b.json", _result(ttft_factor=1.3))
    assert compare_main([base, cur]) == 1
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if "REGRESSION" in line]
    assert any("ttft_ms.mean" in line and "+30.0%" in line for line in flagged), out
    assert all("ttft" in line or "e2el" in line for line in flagged), flagged
    assert not any("tpot" in line or "itl" in line for line in flagged)
    # the generous gate of `make bench` (latency x3) lets 30 % through, a 3.5x not
    assert compare_main([base, cur, "--preset", "generous"]) == 0
    worse = _write(tmp_path, "c.json", _result(ttft_factor=3.5))
    assert compare_main([base, worse, "--preset", "generous"]) == 1
    # a looser TTFT-only threshold
    assert compare_main([base, cur, "--threshold", "ttft=0.5", "--threshold", "e2el=0.5"]) == 0


def test_throughput_drop_and_errors_are_regressions(tmp_path):
    base = _result()
    cur = copy.deepcopy(base)
    cur["summary"]["overall"]["output_throughput"] *= 0.7
    assert compare_main([_write(tmp_path, "a.json", base), _write(tmp_path, "b.json", cur)]) == 1
    cur = copy.deepcopy(base)
    cur["summary"]["overall"]["error_rate"] = 0.1
    assert compare_main([_write(tmp_path, "a.json", base), _write(tmp_path, "b.json", cur)]) == 1


def test_saturation_index():
    assert saturation_index([10, 20, 30, 31, 31.5]) == 3  # +3 % < 5 %
    assert saturation_index([10, 20, 40]) is None
    assert saturation_index([10, 9, 20]) == 1  # a drop also stops adding throughput


def test_plot_sweep_writes_png(tmp_path):
    points = [{"value": v, "summary": _result(ttft_factor=v)["summary"]} for v in (1, 2, 3)]
    for p, t in zip(points, (10, 20, 20.5), strict=True):
        p["summary"]["overall"]["output_throughput"] = t
    png = tmp_path / "s.png"
    plot_sweep(points, "rate", 2, png)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def _on_machine(result: dict, gemm_gflops: float | None, load: float) -> dict:
    result = copy.deepcopy(result)
    result["machine"] = {"loadavg_before": [load, load, load], "loadavg_after": [load, 0.5, 0.5]}
    if gemm_gflops is not None:
        result["machine"]["calibration"] = {"gemm_gflops": gemm_gflops}
    return result


def _half_speed(result: dict) -> dict:
    """Every latency twice, every throughput half (a machine at half speed)."""
    slow = copy.deepcopy(result)
    overall = slow["summary"]["overall"]
    for key, value in overall.items():
        if key.endswith("_ms") and isinstance(value, dict):
            overall[key] = {k: v * 2 if isinstance(v, float) else v for k, v in value.items()}
        elif key.endswith("throughput"):
            overall[key] = value / 2
    return slow


def test_a_machine_at_half_speed_is_judged_in_units_of_its_calibration(tmp_path, capsys):
    """Twice the latencies and half the throughput on a machine whose GEMM
    rate is half the baseline's: no regression; the same run without a
    calibration in it: regressions (the raw figures are compared)."""
    base = _on_machine(_result(), 100.0, 0.5)
    slow = _half_speed(_result())
    calibrated = _write(tmp_path, "slow.json", _on_machine(slow, 50.0, 0.5))
    assert compare_main([_write(tmp_path, "base.json", base), calibrated]) == 0
    assert "0.50x the baseline's" in capsys.readouterr().out
    raw = _write(tmp_path, "raw.json", _on_machine(slow, None, 0.5))
    assert compare_main([_write(tmp_path, "base.json", base), raw]) == 1
    assert "raw figures" in capsys.readouterr().out


def test_a_run_above_the_load_bound_gets_no_verdict(tmp_path, capsys):
    """--max-load: a busy run exits with its own status, whatever its figures."""
    from kvserve.bench.compare import BUSY

    base = _write(tmp_path, "base.json", _on_machine(_result(), 100.0, 0.5))
    busy = _write(tmp_path, "busy.json", _on_machine(_result(ttft_factor=3.0), 100.0, 9.0))
    assert compare_main([base, busy, "--max-load", "4"]) == BUSY == 3
    assert "machine too busy to judge" in capsys.readouterr().out
    assert compare_main([base, busy]) == 1  # without the bound: a regression
