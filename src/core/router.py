"""Prefix-aware routing across data-parallel replicas (pure logic).

Each replica's KV cache reports the block hashes it stored and evicted
(``kvserve.core.kv_events``); the router folds them into one approximate
index per replica. A request goes to the replica holding the longest cached
prefix of its prompt, unless that replica is overloaded beyond a margin; then
(and when no replica holds a prefix) to the least-loaded one. This is
SGLang's cache-aware router's rule (its ``balance_abs_threshold`` and
``balance_rel_threshold``) on vLLM-style KV events. The index is approximate
on purpose: a block evicted after its event was read is recomputed, never
wrong. No asyncio, no I/O: integers and hashes in, a decision out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvserve.core.block_hash import hash_request_blocks
from kvserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

#: A prefix replica is overloaded when its load exceeds the least loaded
#: replica's by more than this many requests ...
BALANCE_ABS_THRESHOLD = 4
#: ... and is more than this factor of it.
BALANCE_REL_THRESHOLD = 1.5
#: A cached prefix counts only when it covers at least this fraction of the
#: prompt's full blocks (SGLang's ``cache_threshold``): every chat shares the
#: template's first block, and a one-block match must not pull all traffic
#: onto one replica while the others idle.
MIN_PREFIX_FRACTION = 0.5


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's load: requests running and waiting (waiting tokens break ties)."""

    running: int = 0
    waiting: int = 0
    waiting_tokens: int = 0

    @property
    def requests(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes and why.

    ``reason``: ``prefix`` (the replica with the longest cached prefix),
    ``least_load`` (no replica holds a prefix) or ``prefix_overloaded`` (the
    prefix replica was too busy: the least-loaded one instead).
    ``cached_blocks``: the prefix blocks the chosen replica holds, by the index.
    """

    replica: int
    reason: str
    cached_blocks: int
    prefix_replica: int | None = None
    prefix_blocks: int = 0


class PrefixAwareRouter:
    """The per-replica prefix index and the routing rule.

    Args:
        num_replicas: replicas, numbered from 0.
        block_size: tokens per KV block (the replicas' ``--block-size``): the
            router hashes prompts exactly as the replicas' caches do.
        abs_threshold, rel_threshold: the overload margin (module constants).
        min_prefix_fraction: the least share of a prompt's full blocks a
            cached prefix must cover to count (``MIN_PREFIX_FRACTION``).

    Raises ``ValueError`` for fewer than one replica or a block size below 1.
    """

    def __init__(self, num_replicas: int, block_size: int,
                 abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 rel_threshold: float = BALANCE_REL_THRESHOLD,
                 min_prefix_fraction: float = MIN_PREFIX_FRACTION) -> None:
        if num_replicas < 1 or block_size < 1:
            raise ValueError(f"need >= 1 replica and block_size >= 1, got {num_replicas} "
                             f"and {block_size}")
        self.block_size = block_size
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.min_prefix_fraction = min_prefix_fraction
        self.index: list[set[bytes]] = [set() for _ in range(num_replicas)]

    def apply_events(self, replica: int, events: Iterable[KVEvent]) -> None:
        """Fold one replica's KV events into its index, in order."""
        held = self.index[replica]
        for event in events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def forget(self, replica: int) -> None:
        """The replica restarted (its cache is empty)."""
        self.index[replica].clear()

    def cached_prefix(self, replica: int, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt ``replica`` holds."""
        held, count = self.index[replica], 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad],
              available: Sequence[bool] | None = None) -> RouteDecision:
        """The replica for a prompt, given each replica's load (and, if
        given, which are up). ``ValueError`` when no replica is available."""
        up = [i for i in range(len(self.index)) if available is None or available[i]]
        if not up:
            raise ValueError("no replica is available")
        hashes = hash_request_blocks(prompt_token_ids, self.block_size)
        cached = {i: self.cached_prefix(i, hashes) for i in up}
        least = min(up, key=lambda i: (loads[i].requests, loads[i].waiting_tokens, i))
        best = max(up, key=lambda i: (cached[i], -loads[i].requests, -i))
        if cached[best] == 0 or cached[best] < self.min_prefix_fraction * len(hashes):
            return RouteDecision(least, "least_load", cached[least])
        if self._overloaded(loads[best], loads[least]):
            return RouteDecision(least, "prefix_overloaded", cached[least], best, cached[best])
        return RouteDecision(best, "prefix", cached[best], best, cached[best])

    def _overloaded(self, candidate: ReplicaLoad, least: ReplicaLoad) -> bool:
        return (candidate.requests - least.requests > self.abs_threshold
                and candidate.requests > self.rel_threshold * least.requests)
