"""Paged KV-cache bookkeeping with automatic prefix caching.

The KV cache is ``num_blocks`` fixed-size blocks of ``block_size`` tokens
(PagedAttention, Kwon et al. 2023). This module only tracks *which* block
holds what; the tensors live in the model runner. Design after vLLM v1's
``BlockPool`` / ``KVCacheManager`` (docs: "Automatic Prefix Caching"):

- Every block has a reference count (the number of requests whose block
  table holds it). A block with ref count 0 is *free*; if it still carries a
  block hash it is *cached-free*: its K/V stay valid and a later request with
  the same prefix can take it back (``touch``) until it is evicted.
- Free blocks sit in one queue ordered for eviction: ``get_new_blocks`` takes
  from the head (least recently freed). A request's blocks are freed in
  reverse order, so its tail blocks (the least shareable) are evicted before
  its head blocks. Unlike vLLM, freed blocks that carry *no* hash go to the
  head of the queue: they hold nothing reusable, so they should be reused
  before any cached block is evicted.
- All blocks are allocatable, except for a model with sliding-window layers
  (``windows``: KV-cache groups, ``kvserve.core.kv_layout``): there block 0
  is the reserved *null block* (vLLM's ``null_block``) that stands in a
  sliding group's table for a block freed behind the window; it is never
  written and never read.

Counts are in blocks unless named ``*_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .block_hash import content_hash, hash_request_blocks
from .block_pool import BlockPool, KVCacheBlock
from .kv_events import KVEventLog
from .kv_transfer import BlockTransfer, ExternalKV
from .outputs import PrefixCacheDivergence
from .prefix_explainer import BlockContent, find_divergence
from .request import Request


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens (vLLM's
    ``prefix_cache_queries`` / ``prefix_cache_hits``), counted once per
    admission or resume of a request. ``requests`` counts those admissions;
    ``divergences`` counts the ``PrefixCacheDivergence`` events reported
    (at most one per request, at its first admission)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    divergences: int = 0
    #: Tokens looked up in / loaded from the offload tier (after local misses;
    #: with a disk tier, hits in the memory tier only).
    external_queries: int = 0
    external_hits: int = 0
    #: With a disk tier under it: tokens the memory tier missed (looked up
    #: on disk) and tokens loaded from disk (not in ``external_hits``).
    external_disk_queries: int = 0
    external_disk_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Allocates KV blocks to requests and shares full blocks through the
    prefix cache.

    Flow per request (driven by the scheduler): ``get_computed_blocks`` finds
    the cached prefix, ``allocate_slots`` takes the hit blocks and new blocks
    for the tokens to compute this step, ``cache_computed_blocks`` registers
    the blocks that this step fills, and ``free`` returns the blocks (cached
    ones stay reusable until evicted).

    As in vLLM v1, a block is registered when it is scheduled to be filled,
    before the forward pass writes it. That is safe because every layer
    writes the K/V of all the batch's new tokens before any attention reads
    the cache, so a request admitted in the same step (e.g. the other samples
    of an ``n > 1`` request) can already share the blocks. If the step fails,
    the engine calls ``evict_hashes`` on its blocks.

    ``track_content_hashes`` (default: on whenever prefix caching is on)
    also records each cached block's ``BlockContent`` -- its
    position-independent content hash, position, parent hash and tokens --
    and indexes it (``BlockPool.blocks_with_content``), which the cache-miss
    explainer (``find_divergence``, see ``prefix_explainer``) needs. Cost:
    one extra SHA-256 per full block, computed once per request.

    ``events``: a ``KVEventLog`` that records every hash registered and
    evicted (``kvserve.core.kv_events``), for a router's prefix index.

    ``external``: the offload tier (``kv_transfer.ExternalKV``). With one,
    the blocks registered and the cached blocks evicted are handed out by
    ``take_offload`` (to be saved there: write-through, so that another
    replica finds a whole prefix, as vLLM's CPU offloading and LMCache
    store every computed block), and ``get_external_blocks`` extends a
    prefix-cache hit with the blocks the tier holds.

    ``windows``: one entry per KV-cache group (``kvserve.core.kv_layout``),
    None for a full-attention group or the window in tokens of a
    sliding-window one; the default is one full group, a single block table.
    With G groups a request's block table is flat and interleaved: logical
    block j of group g is entry ``j * G + g`` (so the per-step deltas and
    the runner's table stay append-only lists). When a request advances,
    the blocks of its sliding groups that lie wholly before the window of
    its next token are freed (vLLM's ``SlidingWindowManager.
    remove_skipped_blocks``) and their entries become the null block; a
    prefix-cache hit needs, in a sliding group, only the blocks inside the
    window of its first computed token (vLLM's sliding-window
    ``find_longest_cache_hit``). Group g > 0 registers a block under the
    request's block hash salted with g, so the groups' copies of one
    logical block are distinct cache entries. No offload tier and no
    ``adopt`` with sliding groups (``ValueError``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 track_content_hashes: bool | None = None,
                 events: KVEventLog | None = None, external: ExternalKV | None = None,
                 windows: Sequence[int | None] = (None,)) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        sliding = {window for window in windows if window is not None}
        if not windows or len(sliding) > 1 or any(window < 1 for window in sliding):
            raise ValueError(f"windows must name one or more groups with at most one positive "
                             f"sliding window, got {tuple(windows)}")
        self.block_size = block_size
        #: Block tables per request (KV-cache groups) and each group's window.
        self.num_groups = len(windows)
        self.windows = tuple(windows)
        #: The sliding window of the sliding groups (tokens), or None.
        self.window: int | None = next(iter(sliding), None)
        self._sliding_groups = [g for g, window in enumerate(windows) if window is not None]
        self.enable_prefix_caching = enable_prefix_caching
        if track_content_hashes is None:
            track_content_hashes = enable_prefix_caching
        self.track_content_hashes = track_content_hashes and enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching, events,
                              reserve_null=self.window is not None)
        self.null_block = self.pool.null_block
        self.external: ExternalKV | None = None
        self._last_disk_blocks: int | None = None  # of the last look-up; None: no disk tier
        self.set_external(external)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # request id -> content hashes of its first full blocks (memo, so each
        # block is content-hashed once; dropped when the request is freed)
        self.req_content_hashes: dict[str, list[bytes]] = {}
        #: owner -> blocks ``adopt`` holds for it (see ``release_adopted``)
        self.adopted: dict[str, list[KVCacheBlock]] = {}
        #: request id -> logical blocks whose sliding-group entries are null
        self.num_skipped: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (all but the null block, if any)."""
        return self.pool.num_usable_blocks

    def max_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """Most blocks a request of ``num_tokens`` tokens holds at once when
        each step computes at most ``chunk_tokens`` of them (see
        ``KVCacheLayout.max_blocks``; with one full group, one block per
        ``block_size`` tokens)."""
        full = cdiv(num_tokens, self.block_size)
        if self.window is None:
            return full * self.num_groups
        behind = min(full, cdiv(self.window - 1 + chunk_tokens, self.block_size) + 1)
        return sum(full if window is None else behind for window in self.windows)

    def _group_hash(self, block_hash: bytes, group: int) -> bytes:
        """The key of group ``group``'s copy of a block in the cache."""
        return block_hash if group == 0 else block_hash + b"/g%d" % group

    def _first_needed_block(self, num_computed: int) -> int:
        """The first logical block a sliding group still needs once
        ``num_computed`` tokens are computed: the next token, at position
        ``num_computed``, sees keys after ``num_computed - window``."""
        return max(0, num_computed - self.window + 1) // self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (including cached-free ones)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction (0..1) of blocks held by requests (``kv_cache_usage_perc``)."""
        return self.pool.usage

    def _uses_prefix_cache(self, request: Request) -> bool:
        """Whether the request may take prefix-cache hits. A request asking for
        prompt logprobs needs the logits of every prompt position, so it takes
        none until they were delivered (with its first token): resumed after
        a preemption, it scores nothing and hits like any other. Its blocks
        are registered for others in every case."""
        return self.enable_prefix_caching and (
            request.sampling_params.prompt_logprobs is None or request.num_output_tokens > 0)

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its
        known tokens (prompt + output)."""
        start = len(request.block_hashes)
        if (start + 1) * self.block_size > request.num_tokens:
            return
        parent = request.block_hashes[-1] if start else None
        end = (request.num_tokens // self.block_size) * self.block_size
        request.block_hashes.extend(hash_request_blocks(
            request.all_token_ids[:end], self.block_size, parent, start))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached full blocks that prefixes the request's
        known tokens, and its length in tokens.

        The last known token is never a hit (its logits are needed), so at
        most ``(num_tokens - 1) // block_size`` blocks are returned. Returns
        ``([], 0)`` when prefix caching is off or the request still has to
        score its prompt (prompt logprobs, see ``_uses_prefix_cache``).
        Read-only: the blocks are claimed by ``allocate_slots``.
        """
        if not self._uses_prefix_cache(request):
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.num_groups > 1:
            return self._group_hits(request.block_hashes[:max_blocks])
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _group_hits(self, hashes: Sequence[bytes]) -> tuple[list[KVCacheBlock], int]:
        """``get_computed_blocks`` with several groups: the longest prefix of
        n blocks that every full group holds whole and every sliding group
        holds from its first needed block on; the flat hit list (null
        blocks where a sliding group needs none)."""
        get, key = self.pool.get_cached_block, self._group_hash
        n = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                chain = 0
                while chain < n and get(key(hashes[chain], g)) is not None:
                    chain += 1
                n = chain
        found = {g: [get(key(h, g)) for h in hashes[:n]] for g in self._sliding_groups}
        while n > 0:
            first = self._first_needed_block(n * self.block_size) if self.window else 0
            if all(block is not None for g in self._sliding_groups for block in found[g][first:n]):
                break
            n -= 1
        first = self._first_needed_block(n * self.block_size) if self.window else 0
        hits: list[KVCacheBlock] = []
        for j in range(n):
            for g, window in enumerate(self.windows):
                if window is None:
                    hits.append(get(key(hashes[j], g)))
                else:
                    hits.append(found[g][j] if j >= first else self.null_block)
        return hits, n * self.block_size

    def set_external(self, external: ExternalKV | None) -> None:
        """Use ``external`` as the offload tier from now on (None: none);
        ignored when prefix caching is off."""
        if external is not None and self.num_groups > 1:
            raise ValueError("the KV offload tier takes single-group models only (no "
                             "sliding-window layers)")
        self.external = external if self.enable_prefix_caching else None
        self.pool.record_offload = self.external is not None

    def get_external_blocks(self, request: Request, num_hit_blocks: int) -> int:
        """How many full blocks after the request's first ``num_hit_blocks``
        (its local prefix-cache hit) the offload tier holds, within the same
        limit as ``get_computed_blocks`` (the last known token is computed).
        0 without a tier or when the request takes no hits. Read-only here;
        the scheduler counts them with ``record_external`` once admitted."""
        if self.external is None or not self._uses_prefix_cache(request):
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if num_hit_blocks >= max_blocks:
            return 0
        self.update_block_hashes(request)
        hashes = request.block_hashes[num_hit_blocks:max_blocks]
        lookup_tiers = getattr(self.external, "lookup_tiers", None)  # memory + disk
        if lookup_tiers is None:
            self._last_disk_blocks = None
            return self.external.lookup(hashes)
        in_memory, self._last_disk_blocks = lookup_tiers(hashes)
        return in_memory + self._last_disk_blocks

    def record_external(self, request: Request, num_hit_blocks: int, num_loaded: int) -> None:
        """Count an admission's tier look-up (tokens): the full blocks the
        local cache missed, and the ``num_loaded`` blocks the tier had."""
        if self.external is None or not self._uses_prefix_cache(request):
            return
        max_blocks = (request.num_tokens - 1) // self.block_size
        queried = max(0, max_blocks - num_hit_blocks) * self.block_size
        self.stats.external_queries += queried
        # the admission's look-up was the last one: its disk part
        on_disk = min(num_loaded, self._last_disk_blocks or 0) * self.block_size
        self.stats.external_hits += num_loaded * self.block_size - on_disk
        if self._last_disk_blocks is not None:
            self.stats.external_disk_queries += queried - (num_loaded * self.block_size - on_disk)
            self.stats.external_disk_hits += on_disk

    def take_stored(self) -> list[BlockTransfer]:
        """The blocks registered since the last call and still under their
        hash, to be saved in the offload tier (empty without a tier). Take
        them *before* a step's scheduling registers more: a block registered
        while a step is built is computed by that step, so it is saved by
        the next one."""
        stored, self.pool.stored = self.pool.stored, []
        blocks = self.pool.blocks
        return [BlockTransfer("", block_id, block_hash) for block_id, block_hash in stored
                if blocks[block_id].block_hash == block_hash]

    def take_evicted(self) -> list[BlockTransfer]:
        """The cached blocks evicted since the last call, to be saved in the
        offload tier before anything overwrites them (empty without a tier)."""
        evicted, self.pool.evicted = self.pool.evicted, []
        return [BlockTransfer("", block_id, block_hash) for block_id, block_hash in evicted]

    def adopt(self, owner: str, block_hashes: Sequence[bytes]) -> list[KVCacheBlock]:
        """Hold, for ``owner`` (a request id), a block per hash of a chain:
        the cached block under that hash, or else a free block registered
        under it -- one whose K/V will be written from outside (a prefill
        replica's export). Held blocks cannot be evicted until
        ``release_adopted(owner)``. Stops at the first hash it finds no free
        block for; never preempts. Returns the newly registered blocks, in
        the order of their hashes (none when caching is off). Raises
        ``ValueError`` for a cache with several groups."""
        if self.num_groups > 1:
            raise ValueError("KV transfer between replicas takes single-group models only")
        if not self.enable_prefix_caching:
            return []
        held, adopted = self.adopted.setdefault(owner, []), []
        for block_hash in block_hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is not None:
                self.pool.touch([block])
            elif self.pool.num_free_blocks == 0:
                break
            else:
                block = self.pool.get_new_blocks(1)[0]
                self.pool.cache_full_block(block, block_hash, computed=False)
                adopted.append(block)
            held.append(block)
        if not held:
            del self.adopted[owner]
        return adopted

    def release_adopted(self, owner: str) -> None:
        """Drop ``owner``'s hold on its adopted blocks (they stay cached, so
        its admission finds them as prefix-cache hits). No-op if none."""
        self.pool.free_blocks(reversed(self.adopted.pop(owner, ())))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()
                       ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        ``new_computed_blocks`` are prefix-cache hits from
        ``get_computed_blocks`` (only on a request's first allocation, i.e. at
        admission or resume); they count as computed after
        ``request.num_computed_tokens``. Returns the newly allocated blocks
        (possibly empty), or None -- with nothing changed -- when too few
        blocks are free. Records prefix-cache stats (tokens) on a request's
        first allocation. Raises ``ValueError`` if hits are passed for a
        request that already holds blocks. With sliding groups, first frees
        the blocks behind the window of ``request.num_computed_tokens``
        (``_free_skipped``), even when it then returns None.
        """
        held = self.req_to_blocks.get(request.request_id)
        if held and new_computed_blocks:
            raise ValueError("prefix-cache hits can only be added on a request's first allocation")
        groups = self.num_groups
        if held and self.window is not None:
            self._free_skipped(request.request_id, request.num_computed_tokens)
        num_hit = len(new_computed_blocks) // groups
        num_held = len(held) // groups if held else 0
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - num_held - num_hit) * groups
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return None
        if held is None:
            held = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = num_hit
            if self.window is not None:
                self.num_skipped[request.request_id] = self._first_needed_block(
                    num_hit * self.block_size) if num_hit else 0
            self._record_query(request, num_hit)
        self.pool.touch(block for block in new_computed_blocks if block is not self.null_block)
        held.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        held.extend(new_blocks)
        return new_blocks

    def _free_skipped(self, request_id: str, num_computed: int) -> None:
        """Free the request's sliding-group blocks wholly behind the window of
        its next token (at position ``num_computed``); their entries become
        the null block. The oldest are freed first, so evicted first."""
        blocks, groups = self.req_to_blocks[request_id], self.num_groups
        start = self.num_skipped.get(request_id, 0)
        first = min(self._first_needed_block(num_computed), len(blocks) // groups)
        if first <= start:
            return
        freed = []
        for j in range(start, first):
            for g in self._sliding_groups:
                block = blocks[j * groups + g]
                if block is not self.null_block:
                    freed.append(block)
                    blocks[j * groups + g] = self.null_block
        self.pool.free_blocks(freed)
        self.num_skipped[request_id] = first

    def _record_query(self, request: Request, num_hit_blocks: int) -> None:
        if not self._uses_prefix_cache(request):
            return
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_blocks * self.block_size

    def cache_computed_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Register (hash) the request's blocks that are full within its first
        ``num_tokens`` tokens (default: ``request.num_computed_tokens``; the
        scheduler passes the count computed by the end of the step it is
        building), whose token ids are known, and not registered yet."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        groups = self.num_groups
        num_full = min(num_tokens // self.block_size, len(blocks) // groups)
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(request)
        # A block whose tokens a step in flight has yet to sample has no hash
        # yet: it is registered when they come back (async scheduling).
        num_full = min(num_full, len(request.block_hashes))
        if num_full <= start:
            return
        for index in range(start, num_full):
            block_hash = request.block_hashes[index]
            for g in range(groups):
                block = blocks[index * groups + g]
                if block is self.null_block:  # freed behind the window before it was hashed
                    continue
                self.pool.cache_full_block(block, self._group_hash(block_hash, g),
                                           self._block_content(request, index) if g == 0 else None)
        self.num_cached_blocks[request.request_id] = num_full

    def _block_content(self, request: Request, index: int) -> BlockContent | None:
        if not self.track_content_hashes:
            return None
        size = self.block_size
        return BlockContent(
            content_hash=self.content_hashes(request, index + 1)[index], position=index,
            parent_hash=request.block_hashes[index - 1] if index else None,
            token_ids=tuple(request.all_token_ids[index * size:(index + 1) * size]))

    def content_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Content hashes (``block_hash.content_hash``) of at least the
        request's first ``num_blocks`` full blocks, memoized per request until
        it is freed. Raises ``ValueError`` if it has fewer full blocks."""
        if num_blocks * self.block_size > request.num_tokens:
            raise ValueError(f"request {request.request_id!r} has fewer than "
                             f"{num_blocks} full blocks")
        hashes = self.req_content_hashes.setdefault(request.request_id, [])
        size, tokens = self.block_size, request.all_token_ids
        for index in range(len(hashes), num_blocks):
            hashes.append(content_hash(tokens[index * size:(index + 1) * size]))
        return hashes

    def find_divergence(self, request: Request,
                        num_hit_blocks: int) -> PrefixCacheDivergence | None:
        """Explain a prefix-cache miss: the ``PrefixCacheDivergence`` of
        ``request`` (whose cached prefix is ``num_hit_blocks`` blocks, from
        ``get_computed_blocks``) against the cached prompts, or None. See
        ``prefix_explainer.find_divergence`` for the definitions. Read-only
        (counts nothing: the scheduler calls ``record_divergence`` for an
        event it reports); None when content hashes are not tracked or the
        request does not use the prefix cache."""
        if not (self.track_content_hashes and self._uses_prefix_cache(request)):
            return None
        self.update_block_hashes(request)
        return find_divergence(
            self.pool, request.request_id, request.prompt_token_ids, request.block_hashes,
            lambda n: self.content_hashes(request, n), num_hit_blocks, self.block_size)

    def record_divergence(self, divergence: PrefixCacheDivergence) -> None:
        """Count a reported divergence (``stats.divergences``)."""
        self.stats.divergences += 1

    def free(self, request: Request | str) -> int:
        """Release every block of a request (tail blocks first, so they are
        evicted first). Returns the number of blocks it held; a request
        holding none is a no-op returning 0."""
        request_id = request if isinstance(request, str) else request.request_id
        blocks = [block for block in self.req_to_blocks.pop(request_id, [])
                  if block is not self.null_block]
        self.num_cached_blocks.pop(request_id, None)
        self.req_content_hashes.pop(request_id, None)
        self.num_skipped.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))
        return len(blocks)

    def get_block_ids(self, request_id: str, start: int = 0, stop: int | None = None) -> list[int]:
        """The request's block table (block ids in token order; with G
        groups, flat: logical block j of group g at ``j * G + g``), or its
        slice ``[start:stop]`` of that list (O(slice), for per-step deltas);
        [] if none."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())[start:stop]]

    def num_request_blocks(self, request_id: str) -> int:
        """Length of the request's block table (0 if it holds none)."""
        return len(self.req_to_blocks.get(request_id, ()))

    def evict_hashes(self, block_ids: Iterable[int]) -> None:
        """Drop the prefix-cache hashes of these blocks (a failed step's)."""
        self.pool.evict_hashes(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes (e.g. between benchmark runs); False if some
        block is still in use."""
        return self.pool.reset_prefix_cache()

    def check_consistency(self) -> None:
        """Debug aid (O(num_blocks)): raise ``RuntimeError`` unless the ref
        counts equal the number of block-table (and adoption) entries per block, free +
        cached-free + in-use == total, the free queue holds exactly the
        ref-0 blocks, and the hash index points only at hashed blocks."""
        expected = [0] * self.pool.num_blocks
        for blocks in [*self.req_to_blocks.values(), *self.adopted.values()]:
            for block in blocks:
                if block is not self.null_block:
                    expected[block.block_id] += 1
        if self.null_block is not None:
            expected[self.null_block.block_id] = 1
        actual = [block.ref_cnt for block in self.pool.blocks]
        if expected != actual:
            raise RuntimeError(f"ref counts {actual} != block-table counts {expected}")
        free, cached_free, in_use = self.pool.count_blocks()
        if free + cached_free + in_use != self.pool.num_blocks:
            raise RuntimeError("block accounting does not add up")
        queued = list(self.pool.free_queue)
        if len(queued) != free + cached_free or any(b.ref_cnt for b in queued):
            raise RuntimeError("free queue does not hold exactly the free blocks")
        if len({id(b) for b in queued}) != len(queued):
            raise RuntimeError("a block is queued twice")
        for block_hash, block in self.pool.cached.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"hash index points at {block} with another hash")
        self._check_content_index()

    def _check_content_index(self) -> None:
        indexed = 0
        for chash, by_position in self.pool.content_index.items():
            for position, ids in by_position.items():
                for block_id in ids:
                    content = self.pool.blocks[block_id].content
                    if content is None or (content.content_hash, content.position) != (
                            chash, position):
                        raise RuntimeError(f"content index points at block {block_id} "
                                           "with other content")
                    indexed += 1
        if indexed != sum(1 for b in self.pool.blocks if b.content is not None):
            raise RuntimeError("content index does not hold exactly the blocks with content")
