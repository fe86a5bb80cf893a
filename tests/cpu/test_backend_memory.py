"""Issue 48 item 6: a KV cache larger than the memory left after the weights
is named at start-up (its pages are committed as requests fill it, so such a
server starts and is killed for memory later, under load)."""

from __future__ import annotations

from types import SimpleNamespace

from structlog.testing import capture_logs

from kvserve.cpu import backend
from kvserve.cpu.backend import CpuBackend, available_memory_bytes

MEMINFO = "MemTotal:       24683792 kB\nMemFree:         1000000 kB\nMemAvailable:    2097152 kB\n"


def test_available_memory_is_memavailable_in_bytes(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    assert available_memory_bytes(str(path)) == 2 * 2**30
    assert available_memory_bytes(str(tmp_path / "missing")) is None
    path.write_text("MemTotal: 1 kB\n")
    assert available_memory_bytes(str(path)) is None


def _cpu(kv_bytes: int) -> CpuBackend:
    cpu = object.__new__(CpuBackend)  # no thread policy: only the sizing is tested
    cpu.config = SimpleNamespace(cache=SimpleNamespace(kv_cache_memory=kv_bytes))
    return cpu


def test_a_kv_cache_beyond_the_memory_left_is_named(monkeypatch):
    monkeypatch.setattr(backend, "available_memory_bytes", lambda: 2 * 2**30)
    with capture_logs() as logs:
        assert _cpu(3 * 2**30).kv_cache_bytes(None, 10**9) == 3 * 2**30  # as asked
        assert _cpu(2**30).kv_cache_bytes(None, 10**9) == 2**30
    (warning,) = logs
    assert warning["event"] == "kv_cache_exceeds_memory" and warning["log_level"] == "warning"
    assert (warning["kv_cache_bytes"], warning["available_bytes"]) == (3 * 2**30, 2 * 2**30)
    assert "3.00 GiB" in warning["message"] and "2.00 GiB" in warning["message"]
    assert "--kv-cache-memory" in warning["message"]
