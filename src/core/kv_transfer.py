"""KV blocks that move between a KV cache and the outside: the scheduler's side.

Three movements, each a list of ``BlockTransfer`` in a ``SchedulerOutput``
that the runner carries out at the start of the step, before the forward
pass writes anything (in this order):

- **save** (offload): a prefix-cache block is being evicted to make room;
  its K/V go to the host offload tier under its block hash (LMCache's and
  vLLM's CPU offloading, kept for any replica of the node to load).
- **export**: a finished request of a prefill replica hands its full prompt
  blocks to a decode replica (disaggregated prefill/decode, as in
  DistServe, Zhong et al. 2024, and vLLM's ``kv_producer`` role). The
  scheduler keeps those blocks until the runner has copied them out.
- **load**: blocks newly allocated for a request are filled from the
  offload tier or from a decode replica's imported blocks instead of being
  computed; they then count as computed and as prefix-cache entries.

The scheduler asks the tier only which hashes it holds (``ExternalKV``; with
a disk tier under the memory tier, ``TieredExternalKV``);
moving bytes is the worker's job (``kvserve.kv_offload.kv_connector``).
Pure data and protocols: no asyncio, no arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol


class BlockTransfer(NamedTuple):
    """One block to move: ``block_id`` in this engine's KV cache, the block's
    prefix-cache ``block_hash`` (the tier's key), and the ``request_id`` it
    moves for ("" for an eviction save, which belongs to no request)."""

    request_id: str
    block_id: int
    block_hash: bytes


class ExternalKV(Protocol):
    """A store of KV blocks outside this engine's cache, keyed by block hash
    (the offload tier). The scheduler's view: which blocks it can load."""

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes``, from the first, the store holds and
        promises to keep until the step that loads them has run (a lease).
        Never raises for a missing or unreachable store: it answers 0."""
        ...


class TieredExternalKV(ExternalKV, Protocol):
    """An ``ExternalKV`` of two tiers, memory and a disk tier under it
    (``kvserve.kv_offload.kv_connector.TieredLookup``): the block manager
    counts each tier's hits apart (``PrefixCacheStats.external_disk_*``)."""

    def lookup_tiers(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """``(memory, disk)``: blocks of ``block_hashes``, from the first,
        the memory tier holds, then those the disk tier holds after them;
        ``lookup`` is their sum. Leases them as ``lookup`` does."""
        ...
