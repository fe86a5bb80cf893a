"""KVConnector: the worker's side of KV transfer (``kvserve.core.kv_transfer``).

At the start of each step, before the forward pass writes the cache, the
runner hands it the step's transfers and the connector copies bytes:

1. **saves**: evicted prefix-cache blocks, cache -> offload tier;
2. **exports**: a finished prefill request's prompt blocks, cache -> one
   host array per request, handed to the engine (and by a prefill replica
   to Ray's object store for a decode replica);
3. **loads**: cache <- offload tier (blocks a request found there), or
   cache <- an import (the blocks a decode replica received for a request).

The copies go through the backend's ``to_numpy`` / ``to_device``, so the
same code serves NumPy caches and CuPy ones. One block in host memory is
``[num_layers, 2, block_size, num_kv_heads, head_dim]`` of the cache's dtype
(the per-layer caches are ``[num_blocks, 2, block_size, nkv, hd]``).

The connector is the worker's alone (``kvserve.actors.worker``): every
call comes from the worker actor, one at a time, so it needs no lock. The
scheduler looks blocks up in the tier through a mapping of its own
(``KVLayout.attach_tier``); only the tier's own locks are shared.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from kvserve.core.kv_transfer import BlockTransfer
from kvserve.core.outputs import SchedulerOutput
from kvserve.kv_offload.disk_tier import DiskTier
from kvserve.kv_offload.host_tier import BlockLost, SharedHostTier

log = structlog.get_logger("kvserve.kv_connector")

#: Seconds an import waits for its request's admission before it is dropped
#: (its request was refused or aborted before it reached the scheduler).
IMPORT_TTL_SECONDS = 120.0


@dataclass
class TransferStats:
    """One step's copies per direction (``offload``, ``onload``, ``export``,
    ``import``; with a disk tier ``disk_read``, and ``disk_write`` /
    ``disk_drop`` for the writer thread's writes and dropped writes since the
    last step): ``{direction: [blocks, bytes, seconds]}``. ``offload_tiers``:
    the look-ups of tiers below the memory tier, ``{"disk": [queries, hits]}``
    in tokens (the memory tier's are the scheduler output's
    ``kv_offload_queries`` / ``kv_offload_hits``)."""

    by_direction: dict[str, list[float]] = field(default_factory=dict)
    offload_tiers: dict[str, list[int]] = field(default_factory=dict)

    def add(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        entry = self.by_direction.setdefault(direction, [0, 0, 0.0])
        entry[0] += blocks
        entry[1] += nbytes
        entry[2] += seconds


@dataclass(frozen=True)
class ExportedKV:
    """A prefill request's full prompt blocks: their hashes, in order, and
    their K/V, ``[len(block_hashes), num_layers, 2, block_size, nkv, hd]``
    of the cache's dtype (what a decode replica's ``import_kv`` takes)."""

    block_hashes: tuple[bytes, ...]
    data: np.ndarray


@dataclass
class TransferResult:
    """What ``KVConnector.run`` did: ``exports`` maps request id -> its
    ``ExportedKV``; ``stats`` the copies."""

    exports: dict[str, ExportedKV] = field(default_factory=dict)
    stats: TransferStats = field(default_factory=TransferStats)


@dataclass(frozen=True)
class KVLayout:
    """What a block of this engine's KV cache is outside the cache: its
    host shape ``(num_layers, 2, block_size, num_kv_heads, head_dim)``, its
    NumPy dtype (a ``str``, e.g. ``"<f4"``) and the model fingerprint
    (``engine.model_fingerprint``). An offload tier must match all three."""

    block_shape: tuple[int, ...]
    dtype: str
    fingerprint: str

    @classmethod
    def of(cls, kv_caches: Sequence, fingerprint: str) -> KVLayout:
        """The layout of per-layer caches ``[num_blocks, 2, bs, nkv, hd]``."""
        first = kv_caches[0]
        return cls((len(kv_caches), *(int(d) for d in first.shape[1:])),
                   np.dtype(first.dtype).str, fingerprint)

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.block_shape[2]

    def attach_tier(self, path: str) -> SharedHostTier:
        """A mapping of its own of the tier at ``path`` (the scheduler's
        look-ups). Raises ``ValueError`` for a tier of another layout and
        ``FileNotFoundError`` when it is gone."""
        return SharedHostTier.attach(path, self.block_shape, self.dtype, self.fingerprint)

    def connector(self, ops) -> KVConnector:
        """A connector for caches of this layout, with no tier yet."""
        return KVConnector(ops, self.block_shape, self.dtype, self.fingerprint)


class TieredLookup:
    """The scheduler's view of a memory tier with a disk tier under it (a
    ``kv_transfer.ExternalKV``): a prefix is found in the memory tier, then
    continued on disk. ``memory``: the scheduler's own mapping of the tier
    (closed by ``close``); ``disk``: the worker connector's ``DiskTier``
    (one per process; its index is thread-safe; never closed here)."""

    def __init__(self, memory: SharedHostTier, disk: DiskTier) -> None:
        self.memory = memory
        self.disk = disk

    def lookup_tiers(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """Blocks of ``block_hashes``, from the first, found in memory, then
        on disk after those: ``(memory, disk)``; both leased. No file I/O."""
        in_memory = self.memory.lookup(block_hashes)
        return in_memory, self.disk.lookup(block_hashes[in_memory:])

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """Blocks found in both tiers together (``ExternalKV.lookup``)."""
        return sum(self.lookup_tiers(block_hashes))

    def close(self) -> None:
        """Unmap the memory tier (the disk tier is the connector's)."""
        self.memory.close()


@dataclass
class _Import:
    hashes: dict[bytes, int]  # block hash -> row of data
    data: np.ndarray  # [num_blocks, *block_shape]
    expires: float


class KVConnector:
    """Copies KV blocks between the runner's cache and the outside.

    Args:
        ops: the backend's ops (``to_numpy``, ``to_device``; ``xp`` if any).
        block_shape: one block in host memory,
            ``(num_layers, 2, block_size, num_kv_heads, head_dim)``.
        dtype: the KV cache's dtype (NumPy).
        fingerprint: the model, quantization and dtype the K/V come from
            (``engine.model_fingerprint``): a tier of another one is refused.
    """

    def __init__(self, ops, block_shape: Sequence[int], dtype, fingerprint: str) -> None:
        self.ops = ops
        self.xp = ops.xp
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = np.dtype(dtype)
        self.fingerprint = fingerprint
        self.tier: SharedHostTier | None = None
        self.owns_tier = False
        #: The disk tier under the memory tier (``open_disk``), or None.
        self.disk: DiskTier | None = None
        self._disk_reported = ([0, 0, 0.0], [0, 0, 0.0])  # writes, drops already in stats
        self._imports: dict[str, _Import] = {}
        self._poisoned: set[int] = set()

    def create_tier(self, size_bytes: int) -> SharedHostTier:
        """Create (and own: ``close`` deletes it) an offload tier of
        ``size_bytes``. Raises ``ValueError`` if not one block fits."""
        self.tier = SharedHostTier.create(size_bytes, self.block_shape, self.dtype,
                                          self.fingerprint)
        self.owns_tier = True
        return self.tier

    def attach_tier(self, path: str) -> SharedHostTier:
        """Map the offload tier another process created at ``path``. Raises
        ``ValueError`` if it holds another model's blocks."""
        self.tier = SharedHostTier.attach(path, self.block_shape, self.dtype, self.fingerprint)
        self.owns_tier = False
        return self.tier

    def open_disk(self, directory: str, size_bytes: int) -> DiskTier:
        """Open (scan) the disk tier in ``directory``, bounded to
        ``size_bytes``, under the memory tier. Raises ``ValueError`` if not
        one block fits, ``OSError`` if the folder cannot be made."""
        self.disk = DiskTier(directory, self.block_shape, self.dtype, self.fingerprint,
                             size_bytes, verify_in_background=True)
        return self.disk

    def lookup_view(self):
        """The scheduler's ``ExternalKV``: a mapping of its own of the memory
        tier, continued on this connector's disk tier when there is one.
        Raises ``ValueError`` without a memory tier."""
        if self.tier is None:
            raise ValueError("this connector has no offload tier")
        memory = SharedHostTier.attach(self.tier.path, self.block_shape, self.dtype,
                                       self.fingerprint)
        return memory if self.disk is None else TieredLookup(memory, self.disk)

    # ----------------------------------------------------------- imports

    def add_import(self, request_id: str, block_hashes: Sequence[bytes],
                   data: np.ndarray) -> None:
        """Keep a prefill replica's blocks for ``request_id`` until a step
        loads them (``data``: ``[len(block_hashes), *block_shape]``)."""
        self._drop_expired(time.monotonic())
        self._imports[request_id] = _Import({h: i for i, h in enumerate(block_hashes)}, data,
                                            time.monotonic() + IMPORT_TTL_SECONDS)

    def drop_imports(self, request_ids: Iterable[str]) -> None:
        """Forget the imports of these requests (done with, or gone)."""
        for request_id in request_ids:
            self._imports.pop(request_id, None)

    @property
    def num_imports(self) -> int:
        """Imports held (blocks received and not loaded yet)."""
        return len(self._imports)

    def _drop_expired(self, now: float) -> None:
        for request_id in [r for r, i in self._imports.items() if i.expires < now]:
            del self._imports[request_id]

    # ------------------------------------------------------- worker's side

    def poison(self, block_ids: Iterable[int]) -> None:
        """A step that wrote these blocks failed: the next step must not save
        them to the tier (the scheduler forgets their hashes meanwhile)."""
        self._poisoned = set(block_ids)

    def run(self, kv_caches: Sequence, output: SchedulerOutput) -> TransferResult:
        """Carry out a step's saves, exports and loads, in that order; then
        drop the imports of requests the step lists as finished. Raises
        ``BlockLost`` if a tier block to load is gone (the step then fails:
        its loaded blocks must not be used)."""
        result = TransferResult()
        saves = [s for s in output.kv_saves if s.block_id not in self._poisoned]
        self._poisoned = set()
        if saves and self.tier is not None:
            self._save(kv_caches, saves, result.stats)
        exports = _by_request(output.kv_exports)
        for request_id in output.kv_export_ids:
            result.exports[request_id] = self._export(kv_caches, exports.get(request_id, []),
                                                      result.stats)
        if output.kv_loads:
            self._load(kv_caches, output.kv_loads, result.stats)
        if self.disk is not None:
            self._disk_stats(output, result.stats)
        self.drop_imports(output.finished_request_ids)
        return result

    def _disk_stats(self, output: SchedulerOutput, stats: TransferStats) -> None:
        """The disk tier's look-ups of this step (tokens the memory tier
        missed, tokens loaded from disk) and the writer's writes and dropped
        writes since the last step."""
        disk_hits = int(stats.by_direction.get("disk_read", [0])[0]) * self.block_shape[2]
        queries = output.kv_offload_queries - output.kv_offload_hits
        if queries or disk_hits:
            stats.offload_tiers["disk"] = [queries, disk_hits]
        writes, dropped = self.disk.snapshot()
        for direction, now, before in (("disk_write", writes, self._disk_reported[0]),
                                       ("disk_drop", dropped, self._disk_reported[1])):
            if now[0] != before[0]:
                stats.add(direction, now[0] - before[0], now[1] - before[1], now[2] - before[2])
                before[:] = now

    def _gather(self, kv_caches: Sequence, block_ids: Sequence[int]) -> np.ndarray:
        """Host ``[len(block_ids), num_layers, 2, bs, nkv, hd]`` of these blocks."""
        ids = self.xp.asarray(np.asarray(block_ids, dtype=np.int64))
        return np.stack([self.ops.to_numpy(cache[ids]) for cache in kv_caches], axis=1)

    def _scatter(self, kv_caches: Sequence, block_ids: Sequence[int], blocks: np.ndarray) -> None:
        """Write host ``blocks`` ``[n, num_layers, ...]`` into these cache blocks."""
        ids = self.xp.asarray(np.asarray(block_ids, dtype=np.int64))
        for layer, cache in enumerate(kv_caches):
            cache[ids] = self.ops.to_device(np.ascontiguousarray(blocks[:, layer]))

    def _save(self, kv_caches: Sequence, saves: list[BlockTransfer], stats: TransferStats) -> None:
        """Save blocks to the memory tier and, with a disk tier, queue the
        ones it lacks for the disk writer: host copies (``_gather`` makes a
        new array), so the device blocks may be reused at once."""
        t0 = time.perf_counter()
        copies: dict[int, np.ndarray] = {}  # index in saves -> host copy

        def write(slots: np.ndarray, indices: np.ndarray) -> None:
            data = self._gather(kv_caches, [saves[i].block_id for i in indices])
            self.tier.data[slots] = data
            copies.update(zip(indices.tolist(), data))
        written = self.tier.store([s.block_hash for s in saves], write)
        stats.add("offload", written, written * self.tier.slot_bytes, time.perf_counter() - t0)
        if self.disk is not None:
            missing = [i for i, s in enumerate(saves) if not self.disk.contains(s.block_hash)]
            rest = [i for i in missing if i not in copies]
            if rest:
                copies.update(zip(rest, self._gather(kv_caches, [saves[i].block_id
                                                                 for i in rest])))
            for i in missing:
                self.disk.put(saves[i].block_hash, copies[i])

    def _export(self, kv_caches: Sequence, blocks: list[BlockTransfer],
                stats: TransferStats) -> ExportedKV:
        t0 = time.perf_counter()
        if blocks:
            data = self._gather(kv_caches, [b.block_id for b in blocks])
        else:
            data = np.empty((0, *self.block_shape), dtype=self.dtype)
        stats.add("export", len(blocks), data.nbytes, time.perf_counter() - t0)
        return ExportedKV(tuple(b.block_hash for b in blocks), data)

    def _load(self, kv_caches: Sequence, loads: Sequence[BlockTransfer],
              stats: TransferStats) -> None:
        from_tier: list[BlockTransfer] = []
        for request_id, blocks in _by_request(loads).items():
            imported = self._imports.pop(request_id, None)
            if imported is None:
                from_tier += blocks
                continue
            t0 = time.perf_counter()
            rows = [imported.hashes[b.block_hash] for b in blocks]
            data = imported.data[rows]
            self._scatter(kv_caches, [b.block_id for b in blocks], data)
            stats.add("import", len(blocks), data.nbytes, time.perf_counter() - t0)
        if from_tier and self.tier is None:
            raise BlockLost(f"the imported KV blocks of {from_tier[0].request_id!r} are gone "
                            "(dropped before the step that loads them)")
        from_disk: list[BlockTransfer] = []
        if from_tier and self.disk is not None:
            held = self.tier.holds([b.block_hash for b in from_tier])
            from_disk = [b for b, h in zip(from_tier, held) if not h]
            from_tier = [b for b, h in zip(from_tier, held) if h]
        if from_tier:
            t0 = time.perf_counter()

            def read(slots: np.ndarray) -> None:
                self._scatter(kv_caches, [b.block_id for b in from_tier], self.tier.data[slots])
            self.tier.read_into([b.block_hash for b in from_tier], read)
            stats.add("onload", len(from_tier), len(from_tier) * self.tier.slot_bytes,
                      time.perf_counter() - t0)
        if from_disk:
            t0 = time.perf_counter()
            data = np.stack([self.disk.read(b.block_hash) for b in from_disk])
            self._scatter(kv_caches, [b.block_id for b in from_disk], data)
            stats.add("disk_read", len(from_disk), len(from_disk) * self.disk.file_bytes,
                      time.perf_counter() - t0)

    def close(self) -> None:
        """Unmap the tier (and delete it if this engine created it); finish
        the disk tier's queued writes and stop its writer."""
        if self.tier is not None:
            self.tier.unlink() if self.owns_tier else self.tier.close()
            self.tier = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None


def build_kv_connector(ops, layout: KVLayout, cache_config) -> KVConnector | None:
    """The engine's connector when ``cache_config`` (``CacheConfig``) asks
    for an offload tier (attached at ``kv_offloading_shm_path``, or created
    with ``kv_offloading_size`` GiB); None otherwise: the worker builds one
    when a step first transfers blocks (an export, an import) or a tier is
    attached later. With ``kv_offloading_backend`` ``disk`` the connector
    also opens the disk tier in ``kv_offloading_path`` (``DiskTier``, at
    most ``kv_offloading_disk_size`` GiB). Raises ``ValueError`` for a tier
    made for another model (``layout.fingerprint``) or one too small for a
    block, ``OSError`` for a disk folder that cannot be made."""
    if not (cache_config.kv_offloading_shm_path or cache_config.kv_offloading_size > 0):
        return None
    connector = layout.connector(ops)
    if cache_config.kv_offloading_shm_path:
        connector.attach_tier(cache_config.kv_offloading_shm_path)
    else:
        connector.create_tier(int(cache_config.kv_offloading_size * 2**30))
    if getattr(cache_config, "kv_offloading_backend", "native") == "disk":
        try:
            connector.open_disk(cache_config.kv_offloading_path,
                                int(cache_config.kv_offloading_disk_size * 2**30))
        except BaseException:
            connector.close()
            raise
    return connector


def log_offload_tier(connector: KVConnector) -> None:
    """``kv_offload_tier``: the connector's tier (size, blocks, tokens,
    created or attached); nothing without one."""
    tier = connector.tier
    if tier is None:
        return
    size = tier.num_slots * tier.slot_bytes
    tokens = tier.num_slots * tier.block_shape[2]
    log.info("kv_offload_tier", path=str(tier.path), num_blocks=tier.num_slots,
             num_tokens=tokens, bytes=size, created=connector.owns_tier,
             message=f"KV offload tier: {size / 2**30:.2f} GiB of shared memory, "
                     f"{tier.num_slots:,} blocks ({tokens:,} tokens), "
                     f"{'created' if connector.owns_tier else 'attached'} at {tier.path}")
    if connector.disk is not None:
        log_disk_tier(connector.disk)


def log_disk_tier(disk: DiskTier) -> None:
    """``kv_offload_disk_tier``: the disk tier's folder, bound, and what the
    start-up scan found (blocks, bytes, files removed and why)."""
    scan = disk.scan_report
    removed = sum(scan.removed.values())
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(scan.removed.items()))
    log.info("kv_offload_disk_tier", path=str(disk.folder), num_blocks=scan.blocks,
             bytes=scan.bytes, max_blocks=disk.max_blocks, removed=dict(scan.removed),
             unverified=scan.unverified,
             message=f"KV disk tier at {disk.folder}: found {scan.blocks + scan.unverified:,} "
                     f"blocks of at most {disk.max_blocks:,}; removed {removed} file(s)"
                     f"{f' ({why})' if why else ''}"
                     + (f"; checking the checksums of {scan.unverified:,} in the background "
                        "(each is used once checked)" if scan.unverified else ""))
    stat = os.statvfs(disk.folder)
    room = stat.f_bavail * stat.f_frsize + scan.bytes
    if room < disk.max_blocks * disk.file_bytes:
        log.warning("kv_offload_disk_small", path=str(disk.folder), room_bytes=room,
                    message=f"--kv-offloading-disk-size is more than the {room / 2**30:.1f} GiB "
                            f"free in {disk.root}: writes will fail (and be dropped) when full")


def _by_request(transfers: Iterable[BlockTransfer]) -> dict[str, list[BlockTransfer]]:
    grouped: dict[str, list[BlockTransfer]] = {}
    for transfer in transfers:
        grouped.setdefault(transfer.request_id, []).append(transfer)
    return grouped
