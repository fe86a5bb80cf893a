"""PipelineStage: one pipeline stage's layers and KV cache in a Ray actor process.

A stage holds the decoder layers of its range (``LlamaModel(layer_range=...)``),
the first stage the embedding, the last the final norm and the LM head, and
one KV buffer per layer it holds, of the engine's block count: the engine's
one scheduler hands out block ids that every stage's cache honours. A step
reaches it as the engine's flat batch (``BatchInputs``: token ids,
positions, slot mapping, block tables) and, after the first stage, the
previous stage's ``(x, residual)``; the last stage returns the sampled rows'
logits. Ray runs the calls of one actor in order, so a stage computes
steps in the order the engine sent them: step N+1's chunk of a prompt never
reads K/V that step N has not written.

Each process draws an ``incarnation`` (a random id) when it starts. The
engine sends the one it knows with every call; a stage that Ray restarted
after its process died has another and an empty KV cache, so it refuses
the call (``StageRestarted``) instead of computing on K/V it never wrote.

The module imports nothing heavy at the top: Ray imports it in the actor
process before ``__init__`` sets the thread pools' environment.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any


class StageRestarted(RuntimeError):
    """A call meant for an earlier process of this stage (its KV is gone)."""


class PipelineStage:
    """One stage (wrap with ``ray.remote``).

    Args:
        config: the engine's configuration (model path, quantization, KV
            cache dtype; ``num_threads``: this stage's CPU threads).
        stage: the stage's index (0 = first).
        layers: ``(start, stop)`` of its decoder layers.
        num_blocks, block_size: the engine's KV blocks (every stage has
            the same number, each of its own layers only).
        own_process: set up the process's thread pools and logging (False:
            a stage built inside another process, as tests do).
        tp_rank: this worker's rank among the stage's
            ``config.parallel.tensor_parallel_size`` workers: it holds the
            heads of ``tp_head_shards`` and the MLP columns of
            ``tp_column_split`` (``kvserve.distributed.tensor_parallel``), and
            sums its partial products with the others' through the group
            the engine gives it (``join_group``).
    """

    def __init__(self, config: Any, stage: int, layers: tuple[int, int], num_blocks: int,
                 block_size: int, own_process: bool = True, tp_rank: int = 0) -> None:
        import structlog

        if own_process:  # a Ray actor: the process is the stage's alone
            from kvserve.thread_env import apply_thread_pool_env

            apply_thread_pool_env()  # before NumPy loads (kvserve.thread_env)
            from kvserve.observability.log import configure_logging

            configure_logging("json", "info")
            structlog.contextvars.bind_contextvars(stage=stage, tp_rank=tp_rank)
        self.log = structlog.get_logger("kvserve.pipeline")
        self.stage = stage
        self.tp_rank = tp_rank
        self.tp_size = config.parallel.tensor_parallel_size
        self.incarnation = uuid.uuid4().hex
        self._group = None  # the ShmAllReduce of the stage's TP workers (join_group)
        self._max_elems = config.scheduler.max_num_batched_tokens
        t0 = time.monotonic()
        self.model, backend = _load(config, range(*layers), tp_rank,
                                    self._all_reduce if self.tp_size > 1 else None)
        self.ops = backend.ops
        cfg = self.model.config
        self.kv_caches = [self.ops.allocate_kv_cache(num_blocks, block_size,
                                                     cfg.num_key_value_heads, cfg.head_dim,
                                                     kv_cache_dtype=config.cache.kv_cache_dtype)
                          for _ in self.model.layers]
        backend.warmup()
        self.busy_seconds = 0.0
        self.seconds = time.monotonic() - t0
        self.log.info("pipeline_stage_loaded", layers=list(layers), pid=os.getpid(),
                      weights_bytes=self.model.weights_nbytes, kv_bytes=self.kv_bytes,
                      seconds=round(self.seconds, 2), incarnation=self.incarnation)

    def join_group(self, name: str, create: bool, timeout: float = 20.0) -> None:
        """Join the stage's tensor-parallel all-reduce, the shared-memory
        segment ``name`` (rank 0 creates it: ``create``); ``timeout``
        seconds a sum waits for a peer before the step fails."""
        from kvserve.distributed.tensor_parallel import ShmAllReduce

        if self._group is not None:
            self._group.close()
        hidden = self.model.config.hidden_size
        self._group = (ShmAllReduce.create(name, self.tp_size, self._max_elems * hidden,
                                           rank=0, timeout=timeout) if create
                       else ShmAllReduce.attach(name, self.tp_rank, timeout=timeout))

    def _all_reduce(self, x: Any) -> None:
        if self._group is None:
            raise RuntimeError(f"pipeline stage {self.stage}, TP rank {self.tp_rank}: no "
                               "all-reduce group joined")
        self._group.all_reduce(x)

    @property
    def kv_bytes(self) -> int:
        """Bytes of this stage's KV buffers."""
        return sum(int(c.nbytes) for c in self.kv_caches)

    def info(self) -> dict:
        """The stage's process: incarnation, pid, weights and KV bytes,
        seconds it took to load, busy seconds so far, its model's decode
        path (``LlamaModel.decode_path``, as ``(path, reason)``)."""
        cfg = self.model.config
        return {"incarnation": self.incarnation, "pid": os.getpid(),
                "weights_bytes": self.model.weights_nbytes, "kv_bytes": self.kv_bytes,
                "seconds": self.seconds, "busy_seconds": self.busy_seconds,
                "q_heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                "grouped": self._group is not None or self.tp_size == 1,
                "decode_path": (self.model.decode_path.path, self.model.decode_path.reason)}

    def forward(self, batch: Any, previous: tuple | None, incarnation: str,
                num_logits: int) -> tuple:
        """Run this stage's layers on one step.

        Args:
            batch: the step's ``BatchInputs`` (host arrays).
            previous: None on the first stage; else the previous stage's
                result ``((x, residual), seconds)``, x and residual float32[T, H].
            incarnation: the process the engine means (``info``).
            num_logits: rows of the logits rows that the sampler reads
                (the last stage returns their logits).

        Returns:
            A stage before the last: ``((x, residual), seconds)``, with
            ``seconds`` the tuple of each stage's forward seconds so far.
            The last: ``(hidden float32[R, H], logits float32[num_logits, V], seconds)``.

        Raises:
            StageRestarted: ``incarnation`` is an earlier process's.
        """
        import numpy as np

        if incarnation != self.incarnation:
            raise StageRestarted(f"pipeline stage {self.stage} restarted (process "
                                 f"{os.getpid()}): the KV cache of its layers was lost")
        t0 = time.perf_counter()
        intermediate, seconds = None, ()
        if previous is not None:
            (x, residual), seconds = previous
            # Ray hands arrays over read-only; the layers update them in place
            intermediate = (np.array(x, dtype=np.float32), np.array(residual, dtype=np.float32))
        out = self.model.batch_hidden_states(batch, self.kv_caches, intermediate)
        if self.tp_rank:  # the same sums as rank 0's: rank 0's result goes on
            self.busy_seconds += time.perf_counter() - t0
            return None
        if not self.model.is_last:
            took = time.perf_counter() - t0
            self.busy_seconds += took
            return out, (*seconds, took)
        logits = self.model.compute_logits(out[:num_logits])
        took = time.perf_counter() - t0
        self.busy_seconds += took
        return out, np.asarray(logits, dtype=np.float32), (*seconds, took)

    def compute_logits(self, hidden: Any, incarnation: str) -> Any:
        """float32[R, V] logits of final hidden states [R, H] (the last stage;
        prompt logprobs score their rows through it)."""
        import numpy as np

        if incarnation != self.incarnation:
            raise StageRestarted(f"pipeline stage {self.stage} restarted")
        return np.asarray(self.model.compute_logits(np.asarray(hidden, dtype=np.float32)),
                          dtype=np.float32)


