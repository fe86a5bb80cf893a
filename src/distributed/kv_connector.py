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

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from kvserve.core.kv_transfer import BlockTransfer
from kvserve.core.outputs import SchedulerOutput
from kvserve.distributed.host_tier import BlockLost, SharedHostTier

log = structlog.get_logger("kvserve.kv_connector")

#: Seconds an import waits for its request's admission before it is dropped
#: (its request was refused or aborted before it reached the scheduler).
IMPORT_TTL_SECONDS = 120.0


@dataclass
class TransferStats:
    """One step's copies per direction (``offload``, ``onload``, ``export``,
    ``import``): ``{direction: [blocks, bytes, seconds]}``."""

    by_direction: dict[str, list[float]] = field(default_factory=dict)

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
        self.xp = getattr(ops, "xp", np)
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = np.dtype(dtype)
        self.fingerprint = fingerprint
        self.tier: SharedHostTier | None = None
        self.owns_tier = False
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
        self.drop_imports(output.finished_request_ids)
        return result

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
        t0 = time.perf_counter()

        def write(slots: np.ndarray, indices: np.ndarray) -> None:
            self.tier.data[slots] = self._gather(kv_caches, [saves[i].block_id for i in indices])
        written = self.tier.store([s.block_hash for s in saves], write)
        stats.add("offload", written, written * self.tier.slot_bytes, time.perf_counter() - t0)

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
        if from_tier:
            t0 = time.perf_counter()

            def read(slots: np.ndarray) -> None:
                self._scatter(kv_caches, [b.block_id for b in from_tier], self.tier.data[slots])
            self.tier.read_into([b.block_hash for b in from_tier], read)
            stats.add("onload", len(from_tier), len(from_tier) * self.tier.slot_bytes,
                      time.perf_counter() - t0)

    def close(self) -> None:
        """Unmap the tier (and delete it if this engine created it)."""
        if self.tier is not None:
            self.tier.unlink() if self.owns_tier else self.tier.close()
            self.tier = None


def build_kv_connector(ops, layout: KVLayout, cache_config) -> KVConnector | None:
    """The engine's connector when ``cache_config`` (``CacheConfig``) asks
    for an offload tier (attached at ``kv_offloading_path``, or created
    with ``kv_offloading_size`` GiB); None otherwise: the worker builds one
    when a step first transfers blocks (an export, an import) or a tier is
    attached later. Raises ``ValueError`` for a tier made for another model
    (``layout.fingerprint``) or one too small for a block."""
    if not (cache_config.kv_offloading_path or cache_config.kv_offloading_size > 0):
        return None
    connector = layout.connector(ops)
    if cache_config.kv_offloading_path:
        connector.attach_tier(cache_config.kv_offloading_path)
    else:
        connector.create_tier(int(cache_config.kv_offloading_size * 2**30))
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


def _by_request(transfers: Iterable[BlockTransfer]) -> dict[str, list[BlockTransfer]]:
    grouped: dict[str, list[BlockTransfer]] = {}
    for transfer in transfers:
        grouped.setdefault(transfer.request_id, []).append(transfer)
    return grouped
