"""CUDA graphs of the decode step, one per batch-size bucket (vLLM's approach).

A decode step of the default model is about a hundred launches (Numba's and
cuBLAS's) that each cost microseconds of host time, against a few
microseconds of GPU work each. Captured once as a CUDA graph, the whole step
replays with one launch. A graph replays the exact kernels, arguments and
addresses it recorded, so each bucket (a batch size: 1, 2, 4, 8, ... up to
``--max-num-seqs``) owns a persistent step buffer at a fixed device address,
laid out for that many decode tokens with block tables as wide as the longest
context, and its own logits output. A step of ``n`` decode tokens takes the
smallest bucket ``B >= n``: its arrays are packed at the bucket's offsets, the
rows past ``n`` padded as one-token sequences that write nothing (slot -1)
and whose logits are ignored, the buffer is copied in (one host-to-device
copy), and the graph replays; the sampler then reads ``logits[:n]``.

Captured on a CuPy stream (``Stream.begin_capture`` / ``end_capture``, the
relaxed mode), after one eager run of the same work on that stream (which
compiles the kernels and fills the memory pool), with the temporaries of
every bucket's work drawn from one private memory pool kept for the graphs,
and replayed on CuPy's current stream, the one the step's input copy and the
sampler use, so that the three are ordered (replays never overlap: one
stream). The graphs are built unless
``--enforce-eager`` (vLLM's flag), and never under Numba's simulator, where
there is nothing to capture; ``EagerReplay`` stands in there to test the
buckets and padding: it runs the recorded work again instead of a graph.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from kvserve.cuda.step import PackedStep, StepViews, check_step, group_name, pack_step
from kvserve.model.ops import StepGeometry

log = structlog.get_logger("kvserve.engine")

#: Batch sizes captured (those up to ``--max-num-seqs``), as vLLM's
#: ``cudagraph_capture_sizes`` begin.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The captured batch sizes for ``max_num_seqs``: ``BUCKETS`` below it,
    and ``max_num_seqs`` itself."""
    sizes = [b for b in BUCKETS if b < max_num_seqs]
    return sizes + [max_num_seqs]


@dataclass
class Bucket:
    """One captured batch size: its step layout, the persistent device
    buffer of that layout, the views the recorded kernels read, the logits
    they write ([size, V] float32), and the replayable graph."""

    size: int
    packed: PackedStep
    buffer: Any
    views: StepViews
    logits: Any
    graph: Any = None


def padded_step(batch: Any, size: int, width: int, num_groups: int = 1
                ) -> dict[str, np.ndarray]:
    """A decode batch's arrays padded to ``size`` one-token sequences with
    block tables ``width`` wide, in the order and dtypes of
    ``CudaOps.prepare_step``'s layout (attention work lists included).

    Padding sequences: token 0 at position 0, slot -1 (nothing written),
    a context of one token in block 0 (read, harmlessly), sampled last.
    ``num_groups`` KV-cache groups: the slot mappings and block tables of
    groups 1 .. G-1 (``batch.group_tables``) padded alike, after the
    others (``prepare_step``'s names).
    """
    n = batch.input_ids.shape[0]
    i64, i32 = np.int64, np.int32

    def pad(a: np.ndarray, value: int, dtype) -> np.ndarray:
        out = np.full(size, value, dtype=dtype)
        out[:n] = a
        return out

    def padded_tables(block_tables: np.ndarray) -> np.ndarray:
        tables = np.zeros((size, width), dtype=i32)
        tables[:n, :block_tables.shape[1]] = block_tables
        return tables

    seq_lens = pad(batch.seq_lens, 1, i32)
    arrays = {"input_ids": pad(batch.input_ids, 0, i64), "positions": pad(batch.positions, 0, i64),
              "slot_mapping": pad(batch.slot_mapping, -1, i64),
              "block_tables": padded_tables(batch.block_tables),
              "seq_lens": seq_lens, "query_start_loc": np.arange(size + 1, dtype=i32),
              "logits_indices": np.arange(size, dtype=i64)}
    groups = tuple(getattr(batch, "group_tables", ()))
    if len(groups) != num_groups - 1:
        raise ValueError(f"graphs: a step of {len(groups) + 1} KV-cache groups for buckets of "
                         f"{num_groups}")
    for g, (slots, tables) in enumerate(groups, start=1):
        arrays[group_name("slot_mapping", g)] = pad(slots, -1, i64)
        arrays[group_name("block_tables", g)] = padded_tables(tables)
    arrays.update({"tokens": np.arange(size, dtype=i32), "token_seq": np.arange(size, dtype=i32),
                   "token_ctx": seq_lens.copy(),
                   **{name: np.zeros(0, dtype=i32)
                      for name in ("tile_seq", "tile_t0", "tile_nq", "tile_pos0")}})
    return arrays


