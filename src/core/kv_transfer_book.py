"""The scheduler's book of KV transfers not handed to the runner yet: exports
of finished prefill requests, loads of adopted blocks, and the saves of a
step (``kv_transfer`` describes the three movements).

Pure logic (no asyncio, no arrays), owned by ``core.scheduler.Scheduler``,
which asks it for each step's transfers (``take``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .kv_cache_manager import KVCacheManager
from .kv_transfer import BlockTransfer
from .request import Request, RequestStatus


class KVTransferBook:
    """Exports and loads waiting for the next step, and exported blocks held
    until the runner copied them out.

    Args:
        manager: the KV cache manager whose blocks move.
    """

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self._unsent_exports: list[BlockTransfer] = []
        self._unsent_export_ids: list[str] = []
        self._exporting: set[str] = set()  # sent, holding their blocks
        self._pending_loads: list[BlockTransfer] = []

    @property
    def pending(self) -> bool:
        """True while exports or loads wait for a step."""
        return bool(self._unsent_export_ids or self._pending_loads)

    def export(self, request: Request) -> bool:
        """If ``request`` asked to export its KV (``export_kv``, a prefill
        replica's half of a disaggregated request) and finished well, queue
        its export (``kv_export_ids``; a prompt shorter than a block exports
        none) and its full prompt blocks for the runner to copy out, held
        until ``release``. Returns True if it holds blocks."""
        ok = request.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
        if not (request.sampling_params.export_kv and ok):
            return False
        manager = self.manager
        manager.update_block_hashes(request)
        num_full = min(request.num_prompt_tokens, request.num_computed_tokens) \
            // manager.block_size
        num_full = min(num_full, len(request.block_hashes))
        block_ids = manager.get_block_ids(request.request_id, 0, num_full)
        self._unsent_export_ids.append(request.request_id)
        if not block_ids:
            return False
        self._unsent_exports += [BlockTransfer(request.request_id, block_id, block_hash)
                                 for block_id, block_hash in zip(block_ids, request.block_hashes)]
        self._exporting.add(request.request_id)
        return True

    def release(self, request_ids: Iterable[str]) -> None:
        """The runner copied these requests' exported blocks (or failed to):
        free them. Unknown ids are ignored."""
        for request_id in request_ids:
            if request_id in self._exporting:
                self._exporting.discard(request_id)
                self.manager.free(request_id)

    def adopt(self, request_id: str, block_hashes: Sequence[bytes]) -> list[BlockTransfer]:
        """Adopt a prefill replica's blocks for ``request_id`` (full blocks of
        its prompt, in order): each hash the cache lacks gets a free block,
        registered under it; those already cached are kept. All are held
        until the request is admitted or finished; the next step loads the
        new blocks' K/V, so the admission finds the chain as prefix-cache
        hits. Returns the loads queued (fewer than the hashes when blocks
        are cached already or none is free)."""
        blocks = self.manager.adopt(request_id, block_hashes)
        loads = [BlockTransfer(request_id, b.block_id, b.block_hash) for b in blocks]
        self._pending_loads += loads
        return loads

    def take(self, stored: Sequence[BlockTransfer], step_loads: Sequence[BlockTransfer]
             ) -> tuple[tuple, tuple, tuple, tuple]:
        """A step's ``(saves, exports, export_ids, loads)``: saves of the
        blocks computed by earlier steps (``stored``) and of blocks evicted
        now, the queued exports, and the pending loads with the step's own
        (``step_loads``, from the offload tier). A pending load whose block
        was evicted since (its request left before the load ran) is dropped,
        and so is the save of that block: it holds nothing yet."""
        pool = self.manager.pool
        pending = [load for load in self._pending_loads
                   if pool.blocks[load.block_id].block_hash == load.block_hash]
        unloaded = {load.block_id for load in self._pending_loads}
        evicted = [save for save in self.manager.take_evicted()
                   if save.block_id not in unloaded]
        saves = tuple({save.block_hash: save for save in [*stored, *evicted]}.values())
        loads = tuple(pending + list(step_loads))
        exports, self._unsent_exports, self._pending_loads = tuple(self._unsent_exports), [], []
        export_ids, self._unsent_export_ids = tuple(self._unsent_export_ids), []
        return saves, exports, export_ids, loads
