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


class _Remote:
    def __init__(self, answer):
        self.answer = answer

    def remote(self):
        async def call():
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer
        return call()


class _Replica:
    def __init__(self, answer):
        self.metrics_text = _Remote(answer)


def test_metrics_answer_while_a_replica_is_down():
    """Issue 47, item 9: a replica that is down (its call raises, as Ray's
    ``RayActorError`` does) no longer makes ``/metrics`` a 500: the others'
    samples, and ``kvserve:replica_up`` 1 / 0 per replica."""
    import asyncio

    from kvserve.distributed.client import DataParallelClient

    client = object.__new__(DataParallelClient)
    up_text = ('# HELP kvserve:num_requests_running Running.\n'
               '# TYPE kvserve:num_requests_running gauge\n'
               'kvserve:num_requests_running{model_name="m"} 2.0\n')
    client.replicas = [_Replica(up_text), _Replica(RuntimeError("actor died"))]
    samples = parse_metrics_text(asyncio.run(client.metrics_text()))
    assert samples["kvserve:num_requests_running"] == [({"replica": "0", "model_name": "m"},
                                                        2.0)]
    assert {labels["replica"]: value for labels, value in samples["kvserve:replica_up"]} == \
        {"0": 1.0, "1": 0.0}
