"""The soak's load: the traffic mix (``DEFAULT_MIX``, ``--mix``), one draw
of it (``make_plans``), the request budget, and the workers and probe that
spend it (``run_load``).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, replace

import httpx

from kvserve.testing.soak_attacks import constraint_plan, flood_plan, smuggle_plan
from kvserve.testing.soak_plans import (Plan, Target, bad_plan, generation_plan, oversized_plan,
                                        probe_plan, samples_plan)
from kvserve.testing.soak_send import Attempt, send

#: Default traffic mix (relative weights of the request kinds).
DEFAULT_MIX = {"stream": 0.3, "plain": 0.2, "disconnect": 0.1, "bad": 0.15, "burst": 0.05,
               "oversized": 0.05, "slow": 0.15, "constraint": 0.04, "smuggle": 0.03,
               "flood": 0.03, "samples": 0.03}


def parse_mix(text: str | None) -> dict[str, float]:
    """``"stream=3,bad=1"`` -> weights (kinds left out get 0); None: the default."""
    if not text:
        return dict(DEFAULT_MIX)
    mix = dict.fromkeys(DEFAULT_MIX, 0.0)
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or name not in DEFAULT_MIX or float(value) < 0:
            raise ValueError(f"bad --mix item {item!r}: use KIND=WEIGHT with KIND in "
                             f"{', '.join(DEFAULT_MIX)}")
        mix[name] = float(value)
    if sum(mix.values()) <= 0:
        raise ValueError("--mix needs a positive weight")
    return mix


def make_plans(kind: str, rng: random.Random, target: Target) -> list[Plan]:
    """The request(s) of one draw of the mix: one, or ``burst_size`` for a burst."""
    if kind in ("stream", "plain"):
        return [generation_plan(kind, rng, target, stream=kind == "stream")]
    if kind == "disconnect":
        plan = generation_plan(kind, rng, target, stream=True, max_tokens=target.max_tokens,
                               ignore_eos=True)
        return [replace(plan, hangup_after=rng.randint(1, 2))]
    if kind == "slow":
        plan = generation_plan(kind, rng, target, stream=True,
                               max_tokens=rng.randint(2, max(2, target.max_tokens // 2)))
        return [replace(plan, pause_s=round(rng.uniform(0.05, 0.4), 3))]
    if kind == "bad":
        return [bad_plan(rng, target)]
    if kind in ("oversized", "flood"):
        plan = None
        if target.max_model_len:  # unknown limit: nothing is sure to be too long
            plan = oversized_plan(rng, target) if kind == "oversized" else flood_plan(rng, target)
        return [plan or generation_plan("stream", rng, target, stream=True)]
    if kind == "constraint":
        return [constraint_plan(rng, target)]
    if kind == "smuggle":
        return [smuggle_plan(rng, target)]
    if kind == "samples":
        return [samples_plan(rng, target)]
    if kind == "burst":
        return [generation_plan("burst", rng, target, stream=rng.random() < 0.5)
                for _ in range(target.burst_size)]
    raise ValueError(f"unknown request kind {kind!r}")


class Budget:
    """Requests left to send: stops at ``deadline`` (``time.monotonic``
    seconds), after ``max_requests``, or at ``stop()``, whichever comes first.
    ``granted`` counts the requests granted: each must end as one outcome
    (``check_accounted``)."""

    def __init__(self, deadline: float, max_requests: int | None) -> None:
        self.deadline = deadline
        self.left = max_requests if max_requests is not None else 1 << 62
        self.granted = 0
        self.stopped: str | None = None  # why the load stopped early

    def stop(self, reason: str) -> None:
        self.stopped = self.stopped or reason

    def take(self, n: int) -> int:
        """Reserve up to ``n`` requests; how many were granted (0: stop)."""
        if time.monotonic() >= self.deadline or self.left <= 0 or self.stopped:
            return 0
        granted = min(n, self.left)
        self.left -= granted
        self.granted += granted
        return granted


async def _worker(client: httpx.AsyncClient, rng: random.Random, mix: dict[str, float],
                  target: Target, budget: Budget, timeout_s: float,
                  results: list[Attempt]) -> None:
    kinds, weights = list(mix), list(mix.values())
    while True:
        plans = make_plans(rng.choices(kinds, weights)[0], rng, target)
        granted = budget.take(len(plans))
        if not granted:
            return
        attempts = await asyncio.gather(*(send(client, p, timeout_s) for p in plans[:granted]))
        _stop_if_server_gone(budget, attempts)
        results.extend(attempts)


def _stop_if_server_gone(budget: Budget, attempts: list[Attempt]) -> None:
    """A refused connection means no server on the port: stop the load
    rather than spin on connection errors."""
    for a in attempts:
        if a.outcome == "transport_error" and \
                (a.detail or "").startswith(("ConnectError", "ConnectionRefusedError")):
            budget.stop(f"cannot connect: {a.detail}")


async def _probe(client: httpx.AsyncClient, target: Target, budget: Budget, timeout_s: float,
                 results: list[Attempt]) -> None:
    plan = probe_plan(target)
    while budget.take(1):
        attempt = await send(client, plan, timeout_s)
        _stop_if_server_gone(budget, [attempt])
        results.append(attempt)


@dataclass
class Load:
    """What ``run_load`` did: the attempts, its duration (s), the requests
    the budget granted and why it stopped early (None: it ran to its bound)."""

    attempts: list[Attempt]
    duration_s: float
    granted: int
    stopped: str | None


async def run_load(base_url: str, target: Target, *, concurrency: int, mix: dict[str, float],
                   seed: int, duration_s: float, max_requests: int | None, timeout_s: float,
                   headers: dict[str, str]) -> Load:
    """``concurrency`` workers and the probe until the budget is spent; in-flight
    requests are let finish."""
    budget = Budget(time.monotonic() + duration_s, max_requests)
    results: list[Attempt] = []
    limits = httpx.Limits(max_connections=concurrency * (target.burst_size + 1) + 8)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits,
                                 headers=headers) as client:
        tasks = [_worker(client, random.Random(f"{seed}/{i}"), mix, target, budget, timeout_s,
                         results) for i in range(concurrency)]
        await asyncio.gather(_probe(client, target, budget, timeout_s, results), *tasks)
    return Load(results, time.perf_counter() - start, budget.granted, budget.stopped)
