"""tools/bench_pipeline.py's arithmetic: the bubble fraction and the per-stage
means from two /metrics scrapes, against figures worked out by hand (no server)."""

from __future__ import annotations

import pytest
from tools_support import load_tool

from kvserve.observability.metrics import parse_metrics_text


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_pipeline")


def test_bubble_fraction_by_hand(tool):
    # 2 stages over 10 s, busy 6 s and 4 s: 10 of 20 stage-seconds idle
    assert tool.bubble_fraction([6.0, 4.0], 10.0) == pytest.approx(0.5)
    # both always busy: no bubble; one request in flight through 2 equal stages: 1/2
    assert tool.bubble_fraction([10.0, 10.0], 10.0) == pytest.approx(0.0)
    assert tool.bubble_fraction([2.5, 2.5], 5.0) == pytest.approx(0.5)
    # 4 stages, 8 s, busy 8+6+4+2 = 20 of 32
    assert tool.bubble_fraction([8.0, 6.0, 4.0, 2.0], 8.0) == pytest.approx(12 / 32)
    with pytest.raises(ValueError):
        tool.bubble_fraction([], 1.0)
    with pytest.raises(ValueError):
        tool.bubble_fraction([1.0], 0.0)


def _scrape(forward_sum, forward_count, stages, engine_busy):
    """Prometheus text as kvserve's /metrics writes these families;
    ``stages``: [(sum, count, busy)] per stage."""
    lines = [
        "# TYPE kvserve:step_phase_seconds histogram",
        f'kvserve:step_phase_seconds_bucket{{le="+Inf",model_name="m",phase="forward"}} '
        f"{forward_count}",
        f'kvserve:step_phase_seconds_sum{{model_name="m",phase="forward"}} {forward_sum}',
        f'kvserve:step_phase_seconds_count{{model_name="m",phase="forward"}} {forward_count}',
        f'kvserve:step_phase_seconds_bucket{{le="+Inf",model_name="m",phase="sample"}} '
        f"{forward_count}",
        f'kvserve:step_phase_seconds_sum{{model_name="m",phase="sample"}} {forward_count * 0.001}',
        f'kvserve:step_phase_seconds_count{{model_name="m",phase="sample"}} {forward_count}',
        "# TYPE kvserve:engine_busy_seconds counter",
        f'kvserve:engine_busy_seconds_total{{model_name="m"}} {engine_busy}',
    ]
    if stages:
        lines.append("# TYPE kvserve:pipeline_stage_seconds histogram")
        for i, (total, count, _) in enumerate(stages):
            lines += [
                f'kvserve:pipeline_stage_seconds_bucket{{le="+Inf",model_name="m",stage="{i}"}} '
                f"{count}",
                f'kvserve:pipeline_stage_seconds_sum{{model_name="m",stage="{i}"}} {total}',
                f'kvserve:pipeline_stage_seconds_count{{model_name="m",stage="{i}"}} {count}']
        lines.append("# TYPE kvserve:pipeline_stage_busy_seconds counter")
        lines += [f'kvserve:pipeline_stage_busy_seconds_total{{model_name="m",stage="{i}"}} {b}'
                  for i, (_, _, b) in enumerate(stages)]
    return parse_metrics_text("\n".join(lines) + "\n")


def test_step_figures_pipeline_by_hand(tool):
    # before: warm-up's 10 steps; the run adds 100 steps over 8 s:
    # forward +5.0 s (50 ms a step), stage 0 +3.0 s (30 ms), stage 1 +4.0 s (40 ms)
    before = _scrape(0.4, 10, [(0.2, 10, 0.2), (0.3, 10, 0.3)], engine_busy=0.5)
    after = _scrape(5.4, 110, [(3.2, 110, 3.2), (4.3, 110, 4.3)], engine_busy=6.5)
    figures = tool.step_figures(before, after, 8.0)
    assert figures["steps"] == 100
    assert figures["phase_mean_s"]["forward"] == pytest.approx(0.05)
    assert figures["phase_mean_s"]["sample"] == pytest.approx(0.001)
    assert figures["engine_busy_fraction"] == pytest.approx(6.0 / 8.0)
    pipe = figures["pipeline"]
    assert pipe["stages"] == 2
    assert pipe["stage_mean_s"] == pytest.approx([0.03, 0.04])
    assert pipe["stage_steps"] == [100, 100]
    assert pipe["stage_busy_s"] == pytest.approx([3.0, 4.0])
    assert pipe["bubble_fraction"] == pytest.approx(1 - 7.0 / 16.0)
    assert pipe["forward_minus_max_stage_s"] == pytest.approx(0.05 - 0.04)
    assert pipe["forward_minus_stage_sum_s"] == pytest.approx(0.05 - 0.07)


def test_step_figures_one_process_has_no_pipeline(tool):
    before = _scrape(0.4, 10, [], engine_busy=0.5)
    after = _scrape(2.4, 50, [], engine_busy=2.5)
    figures = tool.step_figures(before, after, 4.0)
    assert figures["pipeline"] is None
    assert figures["phase_mean_s"]["forward"] == pytest.approx(0.05)
    assert figures["engine_busy_fraction"] == pytest.approx(0.5)


def test_stage_labels_sort_as_numbers(tool):
    samples = {"x": [({"stage": "10"}, 1.0), ({"stage": "2"}, 1.0), ({"stage": "0"}, 1.0)]}
    assert tool.label_values(samples, "x", "stage") == ["0", "2", "10"]
