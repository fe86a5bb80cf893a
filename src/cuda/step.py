"""A step's inputs on the device, validated on the host and uploaded in one copy.

The runner builds each step's flat batch on the host (``BatchInputs``: input
ids, positions, slot mapping, block tables, sequence lengths, query offsets,
the rows to sample). ``pack_step`` checks all of it there, once, against the
model and cache geometry (token ids in the vocabulary, positions in the RoPE
table, slots and block ids in the cache, consistent attention metadata),
works out the attention kernels' work lists (``AttentionPlan``), and lays
every array out in one byte buffer, each at an 8-byte-aligned offset. The
backend then copies that buffer to the device in one transfer and hands the
kernels typed views into it (``StepViews``), so nothing in the forward pass
reads the device back: it was all known on the host before the step began.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvserve.model.ops import StepGeometry

#: Alignment of each array in the packed buffer (bytes).
ALIGN = 8


@dataclass(frozen=True)
class PackedStep:
    """A step's host arrays in one buffer: ``data`` (uint8[nbytes]) and, per
    array name, ``(offset, dtype, shape)``. ``num_decodes``: sequences with
    one new token; ``decode_only``: every sequence is one (a decode step)."""

    data: np.ndarray
    layout: dict[str, tuple[int, np.dtype, tuple[int, ...]]]
    num_tokens: int
    num_seqs: int
    decode_only: bool
    max_context: int
    tile_q: int

    def view(self, buffer: Any, name: str) -> Any:
        """The typed view of array ``name`` in ``buffer`` (this layout's
        bytes, on the host or the device)."""
        offset, dtype, shape = self.layout[name]
        count = int(np.prod(shape, dtype=np.int64))
        return buffer[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(c) for c in counts])`` without the loop."""
    counts = counts.astype(np.int64)
    starts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)