class DecodeGraphs:
    """The decode buckets of one model and cache (see the module docstring).

    Args:
        ops: the CUDA backend's ``CudaOps`` (its ``upload_into`` copies a
            step in; its kernels are launched by ``run``).
        run: ``run(views) -> logits``, the work to capture: the model's
            forward over the bucket's views and its LM head, as float32
            [size, V].
        geometry: what the steps' indices are checked against.
        max_num_seqs: the largest bucket.
        max_model_len: the longest context (sizes the block tables and the
            attention grid, which covers every partition of it).
        capture: ``capture(fn) -> replayable``, where ``replayable.launch()``
            replays ``fn``'s work; default ``CupyCapture`` on a GPU.
        num_groups: KV-cache groups of the model (``kv_layout.num_groups``):
            block tables per step (a replayed step must bring as many).

    Raises whatever capturing raises (the caller falls back to eager).
    """

    def __init__(self, ops: Any, run: Callable[[StepViews], Any], geometry: StepGeometry,
                 max_num_seqs: int, max_model_len: int,
                 capture: Callable[[Callable[[], Any]], Any] | None = None,
                 num_groups: int = 1) -> None:
        self.ops = ops
        self.geometry = geometry
        self.num_groups = num_groups
        self.width = -(-max_model_len // geometry.block_size)
        self.max_model_len = max_model_len
        self._capture = capture or CupyCapture(ops)
        self.buckets: dict[int, Bucket] = {}
        start = time.monotonic()
        for size in sorted(bucket_sizes(max_num_seqs), reverse=True):  # largest first
            self.buckets[size] = self._capture_bucket(size, run)
        self.seconds = time.monotonic() - start

    def _capture_bucket(self, size: int, run: Callable[[StepViews], Any]) -> Bucket:
        """Lay out, allocate and capture one bucket (its padding-only step)."""
        empty = _EmptyBatch(self.width, self.num_groups)
        packed = pack_step(padded_step(empty, size, self.width, self.num_groups),
                           num_tokens=size, num_seqs=size,
                           decode_only=True, max_context=self.max_model_len, tile_q=1)
        buffer = self.ops.upload(packed.data)
        views = self.ops.step_views(packed, buffer)
        holder: dict[str, Any] = {}

        def work() -> Any:
            self.ops.use_step(views)
            holder.setdefault("logits", [])
            holder["logits"].append(run(views))
            return holder["logits"][-1]

        graph = self._capture(work)
        # The captured run's output (a graph writes there at each replay);
        # the eager stand-in copies into its first.
        logits = holder["logits"][-1] if isinstance(graph, _Replay) else holder["logits"][0]
        return Bucket(size, packed, buffer, views, logits, graph)

    def accepts(self, batch: Any) -> bool:
        """Whether a step can replay a bucket: decode tokens only, one
        sampled row each in order, no more than the largest bucket."""
        n = batch.input_ids.shape[0]
        qsl = batch.query_start_loc
        return (0 < n <= max(self.buckets) and batch.seq_lens.shape[0] == n
                and len(getattr(batch, "group_tables", ())) == self.num_groups - 1
                and batch.logits_indices.shape[0] == n
                and bool((np.diff(qsl) == 1).all()) and int(qsl[0]) == 0
                and bool((batch.logits_indices == np.arange(n)).all()))

    def replay(self, batch: Any) -> Any:
        """Logits [n, V] of a decode batch (``accepts``), computed by its
        bucket's graph. Raises ValueError as ``check_step`` for a bad index."""
        n = batch.input_ids.shape[0]
        tables = [(batch.slot_mapping, batch.block_tables), *getattr(batch, "group_tables", ())]
        for slots, block_tables in tables:
            check_step(batch.input_ids, batch.positions, slots, block_tables, batch.seq_lens,
                       batch.query_start_loc, batch.logits_indices, self.geometry)
        bucket = self.buckets[min(b for b in self.buckets if b >= n)]
        host = pack_step(padded_step(batch, bucket.size, self.width, self.num_groups),
                         bucket.size, bucket.size,
                         decode_only=True, max_context=self.max_model_len, tile_q=1)
        self.ops.upload_into(bucket.buffer, host.data)
        self.ops.use_step(bucket.views)
        bucket.graph.launch()
        return bucket.logits[:n]

    def memory_bytes(self) -> int:
        """Device bytes the buckets hold: their step buffers and logits
        (the capture pool's temporaries are ``CupyCapture.pool_bytes``)."""
        return sum(int(b.buffer.nbytes) + int(b.logits.nbytes) for b in self.buckets.values())

    def log(self) -> None:
        """The start-up ``cuda_graphs`` line: sizes, memory and seconds."""
        pool = getattr(self._capture, "pool_bytes", lambda: 0)()
        total = self.memory_bytes() + pool
        sizes = sorted(self.buckets)
        log.info("cuda_graphs", captured=True, batch_sizes=sizes, memory_bytes=total,
                 seconds=round(self.seconds, 3),
                 message=f"CUDA graphs captured for decode batch sizes {sizes} in "
                         f"{self.seconds:.1f} s ({total / 2**20:,.1f} MiB)")


class _EmptyBatch:
    """A decode batch of no sequences (every bucket row is padding), with
    ``num_groups`` KV-cache groups."""

    def __init__(self, width: int, num_groups: int = 1) -> None:
        i64, i32 = np.int64, np.int32
        self.input_ids = self.positions = self.slot_mapping = np.zeros(0, i64)
        self.logits_indices = np.zeros(0, i64)
        self.block_tables = np.zeros((0, width), i32)
        self.seq_lens = np.zeros(0, i32)
        self.query_start_loc = np.zeros(1, i32)
        self.group_tables = tuple((self.slot_mapping, self.block_tables)
                                  for _ in range(num_groups - 1))


class CupyCapture:
    """Captures work as a CUDA graph on a dedicated CuPy stream.

    ``capture(work)``: waits for the device, runs ``work()`` once eagerly on
    the stream (compiling kernels, warming the pool), then again inside
    ``begin_capture`` / ``end_capture`` with temporaries from a private
    memory pool; returns a replayable whose ``launch()`` runs the graph on
    CuPy's current stream, the one every copy, kernel and the sampler of a
    step use (``_Replay``). ``cupy``: the module (a test's stand-in)."""

    def __init__(self, ops: Any, cupy: Any = None) -> None:
        if cupy is None:
            import cupy

        self._cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()

    def capture(self, work: Callable[[], Any]) -> Any:
        cupy = self._cupy
        # the capture stream does not wait for the legacy stream's work (the
        # weights' and the bucket buffer's uploads): all of it done first
        cupy.cuda.Device().synchronize()
        with self.stream:
            work()
            self.stream.synchronize()
            with cupy.cuda.using_allocator(self.pool.malloc):
                self.stream.begin_capture()
                try:
                    work()
                finally:
                    graph = self.stream.end_capture()
        return _Replay(graph, cupy)

    __call__ = capture

    def pool_bytes(self) -> int:
        """Bytes the private pool holds for the graphs' temporaries."""
        return int(self.pool.total_bytes())


@dataclass
class _Replay:
    """A captured graph, replayed on CuPy's current stream: the stream the
    step's input copy (``upload_into``) and the sampler's reads run on, so
    that a replay starts after its inputs are copied and the sampler reads
    logits the replay wrote. (The non-blocking capture stream would not be
    ordered with either: CuPy documents that such a stream does not
    synchronise with the legacy one.)"""

    graph: Any
    cupy: Any

    def launch(self) -> None:
        self.graph.launch(stream=self.cupy.cuda.get_current_stream())


class EagerReplay:
    """A stand-in for ``CupyCapture`` where nothing can be captured (Numba's
    simulator): ``capture(work)`` runs ``work`` once and returns a
    replayable that runs it again at each ``launch()``, on the same step
    buffer, its logits copied into the first run's array (which a graph
    would have written in place)."""

    def __call__(self, work: Callable[[], Any]) -> Any:
        return _Again(work, work())


@dataclass
class _Again:
    work: Callable[[], Any]
    out: Any

    def launch(self) -> None:
        self.out[...] = self.work()


def decode_run(model: Any, kv_caches: Sequence[Any]) -> Callable[[StepViews], Any]:
    """The work a bucket captures: ``model``'s forward over the step views
    and its LM head, float32 logits [size, V]. With several KV-cache groups
    (``views.group_tables``) the model gets one ``AttentionMetadata`` per
    group, in group order."""
    from kvserve.model.llama import AttentionMetadata

    def run(views: StepViews) -> Any:
        tables = [(views.slot_mapping, views.block_tables), *views.group_tables]
        groups = [AttentionMetadata(slots, block_tables, views.seq_lens, views.query_start_loc,
                                    plan=views) for slots, block_tables in tables]
        attn = groups[0] if len(groups) == 1 else groups
        hidden = model.hidden_states(views.input_ids, views.positions, attn, list(kv_caches),
                                     views.logits_indices)
        logits = model.compute_logits(hidden)
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)

    return run
