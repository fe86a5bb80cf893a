"""Token masks of constrained requests, batch by batch (on the worker thread).

One llguidance ``LLMatcher`` per constrained request follows its output
tokens. Each step the runner asks for the masks of the rows it will sample
(``fill``, run on a helper thread while the forward pass computes: llguidance
releases the GIL), applies them to those rows' logits only (``apply``:
disallowed tokens get -inf, so unconstrained rows cost nothing), and feeds
each sampled token back (``accept``). A mask is a bitmask, int32[W] with
W = ceil(vocab / 32), bit ``t % 32`` of word ``t // 32`` set when token t
is allowed (llguidance's layout, as in xgrammar and vLLM).

llguidance, its executor and the mask thread come with the first
constrained request, not with this module or a ``StructuredOutputs``, which
every engine builds (``tests/test_serving_imports.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import structlog

from kvserve.constraints.grammar import load_tokenizer, to_grammar
from kvserve.core.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

log = structlog.get_logger("kvserve.structured")


class StructuredOutputs:
    """The matchers of the constrained requests a runner holds.

    Args:
        tokenizer_json: the checkpoint's ``tokenizer.json``.
        vocab_size: rows of the LM head (the logits' width), >= the tokenizer's.
        eos_token_ids: the tokens that end a sequence; allowed once the
            grammar accepts.

    The matchers are copies of the compiled constraints the requests carry;
    llguidance's tokenizer is loaded (``grammar.load_tokenizer``, which
    raises ``ValueError`` when it cannot read the file) only to compile a
    constraint that was not compiled (a runner driven directly).
    """

    def __init__(self, tokenizer_json: Path, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_args = (tokenizer_json, vocab_size, tuple(eos_token_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.vocab_size = vocab_size
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None  # made by the first fill
        self._pool: ThreadPoolExecutor | None = None

    def add(self, request_id: str, params: StructuredOutputsParams,
            output_token_ids: Sequence[int] = ()) -> None:
        """Start following ``request_id`` (again, after a preemption: the
        tokens it already generated are replayed into the new matcher).

        The matcher is a copy of ``params.compiled`` (the engine compiles
        every constraint before it is scheduled, ``kvserve.constraints.
        compiler``: ~20 us here); a constraint that was not compiled (a
        runner driven directly) is compiled here, unbounded."""
        if params.compiled is not None:
            matcher = params.compiled.new_matcher()
        else:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(*self._tokenizer_args)
            from llguidance import LLMatcher

            matcher = LLMatcher(self._tokenizer, to_grammar(params), log_level=0)
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            log.warning("structured_replay_failed", request_id=request_id,
                        error=matcher.get_error())
        self.matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        """Forget a finished (or failed) request."""
        self.matchers.pop(request_id, None)

    def rows(self, sample_ids: Sequence[str]) -> list[tuple[int, str]]:
        """``(row, request id)`` of the constrained requests among ``sample_ids``."""
        return [(row, rid) for row, rid in enumerate(sample_ids) if rid in self.matchers]

    def fill(self, rows: Sequence[tuple[int, str]]) -> Future[np.ndarray]:
        """Start computing the masks of ``rows``: a future of int32[len(rows), W]."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-masks")
        return self._pool.submit(self._fill, [rid for _, rid in rows])

    def _fill(self, request_ids: list[str]) -> np.ndarray:
        import llguidance
        import llguidance.numpy as llg_np

        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=1)
        bitmask = llg_np.allocate_token_bitmask(len(request_ids), self.vocab_size)
        llg_np.fill_next_token_bitmask_par(
            self._executor, [(self.matchers[rid], i) for i, rid in enumerate(request_ids)],
            bitmask)
        return bitmask

    def apply(self, logits, rows: Sequence[tuple[int, str]], bitmask: np.ndarray, xp=np) -> None:
        """Set the disallowed tokens of ``rows`` of float32[R, V] ``logits``
        (a NumPy or CuPy array, ``xp`` its module) to -inf, in place. A row
        whose mask allows nothing (a matcher in error) is left unmasked
        rather than turned into NaNs."""
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        allowed = allowed[:, :logits.shape[1]].astype(bool)
        usable = allowed.any(axis=1)
        for (_, rid), ok in zip(rows, usable):
            if not ok:
                log.warning("structured_mask_empty", request_id=rid,
                            error=self.matchers[rid].get_error())
        index = np.array([row for (row, _), ok in zip(rows, usable) if ok], dtype=np.int64)
        if index.size:
            mask = xp.asarray(allowed[usable])
            index = xp.asarray(index)
            logits[index] = xp.where(mask, logits[index], xp.float32(-np.inf))

    def accept(self, request_id: str, token_id: int) -> None:
        """Advance ``request_id``'s matcher by its sampled token."""
        matcher = self.matchers.get(request_id)
        if matcher is not None and not matcher.consume_token(token_id):
            log.warning("structured_token_rejected", request_id=request_id, token_id=token_id,
                        error=matcher.get_error())

    def close(self) -> None:
        """Stop the helper thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
