"""The runner's persistent input batch: each live request's token ids and block
table in preallocated arrays, updated by per-step deltas.

The scheduler sends a request's prompt (and earlier outputs, after a
preemption) and whole block table once, when it is new; afterwards each step
carries only the blocks appended since (``ScheduledRequest.new_block_ids``),
and the runner appends the tokens it samples itself. So a step's input ids,
positions, block tables and slot mapping are gathered from these arrays with
a few vectorized index operations, instead of being rebuilt from Python
tuples resent every step (vLLM V1's ``InputBatch`` / ``CachedRequestState``).

Rows are reused as requests come and go; the arrays double when a request
needs more rows, tokens or blocks than they hold.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from kvserve.core.outputs import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class BatchInputs:
    """The flat batch of one step, as NumPy arrays (host side).

    T tokens of S sequences, R of which sample: ``input_ids`` int64[T],
    ``positions`` int64[T], ``slot_mapping`` int64[T], ``block_tables``
    int32[S, max_blocks], ``seq_lens`` int32[S], ``query_start_loc``
    int32[S + 1], ``logits_indices`` int64[R] (the last token of each
    sampling sequence), ``sample_ids`` the request id of each sampled row.

    With several KV-cache groups (``kvserve.core.kv_layout``),
    ``slot_mapping`` and ``block_tables`` are group 0's and
    ``group_tables`` holds ``(slot_mapping, block_tables)`` of groups 1 ..
    G-1, same shapes; empty with one group.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray
    sample_ids: tuple[str, ...]
    group_tables: tuple[tuple[np.ndarray, np.ndarray], ...] = ()


