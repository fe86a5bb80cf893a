"""WorkerActor: runs the ModelRunner on a dedicated thread, never on the event loop."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from kvserve.actors.base import Actor
from kvserve.actors.messages import ExecuteStep, StepResult


def worker_executor() -> ThreadPoolExecutor:
    """The one thread that builds the runner and runs every step (a backend's
    buffers and streams belong to the thread that made them)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-worker")


class WorkerActor(Actor):
    """Executes one step at a time and reports a ``StepResult`` to the scheduler.

    The forward pass runs on a single worker thread (the NumPy/Numba kernels
    release the GIL), so the API keeps streaming while step N computes. A step
    that raises becomes a ``StepResult`` with ``error`` set: the scheduler
    fails exactly that step's requests and the engine goes on. ``executor``:
    the thread the runner was built on (``worker_executor``; a new one if None).
    """

    name = "worker"

    def __init__(self, runner, scheduler: Actor, executor: ThreadPoolExecutor | None = None
                 ) -> None:
        super().__init__()
        self.runner = runner
        self.scheduler = scheduler
        self._executor = executor or worker_executor()

    async def handle(self, message: ExecuteStep) -> None:
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        try:
            output = await loop.run_in_executor(self._executor, self.runner.execute,
                                                message.scheduler_output)
            error = None
        except Exception as exc:  # noqa: BLE001 - a failed step must not stop the engine
            self.log.exception("step_failed", step_id=message.step_id)
            output, error = None, f"{type(exc).__name__}: {exc}"
        self.scheduler.send(StepResult(message.step_id, message.scheduler_output, output,
                                       start, time.monotonic(), error))

    async def stop(self) -> None:
        await super().stop()
        self._executor.shutdown(wait=True)
