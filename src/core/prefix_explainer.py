"""Cache-miss explainer: tell a prefix-cache miss caused by a *different
prefix* (a timestamp at the top of a system prompt) from a miss on new content.

The prefix cache identifies a block by its chain hash, which depends on every
token before it: change one early token and every later block misses, even
though the rest of the prompt is already cached. Each cached full block also
carries a ``BlockContent`` (position-independent content hash, block index,
parent chain hash, tokens; defined here, kept by ``kv_cache_manager``), indexed by
``(content hash, block index)`` in ``BlockPool.content_index``. With it, at a
request's first admission:

Definitions (``B`` = block size, ``P`` = prompt tokens):

- ``cap = (P - 1) // B``: the most blocks that can ever hit (the last prompt
  token is always recomputed). ``i``: the blocks that did hit (blocks
  ``0..i-1``). If ``i >= cap`` nothing was missed: no event.
- A *sibling* of the request at block ``j > i`` is a chain of resident cached
  blocks ``C_i .. C_j`` (linked by parent hashes) such that ``C_i``'s parent
  is the request's last hit block (the chain root when ``i == 0``) -- so the
  cached prompt shares the request's hit prefix and first differs inside
  block ``i`` -- and ``C_j`` holds the same tokens (content hash) as the
  request's block ``j``, at the same block index.
- ``j*``: the smallest ``j`` in ``i+1 .. P // B - 1`` with a sibling. None
  exists: no event (new content, or a change at the end of the prompt).
- The *best-matching cached prompt* is, among the siblings at ``j*``, the one
  with the largest would-hit count, then the latest first difference, then
  the most recently cached.
- ``would_hit_tokens = B * min(cap, k)``, where ``k`` is the end of the run of
  blocks ``j*, j*+1, .., k-1`` for which the sibling's chain continues with a
  resident cached block holding the request's tokens at that index: exactly
  the blocks that would have hit had the request's tokens before block ``j*``
  been the cached prompt's.
- ``position = i * B + d``, ``d`` the first index where the request's block
  ``i`` differs from ``C_i``'s tokens. ``hit_tokens = i * B``.

Shifted content (an insertion or deletion that is not a multiple of ``B``
tokens) changes every later block's content and is not reported; neither is a
shift by whole blocks (siblings must match at the same block index).

Cost and bounds: one content hash per full prompt block (memoized, and
reused when the blocks are cached), one dict look-up per block index scanned,
at most ``MAX_CANDIDATES`` siblings examined at ``j*`` and at most
``WALK_BUDGET_PER_BLOCK * P // B`` parent-link steps in all (so O(blocks) per
admission; an exhausted budget gives no event -- a missed explanation, never
a wrong one). Memory: per cached block one ``BlockContent`` (a 32-byte hash,
an int, a reference to the parent hash and a ``B``-tuple of token ids); at
most ``num_blocks`` of them -- no per-request history is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from .outputs import PrefixCacheDivergence

#: Siblings examined at ``j*`` (most recently cached first).
MAX_CANDIDATES = 4
#: Parent-link steps allowed per full prompt block, over the whole search.
WALK_BUDGET_PER_BLOCK = 4


class BlockContent(NamedTuple):
    """What the cache-miss explainer remembers about one cached full block.

    - ``content_hash``: position-independent hash of the block's tokens alone
      (``block_hash.content_hash``); equal for equal tokens after any prefix.
    - ``position``: the block's index in its request (token positions
      ``position * block_size`` onwards).
    - ``parent_hash``: chain hash of the previous block (None for block 0),
      to walk a cached prompt backwards.
    - ``token_ids``: the block's tokens, to find the first differing token.
    """

    content_hash: bytes
    position: int
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


class CachedBlock(Protocol):
    """A cached block as the explainer reads it (``kv_cache_manager.KVCacheBlock``)."""

    block_hash: bytes | None
    content: BlockContent | None


class CachedBlocks(Protocol):
    """The look-ups the explainer needs from the pool of cached blocks
    (``kv_cache_manager.BlockPool``; this module does not import it)."""

    def get_cached_block(self, block_hash: bytes) -> CachedBlock | None:
        """The block registered under ``block_hash``, or None."""
        ...

    def blocks_at(self, block_content_hash: bytes, position: int,
                  limit: int | None = None) -> list[CachedBlock]:
        """Cached blocks with this content at block index ``position``, most
        recently cached first, at most ``limit``."""
        ...

    def child_at(self, block_content_hash: bytes, position: int,
                 parent_hash: bytes) -> CachedBlock | None:
        """The cached block with this content at ``position`` whose parent
        is hashed ``parent_hash``, or None."""
        ...


def find_divergence(pool: CachedBlocks, request_id: str, prompt_token_ids: Sequence[int],
                    block_hashes: Sequence[bytes], content_hashes: Callable[[int], list[bytes]],
                    num_hit_blocks: int, block_size: int) -> PrefixCacheDivergence | None:
    """The request's ``PrefixCacheDivergence`` against the cached blocks of
    ``pool``, or None (definitions in the module doc).

    ``block_hashes`` are the chain hashes of the prompt's full blocks (at
    least the first ``num_hit_blocks``), ``content_hashes(n)`` returns at
    least the first ``n`` blocks' content hashes, ``num_hit_blocks`` is the
    length of the cached prefix the request got. Read-only.
    """
    num_full = len(prompt_token_ids) // block_size
    cap = (len(prompt_token_ids) - 1) // block_size
    i = num_hit_blocks
    if i >= cap:
        return None
    root = block_hashes[i - 1] if i else None
    budget = [WALK_BUDGET_PER_BLOCK * num_full]
    for j in range(i + 1, num_full):
        siblings = _siblings_at(pool, content_hashes(j + 1)[j], j, i, root, budget)
        if siblings:
            return _best(pool, request_id, prompt_token_ids, content_hashes, siblings, j,
                         i, cap, block_size)
        if budget[0] <= 0:
            return None
    return None


def _siblings_at(pool: CachedBlocks, chash: bytes, j: int, i: int, root: bytes | None,
                 budget: list[int]) -> list[tuple[CachedBlock, CachedBlock]]:
    """``(C_j, C_i)`` pairs of the siblings found at block index ``j``."""
    found = []
    for block in pool.blocks_at(chash, j, MAX_CANDIDATES):
        ancestor = _walk_back(pool, block, i, budget)
        if ancestor is not None and ancestor.content.parent_hash == root:
            found.append((block, ancestor))
    return found


def _walk_back(pool: CachedBlocks, block: CachedBlock, i: int,
               budget: list[int]) -> CachedBlock | None:
    """The resident ancestor of ``block`` at block index ``i``, or None (a
    link evicted, a block without content, or the step budget spent)."""
    while block.content.position > i:
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        parent = pool.get_cached_block(block.content.parent_hash)
        if parent is None or parent.content is None:
            return None
        block = parent
    return block


def _best(pool: CachedBlocks, request_id: str, tokens: Sequence[int],
          content_hashes: Callable[[int], list[bytes]],
          siblings: list[tuple[CachedBlock, CachedBlock]], j: int, i: int, cap: int,
          block_size: int) -> PrefixCacheDivergence:
    """The divergence against the best-matching sibling. Siblings are tried
    latest first difference first (then most recent); the search stops at one
    whose run reaches ``cap``, which no other can beat."""
    block_i = tokens[i * block_size:(i + 1) * block_size]
    scored = sorted(((i * block_size + _first_difference(block_i, c_i.content.token_ids), c_j)
                     for c_j, c_i in siblings), key=lambda pair: -pair[0])
    best = None
    for position, c_j in scored:
        end = min(cap, _run_end(pool, c_j, content_hashes, j, cap))
        if best is None or end * block_size > best.would_hit_tokens:
            best = PrefixCacheDivergence(request_id, position, end * block_size,
                                         i * block_size)
        if end == cap:
            break
    return best


def _run_end(pool: CachedBlocks, block: CachedBlock, content_hashes: Callable[[int], list[bytes]],
             j: int, limit: int) -> int:
    """First block index after ``j`` where the chain of ``block`` does not
    continue with a cached block holding the request's tokens (at most
    ``max(j + 1, limit)``: blocks from ``limit`` on cannot hit anyway)."""
    k = j + 1
    while k < limit:
        child = pool.child_at(content_hashes(k + 1)[k], k, block.block_hash)
        if child is None:
            break
        block, k = child, k + 1
    return k


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token of two blocks (0 if none differ,
    which only a hash collision could cause)."""
    return next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), 0)
