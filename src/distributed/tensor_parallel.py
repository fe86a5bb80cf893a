"""Tensor parallelism on the CPU: one worker's slice of the checkpoint, and
the all-reduce that sums the workers' partial outputs.

The split is Megatron-LM's (Shoeybi et al. 2019, section 3; vLLM's
``QKVParallelLinear`` / ``RowParallelLinear`` / ``MergedColumnParallelLinear``):
per decoder layer

- attention: q/k/v are column-parallel (each worker computes the rows of
  its own query and KV heads), the output projection ``o_proj`` row-parallel
  (each worker multiplies its heads' columns), so every worker holds a
  partial ``[T, H]`` sum that one all-reduce completes;
- MLP: gate/up column-parallel over a range of the intermediate size,
  ``down_proj`` row-parallel over the same range, then the second all-reduce.

Norms, the embedding, the final norm and the LM head are replicated. A bias
of a row-parallel product is added once: rank 0 keeps it, the others get
zeros (vLLM's ``RowParallelLinear`` adds it on rank 0 only, ``skip_bias_add``
elsewhere).

:class:`ShmAllReduce` sums ``float32`` arrays among the worker processes of
one node through POSIX shared memory, without locks (the workers are Ray
actors, not children of one parent, so no ``multiprocessing`` semaphore can
be shared). Its layout follows DeepSpeed's CPU shared-memory all-reduce
(``csrc/cpu/comm/shm.cpp``, its "naive" all-reduce on a double buffer),
which vLLM's CPU backend also uses (``csrc/cpu/shm.cpp``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from kvserve.config import ModelConfig
from kvserve.core.parallel import HeadShard
from kvserve.kv_offload.host_tier import _pid_alive
from kvserve.model.ggml_blocks import BlockQuantizedWeight

# --------------------------------------------------------------------------- #
# The checkpoint split
# --------------------------------------------------------------------------- #

#: Per-layer tensor (name after ``model.layers.{i}.``) -> how it is split:
#: ``q_rows`` / ``kv_rows`` / ``mlp_rows``: rows (output features) of the
#: worker's query heads / KV heads / intermediate range; ``q_cols`` /
#: ``mlp_cols``: the same ranges as columns (input features, row-parallel);
#: ``rank0``: a row-parallel product's bias, kept whole on rank 0 and zero
#: elsewhere. Any other tensor of a layer (norms) is replicated.
_LAYER_SPLIT = {
    "self_attn.q_proj.weight": "q_rows", "self_attn.q_proj.bias": "q_rows",
    "self_attn.k_proj.weight": "kv_rows", "self_attn.k_proj.bias": "kv_rows",
    "self_attn.v_proj.weight": "kv_rows", "self_attn.v_proj.bias": "kv_rows",
    "self_attn.o_proj.weight": "q_cols", "self_attn.o_proj.bias": "rank0",
    "mlp.gate_proj.weight": "mlp_rows", "mlp.gate_proj.bias": "mlp_rows",
    "mlp.up_proj.weight": "mlp_rows", "mlp.up_proj.bias": "mlp_rows",
    "mlp.down_proj.weight": "mlp_cols", "mlp.down_proj.bias": "rank0",
}


def shard_checkpoint(config: ModelConfig, weights: dict[str, np.ndarray], shard: HeadShard,
                     mlp_cols: range, layer_range: range
                     ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """One tensor-parallel worker's config and weights (Megatron-LM's split).

    Args:
        config: the whole model's architecture.
        weights: Hugging Face-named float arrays, ``[out, in]``, as
            ``kvserve.model.loader.load_weights`` returns them.
        shard: the worker's heads (``kvserve.core.parallel.tp_head_shards``);
            ``shard.rank`` 0 keeps the row-parallel biases.
        mlp_cols: the worker's range of the intermediate size
            (``kvserve.core.parallel.tp_column_split``).
        layer_range: the decoder layers to return (a pipeline stage; the
            whole model's ``range(num_hidden_layers)`` without one).

    Returns:
        ``(shard_config, shard_weights)``: the config with the worker's
        ``num_attention_heads`` (``len(q_heads)``), ``num_key_value_heads``
        and ``intermediate_size`` (``len(mlp_cols)``), and ``head_dim`` and
        the attention scale the model's (``ModelConfig`` stores ``head_dim``;
        the scale derives from it or from ``query_pre_attn_scalar``); the
        layers of ``layer_range`` split as in :data:`_LAYER_SPLIT` (rows of
        a query / KV head are ``head * head_dim ..``, HF's layout), every
        tensor outside the layers (embedding, final norm, LM head)
        replicated. Slices are C-contiguous copies where they are columns,
        views where they are rows; replicated tensors are the input arrays.

    The float weights are split before ``LlamaModel`` quantizes them; the
    ``int8`` / ``w8a8`` scales are per output row, so a column-split
    product (``o_proj``, ``down_proj``) gets scales of its own columns: a
    valid quantization, not the unsharded model's bits.

    Raises:
        ValueError: a ``BlockQuantizedWeight`` (GGUF blocks, ``q4`` /
            ``w4a8``; not split yet), an empty or out-of-range head /
            column / layer range, or query heads outside the groups of the
            shard's KV heads.
    """
    for name, weight in weights.items():
        if isinstance(weight, BlockQuantizedWeight):
            raise ValueError(f"{name} is GGUF blocks: --quantization q4 / w4a8 is not "
                             f"with tensor parallelism yet")
    _check_shard(config, shard, mlp_cols, layer_range)
    hd = config.head_dim
    spans = {"q": (shard.q_heads.start * hd, shard.q_heads.stop * hd),
             "kv": (shard.kv_heads.start * hd, shard.kv_heads.stop * hd),
             "mlp": (mlp_cols.start, mlp_cols.stop)}
    layers = {f"model.layers.{i}." for i in layer_range}
    out: dict[str, np.ndarray] = {}
    for name, weight in weights.items():
        if not name.startswith("model.layers."):
            out[name] = weight
            continue
        prefix = name[:name.index(".", len("model.layers.")) + 1]
        if prefix in layers:
            out[name] = _split(weight, _LAYER_SPLIT.get(name[len(prefix):]), spans, shard.rank)
    shard_config = dataclasses.replace(
        config, num_attention_heads=len(shard.q_heads),
        num_key_value_heads=len(shard.kv_heads), intermediate_size=len(mlp_cols))
    return shard_config, out


def _split(weight: np.ndarray, rule: str | None, spans: dict[str, tuple[int, int]],
           rank: int) -> np.ndarray:
    """``weight`` cut by ``rule`` (see :data:`_LAYER_SPLIT`; None: whole)."""
    if rule is None:
        return weight
    if rule == "rank0":
        return weight if rank == 0 else np.zeros_like(weight)
    part, axis = rule.split("_")
    lo, hi = spans[part]
    if axis == "rows":
        return weight[lo:hi]
    return np.ascontiguousarray(weight[:, lo:hi])


def _check_shard(config: ModelConfig, shard: HeadShard, mlp_cols: range,
                 layer_range: range) -> None:
    """``ValueError`` unless the ranges are non-empty, contiguous, inside
    the model, and the query heads belong to the KV heads' GQA groups."""
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    for what, r, size in (("query heads", shard.q_heads, nh), ("KV heads", shard.kv_heads, nkv),
                          ("MLP columns", mlp_cols, config.intermediate_size),
                          ("layers", layer_range, config.num_hidden_layers)):
        if len(r) == 0 or r.step != 1 or r.start < 0 or r.stop > size:
            raise ValueError(f"tensor-parallel shard: {what} {r} must be a non-empty "
                             f"contiguous range within 0..{size}")
    group = nh // nkv
    if any(h // group not in shard.kv_heads for h in shard.q_heads):
        raise ValueError(f"tensor-parallel shard: query heads {shard.q_heads} are not in the "
                         f"groups of KV heads {shard.kv_heads} ({group} query heads each)")


# --------------------------------------------------------------------------- #
# The shared-memory all-reduce
# --------------------------------------------------------------------------- #

_MAGIC = 0x6B76_7470_6172_3031  # "kvtpar01"
_LINE = 64  # bytes: one cache line per rank's counters, so ranks never share a line
_Q = _LINE // 8  # int64 per line
#: Polls of a wait that only re-read the counters (about 0.2 us each).
BUSY_SPINS = 64
#: Polls, after those, that yield the CPU (``os.sched_yield``, about 2.5 us
#: here; ``time.sleep(0)`` costs Linux's 50 us timer slack) before the wait
#: backs off to :data:`BACKOFF_S` sleeps.
YIELD_SPINS = 4000
#: Sleep between polls once a wait is past the yielding ones, in seconds.
BACKOFF_S = 50e-6
_TRACKER_LOCK = threading.Lock()


class ShmAllReduce:
    """In-place sum of ``float32`` arrays over the ``world`` worker
    processes (or threads) of one node, through one POSIX shared-memory
    segment.

    Build: rank 0 calls :meth:`create` with a name, the others
    :meth:`attach` by that name (they wait for it to appear). Every rank
    then calls :meth:`all_reduce` the same number of times, with arrays of
    the same size (``LlamaModel``'s ``all_reduce`` hook: the ``[T, H]``
    output of ``o_proj`` and of the MLP's ``down_proj``). Each rank ends
    with :meth:`close`; the creator then :meth:`unlink` s the name.

    Segment layout: a header line (magic, world, max_elems); one cache line
    per rank holding its generation and the element count of its last call
    into each buffer, written by that rank only; then two buffers of
    ``world`` slots of ``max_elems`` float32 each (slots aligned to cache
    lines).

    One call (generation g = 1, 2, ...; buffer ``g % 2``): copy the input
    into this rank's slot, publish the element count, then g, wait until every
    rank's generation is >= g (the barrier), then sum the ``world`` slots in
    rank order into the input (every rank adds the same values in the same
    order: the results are bit-identical on all ranks). The double buffer
    stands in for the second barrier ("no slot is overwritten before every
    rank has read it"): a rank writes buffer ``g % 2`` again at g + 2 only
    after passing the barrier of g + 1, which every rank enters only after
    it finished summing g (DeepSpeed's double buffer does the same).

    Cost per call: one barrier + 1 copy of n floats in + ``world`` slot
    reads of n floats (the sum). The wait re-reads the counters
    :data:`BUSY_SPINS` times, then yields the CPU for :data:`YIELD_SPINS`
    polls, then sleeps :data:`BACKOFF_S` between polls. Measured with 2
    spawned processes calling back to back on the 2-core machine
    (2026-12-02): 1 x 576 floats 6 us a call, 16 x 576 10 us; 31 and 37 us
    while a third busy process shared the cores. In a forward pass the wait
    also absorbs the ranks' load imbalance.

    Memory ordering: the slot copy must be visible before the counter; x86-64
    (total store order) guarantees that for plain stores. A weakly ordered
    CPU (ARM) would need a fence between them, which Python cannot issue.

    Args (of both constructors): ``timeout``: seconds a call waits for the
    others before ``TimeoutError`` (a dead peer must not hang the worker).
    """

    def __init__(self, shm: shared_memory.SharedMemory, rank: int, owner: bool,
                 timeout: float) -> None:
        _, world, max_elems = _header(shm)
        if not 0 <= rank < world:
            shm.close()
            raise ValueError(f"rank {rank} outside the all-reduce's world of {world}")
        self._shm, self.rank, self.world, self.max_elems = shm, rank, world, max_elems
        self.name, self.owner, self.timeout = shm.name.lstrip("/"), owner, float(timeout)
        # int64 view of the whole segment: rank r's generation at _gen[r],
        # then its element counts for buffers 0 and 1 (a peer may already be
        # one call ahead, in the other buffer). A memoryview reads an item in
        # 0.2 us, NumPy in 1-2 us.
        self._counters = shm.buf.cast("q")
        self._gen = [(1 + r) * _Q for r in range(world)]
        stride = _slot_stride(max_elems)
        self._slots = np.ndarray((2, world, max_elems), np.float32, shm.buf,
                                 offset=_LINE * (1 + world),
                                 strides=(world * stride * 4, stride * 4, 4))
        self._generation = self._counters[self._gen[rank]]
        self._broken: str | None = None
        self._unlinked = False

    @classmethod
    def create(cls, name: str, world: int, max_elems: int, rank: int = 0,
               timeout: float = 60.0) -> ShmAllReduce:
        """Create the segment ``name`` for ``world`` ranks and arrays of up
        to ``max_elems`` float32 elements; returns rank ``rank`` 's handle
        (rank 0 by convention). The creator should :meth:`unlink` it when
        the group ends (its resource tracker does at its exit otherwise).
        Raises ``FileExistsError`` when ``name`` exists, ``ValueError`` for
        ``world`` < 1, ``max_elems`` < 1 or a rank outside the world."""
        if world < 1 or max_elems < 1 or not 0 <= rank < world:
            raise ValueError(f"ShmAllReduce needs world >= 1, max_elems >= 1 and a rank in "
                             f"0..world-1, got {world}, {max_elems}, rank {rank}")
        size = _LINE * (1 + world) + 2 * world * _slot_stride(max_elems) * 4
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        header = np.ndarray((3,), np.int64, shm.buf)
        header[1:3] = world, max_elems
        header[0] = _MAGIC  # last: an attacher polling for it sees the rest
        del header
        return cls(shm, rank, owner=True, timeout=timeout)

    @classmethod
    def attach(cls, name: str, rank: int, timeout: float = 60.0) -> ShmAllReduce:
        """Rank ``rank`` 's handle on the segment ``name`` that another
        process creates (or created); waits up to ``timeout`` seconds for it
        to appear. Raises ``TimeoutError`` if it does not, ``ValueError``
        for a rank outside its world.

        Python 3.11 registers an attached segment with the process's
        resource tracker too, which unlinks it when that process exits while
        the others still use it; the attach skips the registration (vLLM's
        ``shm_broadcast`` does the same; Python 3.13 has ``track=False``).
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                shm = _open_untracked(name)
            except (FileNotFoundError, ValueError):  # ValueError: created, not sized yet
                shm = None
            if shm is not None:
                if _header(shm)[0] == _MAGIC:
                    return cls(shm, rank, owner=False, timeout=timeout)
                shm.close()  # being created: the magic is written last
            if time.monotonic() > deadline:
                raise TimeoutError(f"shared memory {name!r} not created within {timeout} s")
            time.sleep(1e-3)

    def all_reduce(self, x: np.ndarray) -> None:
        """Replace ``x`` by the sum of every rank's ``x``, in place.

        Args:
            x: float32, C-contiguous, writeable, any shape of at most
                ``max_elems`` elements; the same size on every rank.

        Raises:
            ValueError: another dtype or layout, too many elements, or
                (after the barrier) ranks that passed different sizes.
            TimeoutError: some rank did not reach this call within
                ``timeout`` seconds; the message names them. The group is
                then out of step: later calls raise ``RuntimeError``.
        """
        if self._broken:
            raise RuntimeError(f"ShmAllReduce {self.name!r} is out of step: {self._broken}")
        if x.dtype != np.float32 or not x.flags.c_contiguous or not x.flags.writeable:
            raise ValueError(f"all_reduce needs a writeable C-contiguous float32 array, got "
                             f"{x.dtype} contiguous={x.flags.c_contiguous}")
        n = x.size
        if n > self.max_elems:
            raise ValueError(f"all_reduce of {n} elements exceeds the segment's "
                             f"max_elems {self.max_elems}")
        if self.world == 1:
            return
        flat, counters, me = x.reshape(-1), self._counters, self._gen[self.rank]
        g = self._generation = self._generation + 1
        slots = self._slots[g & 1, :, :n]  # (world, n)
        slots[self.rank] = flat
        counters[me + 1 + (g & 1)] = n
        counters[me] = g  # last: publishes the slot
        self._wait(g)
        sizes = [counters[i + 1 + (g & 1)] for i in self._gen]
        if any(size != n for size in sizes):
            self._broken = f"ranks passed sizes {sizes}"
            raise ValueError(f"all_reduce: the ranks passed different sizes {sizes}")
        np.add(slots[0], slots[1], out=flat)  # ((s0 + s1) + s2) + ...: rank order
        for r in range(2, self.world):
            np.add(flat, slots[r], out=flat)

    def _wait(self, g: int) -> None:
        """Until every rank's generation is >= ``g``; ``TimeoutError`` naming
        the missing ranks after ``timeout`` seconds."""
        counters, spins, deadline = self._counters, 0, None
        for i in self._gen:
            while counters[i] < g:
                spins += 1
                if spins <= BUSY_SPINS:
                    continue
                if spins <= BUSY_SPINS + YIELD_SPINS:
                    os.sched_yield()
                    continue
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout
                elif now > deadline:
                    missing = [r for r, j in enumerate(self._gen) if counters[j] < g]
                    self._broken = f"ranks {missing} missed call {g}"
                    raise TimeoutError(f"all_reduce call {g}: ranks {missing} of {self.world} "
                                       f"did not arrive within {self.timeout} s")
                time.sleep(BACKOFF_S)

    def close(self) -> None:
        """Unmap the segment from this process (every rank, when done)."""
        if self._slots is None:
            return
        self._slots = None  # views of the buffer must go first
        self._counters.release()
        self._shm.close()

    def unlink(self) -> None:
        """Remove the segment's name (the creator, once every rank has
        attached; mappings stay valid until closed). Idempotent."""
        if self._unlinked:
            return
        self._unlinked = True
        if not self.owner:  # SharedMemory.unlink unregisters what we never registered
            resource_tracker.register(self._shm._name, "shared_memory")
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> ShmAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_untracked(name: str) -> shared_memory.SharedMemory:
    """``SharedMemory(name)`` without the resource-tracker registration
    (see :meth:`ShmAllReduce.attach`). Raises ``FileNotFoundError``."""
    with _TRACKER_LOCK:
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def _header(shm: shared_memory.SharedMemory) -> tuple[int, int, int]:
    """``(magic, world, max_elems)`` of a segment (zeros when too small)."""
    if shm.size < _LINE:
        return 0, 0, 0
    magic, world, max_elems = np.ndarray((3,), np.int64, shm.buf).tolist()
    return magic, world, max_elems


def _slot_stride(max_elems: int) -> int:
    """Floats per slot: ``max_elems`` rounded up to a cache line."""
    per_line = _LINE // 4
    return -(-max_elems // per_line) * per_line


def unlink_segment(name: str) -> None:
    """Remove the shared-memory segment ``name`` (an all-reduce group's,
    after its workers left it) without the resource tracker of this process,
    which never registered it; nothing if it is gone already."""
    import _posixshmem

    try:
        _posixshmem.shm_unlink("/" + name.lstrip("/"))
    except FileNotFoundError:
        pass


#: An all-reduce segment's name: the pid of the API process that formed the
#: group (it unlinks the segment when the group ends), then the group's id,
#: stage and generation (``kvserve.distributed.pipeline``).
_SEGMENT_NAME = re.compile(r"^kvserve-tp-(\d+)-[0-9a-f]+-\d+-\d+$")


def segment_name(group_id: str, stage: int, generation: int) -> str:
    """The segment name of a stage's all-reduce group formed by this process."""
    return f"kvserve-tp-{os.getpid()}-{group_id}-{stage}-{generation}"


def remove_stale_segments(directory: str = "/dev/shm") -> list[str]:
    """Unlink the all-reduce segments whose API process is gone (killed, or
    stopped before it could unlink them: issue 47, item 11); logs
    ``stale_tp_segments_removed``. Returns the names removed. A segment of
    a live process, or of a name this module did not make, is left alone;
    nothing where ``directory`` does not exist."""
    import structlog

    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _SEGMENT_NAME.match(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        unlink_segment(name)
        removed.append(name)
    if removed:
        structlog.get_logger("kvserve.parallel").info(
            "stale_tp_segments_removed", names=removed,
            message=f"Removed {len(removed)} tensor-parallel all-reduce segment(s) of stopped "
                    "servers from /dev/shm")
    return removed

