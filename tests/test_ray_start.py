"""Which Ray the data-parallel server starts or joins (issue 32, item 0): a
recorded cluster that is gone gives way to a local Ray with one warning; a
named cluster that does not answer is one line and exit status 2, before
anything loads. Real sockets on 127.0.0.1; Ray is not imported."""

from __future__ import annotations

import socket

import pytest
from structlog.testing import capture_logs

from kvserve.cli import main
from kvserve.distributed.ray_start import RayUnreachable, ray_init_address


@pytest.fixture
def listening():
    """``127.0.0.1:port`` of a socket that accepts connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def closed():
    """``127.0.0.1:port`` where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


def record(tmp_path, address: str) -> dict:
    """An environment whose Ray temp dir records ``address``, as ``ray start`` does."""
    (tmp_path / "ray").mkdir(exist_ok=True)
    (tmp_path / "ray" / "ray_current_cluster").write_text(address + "\n")
    return {"RAY_TMPDIR": str(tmp_path)}


def test_nothing_named_or_recorded_starts_a_local_ray(tmp_path):
    assert ray_init_address(None, {"RAY_TMPDIR": str(tmp_path)}) is None


def test_a_recorded_cluster_that_is_gone_gives_way_to_a_local_ray(tmp_path, closed):
    with capture_logs() as logs:
        assert ray_init_address(None, record(tmp_path, closed), timeout=1.0) == "local"
    assert [(e["event"], e["address"]) for e in logs] == [("ray_recorded_cluster_gone", closed)]


def test_a_recorded_cluster_that_answers_is_joined(tmp_path, listening):
    assert ray_init_address(None, record(tmp_path, listening), timeout=1.0) == listening


def test_a_named_cluster_must_answer(tmp_path, closed, listening):
    env = {"RAY_TMPDIR": str(tmp_path)}
    assert ray_init_address(listening, env, timeout=1.0) == listening
    assert ray_init_address("local", record(tmp_path, closed)) == "local"
    with pytest.raises(RayUnreachable, match=f"--ray-address {closed}: no Ray cluster answers"):
        ray_init_address(closed, env, timeout=1.0)
    with pytest.raises(RayUnreachable, match=f"RAY_ADDRESS {closed}: no Ray cluster answers"):
        ray_init_address(None, {**env, "RAY_ADDRESS": closed}, timeout=1.0)
    with pytest.raises(RayUnreachable, match="auto: the Ray cluster recorded"):
        ray_init_address("auto", record(tmp_path, closed), timeout=1.0)


def test_serve_with_an_unreachable_ray_address_is_one_line_and_exit_2(closed, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--data-parallel-size", "2", "--ray-address", closed])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"kvserve: error: --ray-address {closed}: no Ray cluster answers")
    assert len([line for line in err if line.startswith("kvserve: error")]) == 1


def test_ray_init_keeps_the_servers_signal_handlers(monkeypatch):
    """Issue 47, item 7: ``ray.init`` installs its own SIGTERM / SIGINT
    handlers, which replaced the server's drain; ``start_ray`` puts the
    server's back."""
    import signal
    import sys
    import types

    from kvserve.distributed import ray_start

    def drain(signum, frame):  # the server's handler
        pass

    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: False
    fake.init = lambda **kwargs: (signal.signal(signal.SIGTERM, signal.SIG_DFL),
                                  signal.signal(signal.SIGINT, signal.SIG_DFL))
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(ray_start, "ray_init_address", lambda explicit: None)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        signal.signal(signal.SIGTERM, drain)
        signal.signal(signal.SIGINT, drain)
        ray_start.start_ray(None)
        assert signal.getsignal(signal.SIGTERM) is drain
        assert signal.getsignal(signal.SIGINT) is drain
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_ray_starts_with_its_memory_monitor_off_unless_the_user_set_it(monkeypatch):
    """Issue 47, item 11: Ray's memory monitor killed replicas and stages on a
    busy host; a local Ray started by kvserve runs without it, and a value
    the user put in the environment is kept."""
    import os
    import sys
    import types

    from kvserve.distributed import ray_start

    seen = {}
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: False
    fake.init = lambda **kwargs: seen.update(os.environ)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(ray_start, "ray_init_address", lambda explicit: None)
    monkeypatch.delenv("RAY_memory_monitor_refresh_ms", raising=False)
    ray_start.start_ray(None)
    assert seen["RAY_memory_monitor_refresh_ms"] == "0"
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "250")
    ray_start.start_ray(None)
    assert seen["RAY_memory_monitor_refresh_ms"] == "250"


class _Died(Exception):
    """Stands in for Ray's ``RayActorError``."""


class _Replica:
    """A replica handle whose process dies during the first ``deaths`` starts."""

    def __init__(self, deaths: int) -> None:
        self.deaths = deaths
        self.starts = 0
        self.start = self  # ``replica.start.remote()``

    async def remote(self):
        self.starts += 1
        if self.starts <= self.deaths:
            raise _Died("The actor died unexpectedly before finishing this task.\nmore")
        return {"num_kv_tokens": 64}


def test_a_replica_killed_during_start_up_is_started_again():
    """Issue 47, item 11: a replica killed while it loads (Ray restarts its
    process) is started again, with a log line, instead of the whole
    server exiting with a traceback; one that keeps dying is one line."""
    import asyncio

    from kvserve.distributed.client import start_replica

    replica = _Replica(deaths=2)
    with capture_logs() as logs:
        info = asyncio.run(start_replica(replica, 1, _Died, tries=3))
    assert info == {"num_kv_tokens": 64} and replica.starts == 3
    assert [(e["event"], e["attempt"]) for e in logs] == [("replica_restarted", 1),
                                                          ("replica_restarted", 2)]
    assert logs[0]["error"] == "The actor died unexpectedly before finishing this task."
    with pytest.raises(RuntimeError, match=r"^replica 0 died during start-up 3 times \(last: "
                       r"The actor died unexpectedly before finishing this task\.\); is the "
                       r"machine out of memory\?$"):
        asyncio.run(start_replica(_Replica(deaths=5), 0, _Died, tries=3))