def _load(config: Any, layer_range: range, tp_rank: int = 0, all_reduce=None):
    """``(LlamaModel of the layers in layer_range, its backend)``: the
    checkpoint's tensors of those layers (and the embedding, final norm and
    LM head where the stage holds them), quantized as ``config`` says; with
    tensor parallelism, TP rank ``tp_rank`` 's shard (``shard_checkpoint``)
    summed by ``all_reduce``."""
    from kvserve.model.backend import create_backend
    from kvserve.model.llama import LlamaModel
    from kvserve.model.loader import load_checkpoint_weights, load_model_config

    path = Path(config.model)
    model_config = load_model_config(path)
    backend = create_backend(replace(config, backend="cpu") if config.backend == "auto"
                             else config)
    weights = load_checkpoint_weights(path, model_config, config.quantization)
    held = {f"model.layers.{i}." for i in layer_range}
    weights = {name: w for name, w in weights.items()
               if not name.startswith("model.layers.") or name[:name.index(".", 13) + 1] in held}
    tp = config.parallel.tensor_parallel_size
    if tp > 1:
        from kvserve.core.parallel import tp_column_split, tp_head_shards
        from kvserve.distributed.tensor_parallel import shard_checkpoint

        shard = tp_head_shards(model_config.num_attention_heads,
                               model_config.num_key_value_heads, tp)[tp_rank]
        model_config, weights = shard_checkpoint(
            model_config, weights, shard,
            tp_column_split(model_config.intermediate_size, tp)[tp_rank], layer_range)
    return LlamaModel(model_config, weights, backend.ops, config.quantization,
                      layer_range=layer_range, all_reduce=all_reduce), backend