def check_attention_metadata(block_tables: np.ndarray, seq_lens: np.ndarray,
                             query_start_loc: np.ndarray, num_tokens: int, num_blocks: int,
                             block_size: int, window: int = 0) -> None:
    """Host checks of paged-attention metadata (as ``kvserve.cpu``'s kernel does).

    ``window`` > 0 (sliding-window attention): the blocks wholly before the
    window of a sequence's first new token are never read, so their ids are
    not checked (the KV manager may have freed them).

    Raises ValueError: query_start_loc decreasing or outside [0, T], a
    sequence with fewer context than new tokens, a block table too narrow, or
    a used block id outside [0, num_blocks).  Sequences without new tokens
    are not checked.
    """
    qsl, sl = query_start_loc.astype(np.int64), seq_lens.astype(np.int64)
    n_new = np.diff(qsl)
    if qsl[0] < 0 or (n_new < 0).any() or qsl[-1] > num_tokens:
        raise ValueError("paged_attention: query_start_loc must be non-decreasing "
                         f"within [0, T={num_tokens}]")
    active = n_new > 0
    if (sl[active] < n_new[active]).any():
        raise ValueError("paged_attention: seq_lens[s] smaller than the sequence's new tokens")
    needed = np.where(active, -(-sl // block_size), 0)
    if (needed > block_tables.shape[1]).any():
        raise ValueError("paged_attention: block_tables too narrow for seq_lens")
    first = np.zeros_like(needed)
    if window > 0:  # the first new token, at sl - n_new, sees keys from sl - n_new + 1 - window
        first = np.maximum(sl - n_new + 1 - window, 0) // block_size
    columns = np.arange(block_tables.shape[1])[None, :]
    used = block_tables[(columns < needed[:, None]) & (columns >= first[:, None])]
    if used.size and (used.min() < 0 or used.max() >= num_blocks):
        raise ValueError(f"paged_attention: block id out of range [0, {num_blocks})")


def attention_plan(seq_lens: np.ndarray, query_start_loc: np.ndarray, prefill_min_queries: int,
                   tile_q: int) -> dict[str, np.ndarray]:
    """The paged-attention work lists of checked metadata
    (``check_attention_metadata``), int32 arrays by name.

    Decode work items (one per new token of a sequence with fewer than
    ``prefill_min_queries`` new tokens): ``tokens`` (flat index),
    ``token_seq``, ``token_ctx`` (its own position + 1). Prefill tiles (up
    to ``tile_q`` consecutive new tokens of a longer sequence): ``tile_seq``,
    ``tile_t0`` (first flat token), ``tile_nq`` (queries), ``tile_pos0``
    (position of the first).
    """
    qsl, sl = query_start_loc.astype(np.int64), seq_lens.astype(np.int64)
    n_new = np.diff(qsl)
    decode = np.flatnonzero((n_new > 0) & (n_new < prefill_min_queries))
    counts = n_new[decode]
    within = _ranges(counts)
    prefill = np.flatnonzero((n_new > 0) & (n_new >= prefill_min_queries))
    n_tiles = -(-n_new[prefill] // tile_q)
    tile_seq = np.repeat(prefill, n_tiles)
    tile_start = _ranges(n_tiles) * tile_q  # first query of the tile within its chunk
    i32 = np.int32
    return {
        "tokens": (np.repeat(qsl[decode], counts) + within).astype(i32),
        "token_seq": np.repeat(decode, counts).astype(i32),
        "token_ctx": (np.repeat(sl[decode] - counts, counts) + within + 1).astype(i32),
        "tile_seq": tile_seq.astype(i32),
        "tile_t0": (qsl[tile_seq] + tile_start).astype(i32),
        "tile_nq": np.minimum(tile_q, n_new[tile_seq] - tile_start).astype(i32),
        "tile_pos0": (sl[tile_seq] - n_new[tile_seq] + tile_start).astype(i32),
    }


def check_step(input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
               block_tables: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray,
               logits_indices: np.ndarray, geometry: StepGeometry) -> None:
    """Every index of a step in range, and its attention metadata consistent
    (``check_attention_metadata``).

    Raises ``ValueError`` naming the array: a token id outside [0, vocab),
    a position outside [0, max_position), a logits row outside [0, T), a
    slot at or beyond ``num_blocks * block_size``, sequence counts that
    disagree, or what ``check_attention_metadata`` refuses.
    """
    T = input_ids.shape[0]
    for name, a, high in (("input_ids", input_ids, geometry.vocab_size),
                          ("positions", positions, geometry.max_position),
                          ("logits_indices", logits_indices, T)):
        if a.size and (int(a.min()) < 0 or int(a.max()) >= high):
            raise ValueError(f"step: {name} out of range [0, {high})")
    if slot_mapping.size and int(slot_mapping.max()) >= geometry.num_blocks * geometry.block_size:
        raise ValueError(f"step: slot_mapping beyond the cache ({geometry.num_blocks} blocks of "
                         f"{geometry.block_size})")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1 \
            or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError("step: seq_lens, query_start_loc and block_tables disagree on the "
                         "number of sequences")
    if seq_lens.size:
        check_attention_metadata(block_tables, seq_lens, query_start_loc, T,
                                 geometry.num_blocks, geometry.block_size)


def pack_step(arrays: dict[str, np.ndarray], num_tokens: int, num_seqs: int,
              decode_only: bool, max_context: int, tile_q: int) -> PackedStep:
    """Lay ``arrays`` (name -> host array) out in one uint8 buffer, each at
    an ``ALIGN``-byte offset, C order, its own dtype."""
    layout: dict[str, tuple[int, np.dtype, tuple[int, ...]]] = {}
    offset = 0
    for name, a in arrays.items():
        layout[name] = (offset, a.dtype, tuple(a.shape))
        offset += -(-a.nbytes // ALIGN) * ALIGN
    data = np.zeros(max(offset, ALIGN), dtype=np.uint8)
    for name, a in arrays.items():
        start = layout[name][0]
        data[start:start + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    return PackedStep(data, layout, num_tokens, num_seqs, decode_only, max_context, tile_q)


def group_name(name: str, group: int) -> str:
    """The packed name of KV-cache group ``group``'s (>= 1) ``slot_mapping``
    or ``block_tables`` (group 0's keep the plain names)."""
    return f"{name}_g{group}"


@dataclass(frozen=True)
class StepViews:
    """A step's arrays on the device: typed views into its one uploaded
    buffer (``buffer``), and the facts the kernels' launches need.

    ``input_ids``, ``positions``, ``slot_mapping`` int64[T]; ``block_tables``
    int32[S, max_blocks]; ``seq_lens`` int32[S]; ``query_start_loc``
    int32[S + 1]; ``logits_indices`` int64[R]; the ``attention_plan`` lists
    (int32). ``decode_only``: every sequence has one new token.
    ``group_tables``: ``(slot_mapping, block_tables)`` of KV-cache groups
    1 .. G-1 (``BatchInputs.group_tables``' layout; empty with one group).
    """

    buffer: Any
    packed: PackedStep
    arrays: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        arrays = self.__dict__.get("arrays", {})
        if name in arrays:
            return arrays[name]
        raise AttributeError(name)

    @property
    def decode_only(self) -> bool:
        return self.packed.decode_only

    @property
    def max_context(self) -> int:
        return self.packed.max_context

    @property
    def tile_q(self) -> int:
        return self.packed.tile_q

    @property
    def num_decodes(self) -> int:
        return int(self.packed.layout["tokens"][2][0])

    @property
    def num_tiles(self) -> int:
        return int(self.packed.layout["tile_seq"][2][0])

    @property
    def group_tables(self) -> tuple[tuple[Any, Any], ...]:
        """``(slot_mapping, block_tables)`` views of KV-cache groups 1 .. G-1."""
        tables, g = [], 1
        while group_name("slot_mapping", g) in self.arrays:
            tables.append((self.arrays[group_name("slot_mapping", g)],
                           self.arrays[group_name("block_tables", g)]))
            g += 1
        return tuple(tables)

    def owns(self, array: Any, pointer) -> bool:
        """Whether ``array`` lies inside this step's buffer (``pointer(a)``
        gives an array's start address): its indices were checked on the host."""
        start, size = pointer(self.buffer), self.buffer.nbytes
        address = pointer(array)
        return start <= address and address + array.nbytes <= start + size
