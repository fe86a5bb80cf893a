"""KV cache events: which block hashes a KV cache gained and lost.

A replica's ``BlockPool`` records every change to its prefix-cache index
here, so a router in another process can keep an approximate index of which
replica holds which prefix (vLLM's KV events, SGLang's cache-aware router).
The event names are vLLM's: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``. Pure data: no asyncio, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Blocks registered in the prefix cache, by hash, in order."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache (their hashes are forgotten)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Events in the order they happened, consecutive ones of one kind merged.

    ``drain()`` hands them over and starts a new batch (the engine sends one
    batch per step). ``max_events`` bounds the batch: past it the log keeps
    one ``AllBlocksCleared`` plus later events, since a consumer that missed
    events must forget what it knew rather than trust a stale index.
    """

    def __init__(self, max_events: int = 65536) -> None:
        self.max_events = max_events
        self._runs: list[tuple[type, list[bytes]]] = []  # (kind, hashes), in order
        self._size = 0  # hashes (or clears) in the batch

    def stored(self, block_hash: bytes) -> None:
        """A block was registered under ``block_hash``."""
        self._add(BlockStored, block_hash)

    def removed(self, block_hash: bytes) -> None:
        """The block under ``block_hash`` was evicted."""
        self._add(BlockRemoved, block_hash)

    def cleared(self) -> None:
        """Every cached hash was forgotten: earlier events no longer matter."""
        self._runs = [(AllBlocksCleared, [])]
        self._size = 1

    def _add(self, kind: type, block_hash: bytes) -> None:
        if self._size >= self.max_events:
            self.cleared()
        if self._runs and self._runs[-1][0] is kind:
            self._runs[-1][1].append(block_hash)
        else:
            self._runs.append((kind, [block_hash]))
        self._size += 1

    def drain(self) -> tuple[KVEvent, ...]:
        """The events since the last drain, oldest first."""
        runs, self._runs, self._size = self._runs, [], 0
        return tuple(AllBlocksCleared() if kind is AllBlocksCleared else kind(tuple(hashes))
                     for kind, hashes in runs)
