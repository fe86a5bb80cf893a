"""Read-only views of the server under soak: ``/health``, the load gauges of
``/metrics``, and the process's open file descriptors and RSS (``/proc``),
with a poller that waits for a condition.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from kvserve.testing.soak_plans import Target

#: The load gauges of ``/metrics`` that must be back to idle after the load.
GAUGES = ("kvserve:num_requests_running", "kvserve:num_requests_waiting",
          "kvserve:kv_cache_usage_perc")


def parse_gauges(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        value = rest.rsplit("}", 1)[-1].split() if "{" in line else rest.split()
        try:
            out[name] = out.get(name, 0.0) + float(value[0])
        except (IndexError, ValueError):
            continue
    return out


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (``/proc/PID/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def fd_count(pid: int) -> int | None:
    """Open file descriptors of process ``pid`` (``/proc/PID/fd``); None if
    unreadable or the process is gone."""
    try:
        count = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    return count if alive(pid) else None


def rss_mib(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB (``VmRSS`` of ``/proc/PID/status``)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler:
    """Samples ``rss_mib(pid)`` every ``period_s`` seconds in the background;
    keeps the peak and every ``(seconds since start, MiB)`` sample."""

    def __init__(self, pid: int | None, period_s: float = 1.0) -> None:
        self.pid, self.period_s = pid, period_s
        self.peak: float | None = None
        self.samples: list[tuple[float, float]] = []
        self._start = time.monotonic()
        self._task: asyncio.Task | None = None

    def sample(self) -> float | None:
        value = rss_mib(self.pid) if self.pid else None
        if value is not None:
            self.peak = value if self.peak is None else max(self.peak, value)
            self.samples.append((round(time.monotonic() - self._start, 1), value))
        return value

    async def _loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        if self.pid:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sample()


async def wait_until(read: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool],
                     deadline: float, interval_s: float = 0.25) -> tuple[bool, Any]:
    """Poll ``read()`` until ``ok(value)`` or ``deadline`` (``time.monotonic``
    seconds); returns (ok, the last value)."""
    while True:
        value = await read()
        if ok(value):
            return True, value
        if time.monotonic() >= deadline:
            return False, value
        await asyncio.sleep(interval_s)


class Server:
    """Read-only views of the server under test (HTTP and ``/proc``)."""

    def __init__(self, client: httpx.AsyncClient, pid: int | None) -> None:
        self.client, self.pid = client, pid

    async def health(self) -> int | None:
        try:
            return (await self.client.get("/health")).status_code
        except httpx.HTTPError:
            return None

    async def gauges(self) -> dict[str, float] | None:
        """The load gauges found in ``/metrics`` ({}: none, e.g. no such
        route); None when the server did not answer."""
        try:
            resp = await self.client.get("/metrics")
        except httpx.HTTPError:
            return None
        values = parse_gauges(resp.text) if resp.status_code == 200 else {}
        return {name: values[name] for name in GAUGES if name in values}

    async def fds(self) -> int | None:
        return fd_count(self.pid) if self.pid else None

    async def target(self, max_tokens: int, burst_size: int) -> Target:
        """Model id and ``max_model_len`` from ``GET /v1/models``."""
        resp = await self.client.get("/v1/models")
        resp.raise_for_status()
        card = (resp.json().get("data") or [{}])[0]
        return Target(card.get("id"), card.get("max_model_len"), max_tokens, burst_size)


def idle_gauges(baseline_kv: float) -> Callable[[dict[str, float] | None], bool]:
    """A test of ``Server.gauges``' reading: nothing running or waiting and
    KV usage at most ``baseline_kv``."""
    def ok(g: dict[str, float] | None) -> bool:
        return g is not None and g.get(GAUGES[0], 0.0) == 0 and g.get(GAUGES[1], 0.0) == 0 \
            and g.get(GAUGES[2], 0.0) <= baseline_kv + 1e-9
    return ok
