"""Fault injection, for tests and soak runs only.

An engine option (``EngineConfig.fault_injection``, ``kvserve serve
--fault-injection JSON``), off by default; nothing in a request can turn it
on. It makes the engine fail the ways it must survive:

- a **step raises** (every ``step_every``-th step, or any step that runs one
  of ``request_ids``): the scheduler fails exactly that step's requests with
  a 500 error event, frees their blocks, and the engine serves the next one;
- the **worker is slow** (``step_delay_seconds`` before each step);
- an **actor dies** (``kill_actor`` at its ``kill_after_messages``-th
  message, with an exception its error handling does not catch, as a bug in
  its run loop would): the engine fails every open request, refuses new ones
  and ``/health`` answers 503 with the reason.

JSON shape (every key optional): ``{"step_every": 10, "request_ids":
["r1"], "step_delay_seconds": 0.05, "kill_actor": "scheduler",
"kill_after_messages": 3}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

#: Actors ``kill_actor`` may name (``kvserve.actors.*.name``).
ACTOR_NAMES = ("tokenizer", "admission", "scheduler", "worker", "detokenizer", "stats")


class InjectedFault(RuntimeError):
    """A step failure made on purpose (never raised without fault injection)."""


class InjectedActorDeath(BaseException):
    """Kills an actor: a ``BaseException``, so ``Actor._dispatch``, which
    catches ``Exception``, lets it end the actor's task."""


@dataclass(frozen=True)
class FaultInjection:
    """Which faults to inject; the defaults inject none (see the module docstring).

    Raises ``ValueError`` for a negative count or delay, or an unknown actor.
    """

    step_every: int = 0
    request_ids: frozenset[str] = field(default_factory=frozenset)
    step_delay_seconds: float = 0.0
    kill_actor: str | None = None
    kill_after_messages: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_ids", frozenset(self.request_ids))
        if self.step_every < 0 or self.step_delay_seconds < 0 or self.kill_after_messages < 1:
            raise ValueError("step_every and step_delay_seconds must be >= 0, "
                             "kill_after_messages >= 1")
        if self.kill_actor is not None and self.kill_actor not in ACTOR_NAMES:
            raise ValueError(f"kill_actor must be one of {ACTOR_NAMES}, got {self.kill_actor!r}")

    @classmethod
    def from_json(cls, text: str) -> FaultInjection:
        """Parse ``--fault-injection``; ``ValueError`` names a bad key or value."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("--fault-injection takes a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown --fault-injection keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    @property
    def faults_steps(self) -> bool:
        """True when steps raise or are slowed (the worker's runner is wrapped)."""
        return bool(self.step_every or self.request_ids or self.step_delay_seconds)

    def step_fails(self, step_id: int, request_ids: tuple[str, ...]) -> bool:
        """Whether step ``step_id`` running ``request_ids`` raises; a sample
        ``{id}-{i}`` of a request ``id`` with ``n > 1`` counts as ``id``."""
        if self.step_every and step_id % self.step_every == self.step_every - 1:
            return True
        return any(rid in self.request_ids or rid.rpartition("-")[0] in self.request_ids
                   for rid in request_ids)


class FaultyRunner:
    """A ``ModelRunner`` whose ``execute`` first sleeps, and whose forward
    pass raises ``InjectedFault`` in a step ``FaultInjection.step_fails``
    picks; everything else is the runner's.

    The fault is raised inside the runner's forward (``ModelRunner._forward``
    is wrapped), after the step's request states were updated, so the step
    fails the way a backend error does and the runner's own clean-up runs.
    ``faulted``: ``(step_id, request ids)`` of each step that raised, in order
    (written on the worker thread; read it once the steps are done).
    """

    def __init__(self, runner: Any, faults: FaultInjection) -> None:
        self.runner = runner
        self.faults = faults
        self.faulted: list[tuple[int, tuple[str, ...]]] = []
        self._failing: tuple[int, tuple[str, ...]] | None = None
        forward = runner._forward

        def faulty_forward(batch: Any) -> Any:
            if self._failing is not None:
                self.faulted.append(self._failing)
                raise InjectedFault(f"fault injected in step {self._failing[0]}")
            return forward(batch)

        runner._forward = faulty_forward

    def execute(self, scheduler_output: Any) -> Any:
        if self.faults.step_delay_seconds:
            time.sleep(self.faults.step_delay_seconds)
        ids = tuple(chunk.request_id for chunk in scheduler_output.scheduled)
        step = scheduler_output.step_id
        self._failing = (step, ids) if self.faults.step_fails(step, ids) else None
        return self.runner.execute(scheduler_output)

    @property
    def kv_connector(self) -> Any:
        """The wrapped runner's KV connector (the worker may set it)."""
        return self.runner.kv_connector

    @kv_connector.setter
    def kv_connector(self, connector: Any) -> None:
        self.runner.kv_connector = connector

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def arm_actor_death(actor: Any, after_messages: int) -> None:
    """Make ``actor.handle`` raise ``InjectedActorDeath`` at its
    ``after_messages``-th message (1 = the first)."""
    handle: Callable[[Any], Any] = actor.handle
    count = 0

    async def dying_handle(message: Any) -> None:
        nonlocal count
        count += 1
        if count >= after_messages:
            raise InjectedActorDeath(f"fault injected: the {actor.name} actor dies at "
                                     f"message {count} ({type(message).__name__})")
        await handle(message)

    actor.handle = dying_handle
