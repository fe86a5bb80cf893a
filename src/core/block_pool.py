"""The KV blocks themselves: their reference counts, the free queue ordered
for eviction, and the ``block hash -> block`` index of cached blocks
(vLLM v1's ``BlockPool``; ``kv_cache_manager`` states the policy: which
block is free, cached-free, evicted first, and the null block).

Pure bookkeeping of block ids: the tensors live in the model runner.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

from .kv_events import KVEventLog
from .prefix_explainer import BlockContent


class KVCacheBlock:
    """One KV block's metadata: id, reference count, prefix-cache hash, the
    explainer's ``content`` (None unless content hashes are tracked) and the
    links of the free queue (None while the block is not in it)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "content", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.content: BlockContent | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        tag = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={tag})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks with O(1) push at either end, pop from
    the head, and removal from the middle (when a cached free block is hit)."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)  # sentinels, never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head (reused first)."""
        self._insert_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block``; raises ``RuntimeError`` if it is not in the queue."""
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block; raises ``IndexError`` when empty."""
        if self._len == 0:
            raise IndexError("no free blocks")
        block = self._head.next_free
        self.remove(block)
        return block


class BlockPool:
    """All KV blocks, their reference counts, the free queue and the
    ``block hash -> block`` index of cached blocks.

    ``enable_caching=False`` turns every hash registration into a no-op.
    Blocks registered with a ``BlockContent`` are also indexed in
    ``content_index``: ``content hash -> position -> {block id: None}``
    (insertion-ordered, so the most recently cached block comes last). It
    holds exactly the cached blocks that carry content: at most
    ``num_blocks`` entries in all.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 events: KVEventLog | None = None, reserve_null: bool = False) -> None:
        if num_blocks < 1 + reserve_null:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        #: Where hash registrations and evictions are recorded (None: nowhere).
        self.events = events
        #: Whether to record, as ``(block id, hash)``, the blocks registered
        #: (``stored``) and the cached blocks evicted (``evicted``) for the
        #: offload tier.
        self.record_offload = False
        self.stored: list[tuple[int, bytes]] = []
        self.evicted: list[tuple[int, bytes]] = []
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.content_index: dict[bytes, dict[int, dict[int, None]]] = {}
        #: The reserved null block (block 0, held forever), or None.
        self.null_block: KVCacheBlock | None = None
        if reserve_null:
            self.null_block = self.free_queue.popleft()
            self.null_block.ref_cnt = 1

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can hold: all but the null block."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (plain free and cached-free)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction (0..1) of the usable blocks held by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block registered under ``block_hash`` (free or in use), or None."""
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting
        their cached hashes; each returned block has ref count 1.
        Raises ``ValueError`` when fewer blocks are free."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, "
                             f"only {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if self.record_offload and block.block_hash is not None:
                self.evicted.append((block.block_id, block.block_hash))
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
        if block.content is not None:
            self._unindex_content(block)
        block.block_hash = block.content = None

    def _unindex_content(self, block: KVCacheBlock) -> None:
        content = block.content
        by_position = self.content_index.get(content.content_hash, {})
        ids = by_position.get(content.position, {})
        ids.pop(block.block_id, None)
        if not ids:
            by_position.pop(content.position, None)
            if not by_position:
                self.content_index.pop(content.content_hash, None)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block (a prefix-cache hit), taking a
        cached-free block out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order (first =
        evicted first). Blocks reaching 0 join the free queue: cached ones at
        the tail, uncached ones at the head. Raises ``RuntimeError`` on a
        double free (ref count already 0)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes,
                         content: BlockContent | None = None, computed: bool = True) -> bool:
        """Register a full, computed ``block`` under ``block_hash``, and in
        ``content_index`` when ``content`` is given. ``computed=False``: its
        K/V come from outside (not recorded in ``stored``).

        Returns True if registered (or already registered under that hash);
        False when caching is off or another block already holds that hash
        (duplicate content computed twice: the first copy stays the cached one
        and this block stays unhashed). Raises ``ValueError`` if the block
        already carries a different hash.
        """
        if not self.enable_caching:
            return False
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"{block} is already cached under another hash")
            return True
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash)
        if self.record_offload and computed:
            self.stored.append((block.block_id, block_hash))
        if content is not None:
            block.content = content
            by_position = self.content_index.setdefault(content.content_hash, {})
            by_position.setdefault(content.position, {})[block.block_id] = None
        return True

    def blocks_with_content(self, block_content_hash: bytes,
                            position: int | None = None) -> list[int]:
        """Sorted ids of cached blocks whose tokens have this
        position-independent content hash, at any position or only at block
        index ``position`` (only populated when the manager tracks content
        hashes)."""
        by_position = self.content_index.get(block_content_hash, {})
        if position is not None:
            return sorted(by_position.get(position, ()))
        return sorted(i for ids in by_position.values() for i in ids)

    def blocks_at(self, block_content_hash: bytes, position: int,
                  limit: int | None = None) -> list[KVCacheBlock]:
        """Cached blocks with this content at block index ``position``, most
        recently cached first, at most ``limit`` of them. O(number returned)."""
        ids = self.content_index.get(block_content_hash, {}).get(position, {})
        return [self.blocks[i] for i in islice(reversed(ids), limit)]

    def child_at(self, block_content_hash: bytes, position: int,
                 parent_hash: bytes) -> KVCacheBlock | None:
        """The cached block with this content at block index ``position``
        whose parent is the block hashed ``parent_hash``, or None. O(blocks
        with that content at that position)."""
        for block_id in self.content_index.get(block_content_hash, {}).get(position, ()):
            block = self.blocks[block_id]
            if block.content.parent_hash == parent_hash:
                return block
        return None

    def evict_hashes(self, block_ids: Iterable[int]) -> None:
        """Forget the cached hashes of these blocks (their K/V may be bad,
        e.g. the step that was writing them failed). Blocks stay where they
        are; a free one becomes plain free."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            self._evict(block)
            if block.ref_cnt == 0:  # move from the cached tail to the free head
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is in use;
        returns False (and changes nothing) otherwise."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        if self.events is not None:
            self.events.cleared()
        return True

    def count_blocks(self) -> tuple[int, int, int]:
        """``(plain free, cached free, in use)`` block counts, by a full scan."""
        free = cached_free = in_use = 0
        for block in self.blocks:
            if block.ref_cnt > 0:
                in_use += 1
            elif block.block_hash is None:
                free += 1
            else:
                cached_free += 1
        return free, cached_free, in_use
