"""``/metrics`` of a data-parallel server: each replica's samples get a
``replica`` label and every metric stays one group under its HELP/TYPE lines
(the text format requires it; the Prometheus parser reads it back)."""

from kvserve.distributed.client import label_replicas
from kvserve.observability.metrics import EngineMetrics, parse_metrics_text


def test_replica_label_on_every_sample_and_families_grouped():
    first, second = EngineMetrics("m", 64, 16), EngineMetrics("m", 64, 16)
    first.set_load(3, 1, 0.5)
    second.set_load(1, 0, 0.25)
    text = label_replicas([first.render().decode(), second.render().decode()])
    samples = parse_metrics_text(text)
    running = {labels["replica"]: value for labels, value in
               samples["kvserve:num_requests_running"]}
    assert running == {"0": 3.0, "1": 1.0}
    assert all("replica" in labels for rows in samples.values() for labels, _ in rows)
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    lines = text.splitlines()
    at = lines.index("# TYPE kvserve:num_requests_running gauge")
    assert [line.split("{")[0] for line in lines[at + 1:at + 3]] == \
        ["kvserve:num_requests_running"] * 2
