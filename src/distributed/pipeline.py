"""Pipeline parallelism: the engine's steps through P stage processes on Ray.

``--pipeline-parallel-size P`` splits the decoder layers into P contiguous
stages (``kvserve.core.parallel.pp_layer_ranges``), each a
``PipelineStage`` Ray actor with its layers' weights and KV cache. The
engine keeps one scheduler, whose block tables serve every stage, and one
``PipelineRunner``: the model runner's request states, flat batch and
sampler, with the forward pass replaced by a chain of Ray calls. The batch
is put in Ray's object store once and every stage reads it; each stage's
``(x, residual)`` goes to the next as an object reference, so on one node
the hidden states pass through shared memory, across nodes over the
network, and the engine's process waits only for the last stage's logits.

Micro-batches (vLLM's ``max_concurrent_batches`` = P): the worker actor
begins step N+1 (``PipelineRunner.begin``) while step N is still in a
later stage and finishes steps in order (``finish``); the scheduler keeps
requests whose token is in flight out of the next step and gives each step
at most 1/P of the decoding requests (``SchedulerConfig.pipeline_parallel_size``),
so two steps of disjoint requests fill two stages. The scheduler's
invariants allow two steps in flight (``core.scheduler``), so with P > 2
stages two micro-batches are in flight, not P.

A stage whose process dies: Ray restarts it (``max_restarts=-1``) with an
empty KV cache. The steps that reach the dead or the new process fail with
``KVCacheLost`` (the stage checks the incarnation it is sent,
``pipeline_stage``); the scheduler then restarts the running requests from
their prompts (a preemption by recompute, reason ``kv_cache_lost``; a
request that loses its K/V at every try fails after a few) and forgets
every cached block (``StepResult.kv_lost``). A watcher thread pings the
stages every ``WATCH_INTERVAL`` seconds in their ``health`` concurrency
group (beside their compute calls, not behind them), so that ``/health``
answers 503 ``unavailable`` while one is down, and a restart noticed while
idle costs no request: the next step runs if none of its requests reads
cached K/V, and tells the scheduler to forget the cache.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import structlog

from kvserve.config import EngineConfig, ModelConfig
from kvserve.core.outputs import SchedulerOutput
from kvserve.core.parallel import pp_layer_ranges
from kvserve.distributed.pipeline_stage import PipelineStage
from kvserve.distributed.ray_start import start_ray
from kvserve.model.ops import DecodePath
from kvserve.model.runner import KVCacheLost, ModelRunner, ModelRunnerOutput, _Step

log = structlog.get_logger("kvserve.pipeline")

#: Seconds the stages together have to load (weights, KV cache, compile).
STAGE_START_SECONDS = 900.0
#: Seconds between two pings of the stages (the watcher thread).
WATCH_INTERVAL = 1.0
#: Seconds a ping may take before the stage counts as down (a restarting
#: stage takes longer: it loads its weights first). A ping runs in the
#: stage's ``health`` concurrency group, beside its compute calls, never
#: queued behind them (a busy stage is not a dead one).
PING_SECONDS = 1.0
#: Ray concurrency groups of a stage actor: its calls run one at a time in
#: order (the default group), pings in a thread of their own.
STAGE_CONCURRENCY_GROUPS = {"health": 1}
#: Seconds a step waits for a restarting stage before it fails.
RESTART_WAIT_SECONDS = 600.0


@dataclass(frozen=True)
class StageInfo:
    """One worker as the engine knows it: its stage, TP rank, layers, heads,
    process, sizes and the decode path of its layers."""

    index: int
    tp_rank: int
    layers: range
    q_heads: int
    kv_heads: int
    pid: int
    incarnation: str
    weights_bytes: int
    kv_bytes: int
    seconds: float
    decode_path: DecodePath


class PipelineExecutor:
    """The stage workers and the calls that chain them: P stages of T
    tensor-parallel workers each (P x T Ray actors).

    Each stage's T workers are placed by one Ray placement group
    (``STRICT_PACK``: one node), since their all-reduce is shared memory;
    stages may land on different nodes. Every worker of a stage gets the
    batch and rank 0 of the previous stage's output; rank 0's output goes
    on (the ranks' sums are identical).

    Args:
        config: the engine's configuration (``config.parallel``: P, T and
            the partition; ``num_threads``: threads per worker, None: Ray's
            CPUs divided by P x T, at least 1).
        model_config: the checkpoint's architecture.
        num_blocks, block_size: the engine's KV cache (``kvserve.core.plan``
            sized it for the worker with the most layers and KV heads).

    Raises:
        RuntimeError: the workers did not load within ``STAGE_START_SECONDS``.
        ValueError: a partition that does not fit the model.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, num_blocks: int,
                 block_size: int) -> None:
        parallel = config.parallel
        self.ranges = pp_layer_ranges(model_config.num_hidden_layers,
                                      parallel.pipeline_parallel_size,
                                      parallel.pp_layer_partition)
        self.tp = parallel.tensor_parallel_size
        ray = start_ray(parallel.ray_address)
        self._ray = ray
        world = len(self.ranges) * self.tp
        cpus = float(ray.available_resources().get("CPU", world))
        threads = config.num_threads or max(1, int(cpus) // world)
        self.num_threads = threads
        per_worker = min(float(threads), cpus / world)  # Ray's share: all fit on this machine
        self._id = uuid.uuid4().hex[:8]
        if self.tp > 1:  # segments a killed server left in /dev/shm
            from kvserve.distributed.tensor_parallel import remove_stale_segments
            remove_stale_segments()
        self._group_names: dict[int, str] = {}
        self._generation = 0
        t0 = time.monotonic()
        self.workers = [self._start_stage(replace(config, num_threads=threads), i, r,
                                          per_worker, num_blocks, block_size)
                        for i, r in enumerate(self.ranges)]
        flat = [w for stage in self.workers for w in stage]
        try:
            infos = ray.get([w.info.remote() for w in flat], timeout=STAGE_START_SECONDS)
            for stage in range(len(self.workers)):
                self._form_group(stage)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"{world} pipeline workers did not load within "
                               f"{STAGE_START_SECONDS:g} s (see the stages' log lines)") from None
        self.seconds = time.monotonic() - t0
        keys = [(s, r) for s in range(len(self.workers)) for r in range(self.tp)]
        self.infos = [StageInfo(s, r, self.ranges[s], d["q_heads"], d["kv_heads"], d["pid"],
                                d["incarnation"], d["weights_bytes"], d["kv_bytes"], d["seconds"],
                                DecodePath(*d["decode_path"]))
                      for (s, r), d in zip(keys, infos)]
        self._incarnations = {(i.index, i.tp_rank): i.incarnation for i in self.infos}
        self._lock = threading.Lock()
        self._ping_lock = threading.Lock()
        #: Stages with a worker that did not answer the last ping, or whose
        #: TP group is being formed again (``/health``: degraded).
        self.down: frozenset[int] = frozenset()
        self._restarted: set[int] = set()  # stages with new processes the runner has not adopted
        self._reported = False  # a failed step told the scheduler of the loss already
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="kvserve-pipeline-watch",
                                         daemon=True)
        self._watcher.start()

    def _start_stage(self, config: EngineConfig, stage: int, layers: range, cpus: float,
                     num_blocks: int, block_size: int) -> list:
        """The T workers of one stage, in one placement group (one node)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = placement_group([{"CPU": cpus}] * self.tp, strategy="STRICT_PACK")
        actor = self._ray.remote(max_restarts=-1, max_task_retries=0,
                                 concurrency_groups=STAGE_CONCURRENCY_GROUPS)(PipelineStage)
        return [actor.options(num_cpus=cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank)).remote(
                    config, stage, (layers.start, layers.stop), num_blocks, block_size,
                    tp_rank=rank)
                for rank in range(self.tp)]

    def _form_group(self, stage: int) -> None:
        """(Re)join the stage's workers in a new all-reduce segment (T > 1)."""
        if self.tp == 1:
            return
        from kvserve.distributed.tensor_parallel import segment_name, unlink_segment

        old = self._group_names.get(stage)
        self._generation += 1
        name = segment_name(self._id, stage, self._generation)
        workers = self.workers[stage]
        self._ray.get([w.join_group.remote(name, rank == 0) for rank, w in enumerate(workers)],
                      timeout=STAGE_START_SECONDS)
        self._group_names[stage] = name
        if old is not None:
            unlink_segment(old)

    @property
    def num_stages(self) -> int:
        return len(self.workers)

    # ------------------------------------------------------------- a step

    def submit(self, batch: Any, num_logits: int) -> list:
        """Send one step through every stage: the ObjectRefs of its calls,
        the last stage's rank 0 (``(hidden, logits, seconds per stage)``)
        first."""
        ref = self._ray.put(batch)
        previous, others = None, []
        with self._lock:
            incarnations = dict(self._incarnations)
        for s, stage in enumerate(self.workers):
            calls = [w.forward.remote(ref, previous, incarnations[s, r], num_logits)
                     for r, w in enumerate(stage)]
            previous = calls[0]
            others += calls[1:]
        return [previous, *others]

    def result(self, refs: list) -> tuple:
        """``(hidden, logits, seconds)`` of a submitted step. Raises
        ``KVCacheLost`` when a worker died or restarted under it."""
        try:
            return self._ray.get(refs)[0]
        except Exception as exc:  # noqa: BLE001 - RayActorError, StageRestarted (wrapped)
            raise self._lost(exc) from exc

    def compute_logits(self, hidden: Any) -> np.ndarray:
        """float32[R, V] logits of final hidden states, on the last stage."""
        last = len(self.workers) - 1
        with self._lock:
            incarnation = self._incarnations[last, 0]
        try:
            return self._ray.get(self.workers[last][0].compute_logits.remote(hidden, incarnation))
        except Exception as exc:  # noqa: BLE001
            raise self._lost(exc) from exc

    # ---------------------------------------------------------- recovery

    def wait_until_up(self, timeout: float = RESTART_WAIT_SECONDS) -> bool:
        """Block until every worker answers (Ray restarts a dead one; a
        stage with TP workers is formed again), then adopt the new
        processes. Returns True when a stage has new processes since the
        last call and no failed step reported it (their KV cache is empty).
        Raises ``KVCacheLost`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.down:
            if time.monotonic() > deadline:
                raise KVCacheLost(f"pipeline stages {sorted(self.down)} did not come back "
                                  f"within {timeout:g} s")
            time.sleep(0.05)
        with self._lock:
            restarted, self._restarted = self._restarted, set()
            reported, self._reported = self._reported, False
        return bool(restarted) and not reported

    def _lost(self, exc: Exception) -> KVCacheLost:
        """The error of a call that failed: ping now (the down stages), and
        count the restart it leads to as reported (the step's failure makes
        the scheduler forget the cache)."""
        self._ping_all()
        with self._lock:
            self._reported = True
        stages = sorted(self.down) or "?"
        return KVCacheLost(f"pipeline stage {stages} failed ({type(exc).__name__}: "
                           f"{_last_line(exc)}); Ray restarts it, and the KV cache of its "
                           "layers is lost")

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL):
            self._ping_all()

    def _ping_all(self) -> None:
        """Ping every worker: the down stages, new incarnations adopted, and
        a stage whose TP worker restarted restarted whole and regrouped
        (its survivors' all-reduce is out of step)."""
        with self._ping_lock:  # the watcher's and a failed step's pings, in turn
            self._ping_all_locked()

    def _ping(self, worker):
        """A worker's ``info`` call in its ``health`` group (not behind compute)."""
        return worker.info.options(concurrency_group="health").remote()

    def _ping_all_locked(self) -> None:
        ray = self._ray
        keys = [(s, r) for s in range(len(self.workers)) for r in range(self.tp)]
        refs = [self._ping(self.workers[s][r]) for s, r in keys]
        down: set[int] = set()
        grouped: set[tuple[int, int]] = set()  # workers in their stage's group
        regroup: set[tuple[int, int]] = set()  # restarted TP workers, in no group yet
        for (s, r), ref in zip(keys, refs):
            try:
                info = ray.get(ref, timeout=PING_SECONDS)
            except Exception:  # noqa: BLE001 - dead, restarting or slow: down for now
                down.add(s)
                continue
            with self._lock:
                if info["incarnation"] != self._incarnations[s, r]:
                    self._incarnations[s, r] = info["incarnation"]
                    self._restarted.add(s)
                    log.warning("pipeline_stage_restarted", stage=s, tp_rank=r, pid=info["pid"],
                                message=f"Pipeline stage {s} (TP rank {r}) runs again in process "
                                        f"{info['pid']} (its KV cache is empty)")
            (grouped if info["grouped"] else regroup).add((s, r))
        if down != set(self.down) and down:
            log.warning("pipeline_stage_down", stages=sorted(down),
                        message=f"Pipeline stage(s) {sorted(down)} not answering; "
                                "Ray restarts a dead worker")
        stages = {s for s, _ in regroup} - down
        self.down = frozenset(down | stages)
        for s in sorted(stages):
            self._restart_group(s, {r for t, r in grouped if t == s})

    def _restart_group(self, stage: int, survivors: set[int]) -> None:
        """A TP worker of ``stage`` restarted: restart its ``survivors`` (TP
        ranks still in the old group, whose all-reduce is out of step), then
        form the group again (on the watcher thread)."""
        ray = self._ray
        with self._lock:
            stale = {self._incarnations[stage, r] for r in survivors}
        for r in sorted(survivors):
            ray.kill(self.workers[stage][r], no_restart=False)
        deadline = time.monotonic() + STAGE_START_SECONDS
        infos: dict[int, dict] = {}
        while len(infos) < self.tp and time.monotonic() < deadline:
            for r, worker in enumerate(self.workers[stage]):
                if r in infos:
                    continue
                try:  # a worker being restarted answers with an error for a while
                    info = ray.get(self._ping(worker), timeout=PING_SECONDS)
                except Exception:  # noqa: BLE001
                    continue
                if info["incarnation"] not in stale:
                    infos[r] = info
        try:
            if len(infos) < self.tp:
                raise TimeoutError(f"TP workers of stage {stage} did not come back")
            with self._lock:
                for r, info in infos.items():
                    self._incarnations[stage, r] = info["incarnation"]
                self._restarted.add(stage)
            self._form_group(stage)
        except Exception:  # noqa: BLE001 - the next ping tries again
            log.exception("pipeline_group_failed", stage=stage)
            return
        log.warning("pipeline_group_formed", stage=stage,
                    message=f"Pipeline stage {stage}: its {self.tp} TP workers run again")
        self.down = self.down - {stage}

    def shutdown(self) -> None:
        """Stop the watcher and the workers; remove the all-reduce segments."""
        self._stop.set()
        for stage in self.workers:
            for worker in stage:
                try:
                    self._ray.kill(worker)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        if self._group_names:
            from kvserve.distributed.tensor_parallel import unlink_segment

            for name in self._group_names.values():
                unlink_segment(name)


def _last_line(exc: Exception) -> str:
    """The last non-empty line of an error (Ray's carry the remote traceback), cut to 160."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:160]


@dataclass
class PendingStep:
    """A step between ``PipelineRunner.begin`` and ``finish``."""

    step: _Step | None
    scheduler_output: SchedulerOutput | None = None
    ref: list | None = None  # ``PipelineExecutor.submit``'s ObjectRefs
    t0: float = 0.0
    output: ModelRunnerOutput | None = None  # ready (nothing to compute, or finished early)
    error: Exception | None = None  # it failed while finished early
    kv_lost: bool = False  # the cache was found lost when it began

    def future(self):
        """A ``concurrent.futures.Future`` of the last stage's result (None:
        nothing to wait for)."""
        return None if self.ref is None or self.output is not None else self.ref[0].future()

    @property
    def request_ids(self) -> set[str]:
        """The requests of the step."""
        return ({c.request_id for c in self.scheduler_output.scheduled}
                if self.scheduler_output is not None else set())


class PipelineRunner(ModelRunner):
    """The model runner of a pipelined engine: request states, batches and
    sampling here, the layers in the stages (``PipelineExecutor``).

    ``begin`` prepares a step and sends it through the stages; ``finish``
    waits for its logits and samples. ``execute`` does both (one step at a
    time). No KV connector, draft model or CUDA graphs (``kvserve serve``
    refuses them with ``-pp``).

    A step that finishes (aborts, stops, preempts) a request of a step still
    in flight would drop that request's state before the step in flight
    samples it: ``begin`` then finishes the earlier step first (its output
    waits for ``finish``), as a one-process engine would have.
    """

    def __init__(self, model_config: ModelConfig, executor: PipelineExecutor,
                 block_size: int, **kwargs: Any) -> None:
        self.executor = executor
        self._pending: list[PendingStep] = []  # begun and not finished, in step order
        super().__init__(model_config, None, _HostOps(), 0, block_size, **kwargs)

    def _allocate_kv_caches(self, num_blocks: int, block_size: int, kv_cache_dtype: str) -> list:
        return []  # every stage holds its own

    def stages_down(self) -> list[int]:
        """The stages Ray is restarting, by index (``PipelineExecutor.down``)."""
        return sorted(self.executor.down)

    def close(self) -> None:
        """Stop the stage processes (``PipelineExecutor.shutdown``)."""
        self.executor.shutdown()

    @property
    def overlaps_steps(self) -> bool:
        """True with several stages: the worker begins a step before the one
        ahead of it finished (the scheduler then keeps their requests apart,
        ``SchedulerConfig.pipeline_parallel_size``); one stage (tensor
        parallelism alone) runs a step at a time, as a one-process engine."""
        return self.executor.num_stages > 1

    def begin(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Prepare the step and send it through the stages. Raises
        ``KVCacheLost`` (after dropping the step's requests) when a stage
        restarted and the step reads cached K/V."""
        self._finish_ahead(set(scheduler_output.finished_request_ids))
        try:
            lost = self.executor.wait_until_up()
            step = self._prepare(scheduler_output)
            if isinstance(step, ModelRunnerOutput):
                step.kv_lost = lost
                return PendingStep(None, output=step)
            if lost and not _starts_fresh(scheduler_output):
                raise KVCacheLost("a pipeline stage restarted: its KV cache was lost")
            t0 = time.perf_counter()
            pending = PendingStep(step, scheduler_output,
                                  self.executor.submit(step.batch, step.num_logits), t0,
                                  kv_lost=lost)
        except Exception:
            self._drop_failed(scheduler_output)
            raise
        self._pending.append(pending)
        return pending

    def _finish_ahead(self, finished: set[str]) -> None:
        """Finish now every step in flight up to the last one holding a
        request in ``finished`` (their outputs wait in them for ``finish``)."""
        last = max((i for i, p in enumerate(self._pending) if p.request_ids & finished),
                   default=-1)
        for pending in self._pending[:last + 1]:
            if pending.output is None and pending.error is None:
                try:
                    pending.output = self._finish_now(pending)
                except Exception as exc:  # noqa: BLE001 - raised again by finish
                    pending.error = exc

    def finish(self, pending: PendingStep, scheduler_output: SchedulerOutput
               ) -> ModelRunnerOutput:
        """Wait for the step's logits, sample; the ``ModelRunnerOutput``."""
        if pending in self._pending:
            self._pending.remove(pending)
        if pending.error is not None:
            raise pending.error
        if pending.output is not None:
            return pending.output
        return self._finish_now(pending)

    def _finish_now(self, pending: PendingStep) -> ModelRunnerOutput:
        try:
            hidden, logits, seconds = self.executor.result(pending.ref)
            output = self._complete(pending.step, hidden, logits, pending.t0)
        except Exception:
            self._drop_failed(pending.scheduler_output)
            raise
        output.stage_seconds = tuple(seconds)
        output.kv_lost = pending.kv_lost
        return output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.begin(scheduler_output), scheduler_output)

    def _forward_logits(self, batch: Any, num_logits: int):
        raise NotImplementedError("a pipelined step runs through begin/finish")

    def _logits(self, hidden) -> np.ndarray:
        return self.executor.compute_logits(hidden)


def _starts_fresh(scheduler_output: SchedulerOutput) -> bool:
    """True when no request of the step reads K/V computed before it:
    each is new here and its chunk starts at token 0."""
    new = {n.request_id for n in scheduler_output.new_requests}
    return all(c.request_id in new and c.start_position == 0 for c in scheduler_output.scheduled)


class _HostOps:
    """The array module the pipelined runner samples with (NumPy): it holds
    no weights and no KV cache."""

    xp = np

    @staticmethod
    def to_numpy(a: Any) -> np.ndarray:
        return np.asarray(a)
