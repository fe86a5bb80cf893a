"""Stall detection: has the engine had work and finished no step for too long?

A live engine with requests running or waiting finishes a step every few
milliseconds to seconds; one that has work and finished none for
``timeout`` seconds is wedged (a kernel that never returns, a worker thread
stuck in a library call), whatever its event loop still answers. vLLM's V0
engine raised after ``VLLM_ENGINE_ITERATION_TIMEOUT_S`` (60 s) without an
iteration; here the engine stays up and says so: ``/health`` answers 503,
the ``kvserve:engine_stall_seconds`` gauge climbs and ``engine_stalled`` is
logged. Pure logic on the caller's clock (``time.monotonic()`` seconds).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineHealth:
    """One health reading: ``stalled_seconds`` the engine has had work
    without finishing a step (0 while idle), the ``timeout`` it is judged
    by, and the load (requests running, and waiting here or in admission)."""

    stalled_seconds: float
    timeout: float
    num_running: int
    num_waiting: int

    @property
    def is_stalled(self) -> bool:
        """True when work has waited ``timeout`` seconds or more for a step."""
        return self.stalled_seconds >= self.timeout

    def reason(self) -> str:
        """Why ``/health`` refuses: the figures, in one sentence."""
        return (f"no engine step finished for {self.stalled_seconds:.0f} s while "
                f"{self.num_running} request(s) ran and {self.num_waiting} waited "
                f"(limit {self.timeout:g} s, --stall-timeout)")


class StallWatch:
    """Tracks when the engine last made progress while it had work.

    ``on_load(now, has_work)`` after every change of load and
    ``on_step(now)`` after every finished step; ``stalled_seconds(now)`` is
    the time since the later of the last step and the moment work appeared,
    0 while there is no work (an idle engine is not stalled, and work that
    just arrived after an idle hour is not an hour late).

    Raises ``ValueError`` for a ``timeout`` that is not positive.
    """

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"stall timeout must be > 0, got {timeout}")
        self.timeout = timeout
        self._since: float | None = None  # progress clock while busy; None while idle

    def on_load(self, now: float, has_work: bool) -> None:
        """The engine has work (running or waiting requests, steps in flight) or not."""
        if not has_work:
            self._since = None
        elif self._since is None:
            self._since = now

    def on_step(self, now: float) -> None:
        """A step finished: progress (the clock restarts if work remains)."""
        if self._since is not None:
            self._since = now

    def stalled_seconds(self, now: float) -> float:
        """Seconds with work and no finished step (0 while idle)."""
        return 0.0 if self._since is None else max(0.0, now - self._since)

    def reading(self, now: float, num_running: int, num_waiting: int) -> EngineHealth:
        """The ``EngineHealth`` at ``now`` with this load."""
        return EngineHealth(self.stalled_seconds(now), self.timeout, num_running, num_waiting)