def _grown(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    """``array`` with ``axis`` at least ``size`` long (doubling), zero-filled."""
    if array.shape[axis] >= size:
        return array
    shape = list(array.shape)
    shape[axis] = max(size, 2 * array.shape[axis])
    bigger = np.zeros(shape, dtype=array.dtype)
    bigger[tuple(slice(0, n) for n in array.shape)] = array
    return bigger


class InputBatch:
    """Token ids and block tables of the live requests, one row each.

    Args:
        block_size: tokens per KV block.
        rows, tokens, blocks: initial capacity (they grow on demand).
        num_groups: KV-cache groups G: a request's table is the scheduler's
            flat one, logical block j of group g at entry ``j * G + g``.

    Raises ``KeyError`` for an operation on an unknown request id and
    ``ValueError`` when a request id is added twice.
    """

    def __init__(self, block_size: int, rows: int = 8, tokens: int = 256, blocks: int = 16,
                 num_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.token_ids = np.zeros((rows, tokens), dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.block_table = np.zeros((rows, blocks), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(rows))[::-1]

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.row_of

    def add(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """A new (or resumed) request: its known tokens and whole block table."""
        if request_id in self.row_of:
            raise ValueError(f"request {request_id!r} is already in the input batch")
        if not self._free_rows:
            old = len(self.num_tokens)
            self._grow_rows(2 * old)
            self._free_rows = list(range(old, len(self.num_tokens)))[::-1]
        row = self._free_rows.pop()
        self.row_of[request_id] = row
        self.num_tokens[row] = 0
        self.num_blocks[row] = 0
        self.append_tokens(request_id, token_ids)
        self.append_blocks(request_id, block_ids)

    def apply(self, scheduler_output: SchedulerOutput, skip: Collection[str] = ()) -> None:
        """Apply one step's deltas: drop finished (and preempted) requests,
        add new and resumed ones (prompt + earlier outputs, whole table),
        append the blocks the others got. Chunks of the ``skip`` ids (requests
        of a failed step) are ignored."""
        for request_id in scheduler_output.finished_request_ids:
            self.remove(request_id)
        new = {n.request_id: n for n in scheduler_output.new_requests}
        for chunk in scheduler_output.scheduled:
            if chunk.request_id in skip:
                continue
            data = new.get(chunk.request_id)
            if data is None:
                self.append_blocks(chunk.request_id, chunk.new_block_ids)
                continue
            self.remove(chunk.request_id)
            self.add(chunk.request_id, data.prompt_token_ids + data.output_token_ids,
                     chunk.new_block_ids)

    def remove(self, request_id: str) -> None:
        """Forget a finished or preempted request (unknown ids are ignored)."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Tokens that follow the request's known ones (a sampled token)."""
        row = self.row_of[request_id]
        start = int(self.num_tokens[row])
        self.token_ids = _grown(self.token_ids, 1, start + len(token_ids))
        self.token_ids[row, start:start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    def num_tokens_of(self, request_id: str) -> int:
        """How many tokens the request's row holds."""
        return int(self.num_tokens[self.row_of[request_id]])

    def truncate_tokens(self, request_id: str, num_tokens: int) -> None:
        """Forget the request's last ``num_tokens`` tokens (draft tokens
        appended only to build a step)."""
        row = self.row_of[request_id]
        self.num_tokens[row] -= num_tokens

    def append_blocks(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Blocks appended to the request's table since it was last scheduled."""
        if not len(block_ids):
            return
        row = self.row_of[request_id]
        start = int(self.num_blocks[row])
        self.block_table = _grown(self.block_table, 1, start + len(block_ids))
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def _grow_rows(self, rows: int) -> None:
        self.token_ids = _grown(self.token_ids, 0, rows)
        self.num_tokens = _grown(self.num_tokens, 0, rows)
        self.block_table = _grown(self.block_table, 0, rows)
        self.num_blocks = _grown(self.num_blocks, 0, rows)

    def build(self, scheduled: Sequence[ScheduledRequest]) -> BatchInputs:
        """The flat batch of the scheduled chunks, in their order.

        Token j of a chunk starting at position p sits at position p + j; its
        K/V slot is ``block_table[(p + j) // block_size] * block_size +
        (p + j) % block_size`` (the PagedAttention slot mapping, Kwon et al.
        2023), in each group's table. Raises ``ValueError`` when a chunk
        reaches past the request's known tokens or blocks (the deltas and
        the scheduler disagree).
        """
        rows = np.array([self.row_of[c.request_id] for c in scheduled], dtype=np.int64)
        lengths = np.array([c.num_tokens for c in scheduled], dtype=np.int64)
        starts = np.array([c.start_position for c in scheduled], dtype=np.int64)
        ends = starts + lengths
        bs, groups = self.block_size, self.num_groups
        if (ends > self.num_tokens[rows]).any() or \
                (-(-ends // bs) * groups > self.num_blocks[rows]).any():
            raise ValueError("input batch: a scheduled chunk reaches past its request's "
                             "known tokens or blocks")
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start_loc[1:])
        seq_index = np.repeat(np.arange(len(scheduled)), lengths)
        positions = (np.arange(int(query_start_loc[-1]), dtype=np.int64)
                     - np.repeat(query_start_loc[:-1].astype(np.int64) - starts, lengths))
        max_blocks = int(self.num_blocks[rows].max())
        tables = self.block_table[rows, :max_blocks]
        if groups > 1:
            tables = [np.ascontiguousarray(tables[:, g::groups]) for g in range(groups)]
        else:
            tables = [tables]
        block_index, offset = positions // bs, positions % bs
        slots = [table[seq_index, block_index].astype(np.int64) * bs + offset for table in tables]
        slot_mapping, block_tables = slots[0], tables[0]
        sampled = [s for s, c in enumerate(scheduled) if c.sample]
        return BatchInputs(
            input_ids=self.token_ids[rows[seq_index], positions],
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=ends.astype(np.int32),
            query_start_loc=query_start_loc,
            logits_indices=query_start_loc[1:][sampled].astype(np.int64) - 1,
            sample_ids=tuple(scheduled[s].request_id for s in sampled),
            group_tables=tuple(zip(slots[1:], tables[1:])),
        )
