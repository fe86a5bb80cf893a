"""WorkerActor: runs the ModelRunner on a dedicated thread, never on the event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvserve.actors.base import Actor, Mailbox
from kvserve.actors.messages import AttachTier, DropImports, ExecuteStep, ImportBlocks, StepResult
from kvserve.kv_offload.kv_connector import log_offload_tier
from kvserve.model.runner import KVCacheLost, KVLoadLost


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

    The runner's KV connector (``runner.kv_connector``) is the worker's alone:
    a step's saves, loads and exports travel in ``ExecuteStep``'s scheduler
    output and come back in ``StepResult``; imported blocks (``ImportBlocks``),
    imports no step will load (``DropImports``) and a tier to attach
    (``AttachTier``) arrive in this inbox. Messages are handled one at a time
    and a step is awaited before the next message, so the connector is never
    touched by two threads at once. ``make_connector``: builds a connector
    for a runner that has none when a tier is attached (None: attaching
    fails with ``ValueError``).
    """

    name = "worker"
    accepts = (ExecuteStep, ImportBlocks, DropImports, AttachTier)

    def __init__(self, runner, scheduler: Mailbox, executor: ThreadPoolExecutor | None = None,
                 make_connector: Callable[[], object] | None = None,
                 inbox: Mailbox | None = None) -> None:
        super().__init__(inbox)
        self.runner = runner
        self.scheduler = scheduler
        self.make_connector = make_connector
        self._executor = executor or worker_executor()
        self._tail: asyncio.Task | None = None  # the last pipelined step's finish

    async def handle(self, message) -> None:
        if isinstance(message, ExecuteStep):
            await self._execute(message)
        elif isinstance(message, ImportBlocks):
            self._connector().add_import(message.request_id, message.block_hashes, message.data)
        elif isinstance(message, DropImports):
            if self.runner.kv_connector is not None:
                self.runner.kv_connector.drop_imports(message.request_ids)
        elif isinstance(message, AttachTier):
            self._attach(message)

    async def _execute(self, message: ExecuteStep) -> None:
        if getattr(self.runner, "overlaps_steps", False):
            await self._begin(message)
            return
        loop = asyncio.get_running_loop()
        out = message.scheduler_output
        start = time.monotonic()
        try:
            if out.kv_export_ids or out.kv_loads or out.kv_saves:
                self._connector()  # the first transfer of an engine with no tier
            output = await loop.run_in_executor(self._executor, self.runner.execute,
                                                message.scheduler_output)
            error = None
        except KVLoadLost as exc:  # not a fault of the step's: its requests start again
            self.log.warning("kv_load_lost", step_id=message.step_id, error=str(exc))
            self.scheduler.send(StepResult(message.step_id, out, None, start, time.monotonic(),
                                           f"KVLoadLost: {exc}", kv_load_lost=True))
            return
        except Exception as exc:  # noqa: BLE001 - a failed step must not stop the engine
            self.log.exception("step_failed", step_id=message.step_id)
            output, error = None, f"{type(exc).__name__}: {exc}"
        self.scheduler.send(StepResult(message.step_id, message.scheduler_output, output,
                                       start, time.monotonic(), error))

    async def _begin(self, message: ExecuteStep) -> None:
        """A pipelined runner's step (``kvserve.distributed.pipeline``): begin
        it on the worker thread (the stages start on it), and finish it in a
        task that first awaits the step before it, so the next message (the
        next step) begins while this one is still in the stages, and the
        scheduler gets the results in step order."""
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        out = message.scheduler_output
        try:
            pending, error = await loop.run_in_executor(self._executor, self.runner.begin,
                                                        out), None
        except Exception as exc:  # noqa: BLE001 - a failed step must not stop the engine
            self.log.exception("step_failed", step_id=message.step_id)
            pending, error = None, exc
        self._tail = asyncio.create_task(self._finish(message, pending, error, start,
                                                      self._tail))

    async def _finish(self, message: ExecuteStep, pending, error: Exception | None,
                      start: float, before: asyncio.Task | None) -> None:
        loop = asyncio.get_running_loop()
        if before is not None:
            await before
        output = None
        if pending is not None:
            try:
                future = pending.future()
                if future is not None:
                    await asyncio.wrap_future(future)
            except Exception:  # noqa: BLE001 - finish raises it again, as KVCacheLost
                pass
            try:
                output = await loop.run_in_executor(self._executor, self.runner.finish,
                                                    pending, message.scheduler_output)
            except Exception as exc:  # noqa: BLE001
                self.log.exception("step_failed", step_id=message.step_id)
                error = exc
        self.scheduler.send(StepResult(
            message.step_id, message.scheduler_output, output, start, time.monotonic(),
            None if error is None else f"{type(error).__name__}: {error}",
            kv_lost=isinstance(error, KVCacheLost) or bool(output and output.kv_lost),
            kv_load_lost=isinstance(error, KVLoadLost)))

    def _connector(self):
        """The runner's connector, built on first need."""
        if self.runner.kv_connector is None:
            if self.make_connector is None:
                raise ValueError("this engine has no KV connector")
            self.runner.kv_connector = self.make_connector()
        return self.runner.kv_connector

    def _attach(self, message: AttachTier) -> None:
        try:
            connector = self._connector()
            connector.attach_tier(message.path)
            log_offload_tier(connector)
            error = None
        except ValueError as exc:
            error = exc
        if message.reply is not None and not message.reply.done():
            message.reply.set_result(error)

    def on_error(self, message, exc: Exception) -> None:
        """A message that raised: an attach's caller gets the error."""
        reply = getattr(message, "reply", None)
        if reply is not None and not reply.done():
            reply.set_result(exc)

    async def stop(self) -> None:
        await super().stop()
        if self._tail is not None:
            await asyncio.gather(self._tail, return_exceptions=True)
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.close()
        self._executor.shutdown(wait=True)
