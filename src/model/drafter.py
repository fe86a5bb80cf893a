"""Draft-model speculative decoding, the worker's side: a smaller model of
the same tokenizer proposes each speculating request's next drafts.

The draft model has its own paged KV cache with the target's geometry (same
number of blocks, same block size) and shares the target's block tables, as
vLLM's draft models and EAGLE heads do: position p of a request has its
draft K/V in the same slot as its target K/V, so the block manager, the
prefix cache and preemption need nothing new. The scheduler allocates
``ScheduledRequest.num_lookahead_tokens`` slots past a proposing request's
chunk for the positions the draft writes ahead of the target.

After the target's step has been verified, ``DraftProposer.propose`` runs
for the requests that asked for drafts:

1. one forward pass of the draft over each such request's known tokens it
   has not computed yet (its catch-up: the tokens since its last proposal
   -- the accepted drafts and the token the target just emitted -- or, the
   first time, the whole prompt, at most ``max_catch_up`` tokens a step).
   The last row gives draft 1;
2. ``L - 1`` single-token passes, draft j + 1 from draft j.

The draft's K/V thus covers exactly a request's verified tokens, written
lazily: a request that does not speculate (penalties, the off switch,
``disable_by_batch_size``) costs the draft nothing. Prefix-cache hits are
recomputed by the draft for itself (a cached block's draft K/V may never
have been written); it writes the same values into the shared block.
Rejected drafts' K/V lies past the verified tokens and is overwritten by
the next catch-up.

Greedy and seeded requests take the draft's argmax (verified by
``spec_decode.verify_drafts``); other sampled requests draw from the
draft's warped distribution q with the proposer's own generator, and q is
kept for ``spec_decode.verify_rejection``. Output correctness never depends
on the draft: the target verifies every token.

Runs on the worker thread; no asyncio.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.config import ModelConfig, SpeculativeConfig
from kvserve.core.outputs import ScheduledRequest
from kvserve.model import sampling_kernels as kernels
from kvserve.model.input_batch import InputBatch
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_checkpoint_weights, load_model_config
from kvserve.model.ops import Ops
from kvserve.model.sampler import SamplingState, _warpers
from kvserve.model.spec_verify import draw_from
from kvserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Proposal:
    """One request's drafts: ``token_ids`` and, for drafts drawn at random,
    ``probs`` float64[L, V] (row i: the distribution draft i was drawn
    from); None for argmax drafts."""

    token_ids: tuple[int, ...]
    probs: np.ndarray | None


def load_draft_model(spec: SpeculativeConfig, target: ModelConfig, target_tokenizer: Tokenizer,
                     ops: Ops) -> LlamaModel:
    """The draft checkpoint of ``spec.model``, on the target's backend with
    ``spec.quantization`` weights.

    Raises:
        ValueError: when the draft's tokenizer differs from the target's
            (drafts are token ids: the vocabularies must be the same).
        FileNotFoundError: when the folder lacks config.json, weights or
            tokenizer.json.
    """
    path = Path(spec.model or "")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the draft model folder {path} has no config.json "
                                "(speculative config 'model')")
    config = load_model_config(path)
    if config.vocab_size != target.vocab_size or _vocab(path) != target_tokenizer.vocab():
        raise ValueError(f"the draft model {path} has another tokenizer than the served model "
                         f"(vocab sizes {config.vocab_size} and {target.vocab_size}); "
                         "speculation needs the same token ids")
    weights = load_checkpoint_weights(path, config, spec.quantization)
    return LlamaModel(config, weights, ops, spec.quantization)


def _vocab(path: Path) -> dict[str, int]:
    """Token string -> id of the checkpoint's tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer
    return HFTokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True)


class DraftProposer:
    """The draft model, its KV cache and the proposals not yet verified.

    Args:
        model: the loaded draft ``LlamaModel``.
        ops: the backend (the target's).
        num_blocks: KV blocks per layer (the target's).
        block_size: tokens per block (the target's).
        seed: seed of the generator that draws sampled drafts.
        max_catch_up: the most tokens of one request a catch-up pass
            computes (tokens); a longer backlog (a long prompt) is caught
            up over several steps, proposing nothing until done.
    """

    def __init__(self, model: LlamaModel, ops: Ops, num_blocks: int, block_size: int,
                 seed: int = 0, max_catch_up: int = 2048, kv_cache_dtype: str = "auto") -> None:
        config = model.config
        self.model = model
        self.ops = ops
        self.kv_caches = [ops.allocate_kv_cache(num_blocks, block_size,
                                                config.num_key_value_heads, config.head_dim,
                                                kv_cache_dtype=kv_cache_dtype)
                          for _ in range(config.num_hidden_layers)]
        self._generator = np.random.default_rng([seed, 1])
        self.max_catch_up = max_catch_up
        self._proposals: dict[str, Proposal] = {}
        #: request id -> its tokens whose draft K/V is written (a prefix).
        self._computed: dict[str, int] = {}

    def take(self, request_id: str) -> Proposal | None:
        """The request's last proposal, forgotten (its verification uses it once)."""
        return self._proposals.pop(request_id, None)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the state of finished, preempted or failed requests."""
        for request_id in request_ids:
            self._proposals.pop(request_id, None)
            self._computed.pop(request_id, None)

    def propose(self, input_batch: InputBatch, scheduled: Sequence[ScheduledRequest],
                emitted: Mapping[str, Sequence[int]],
                states: Mapping[str, SamplingState]) -> dict[str, list[int]]:
        """Run the draft over a verified step and propose the next drafts.

        Args:
            input_batch: the runner's batch, already holding the tokens the
                step emitted (``emitted``); left as it was.
            scheduled: the step's chunks that ran (as the scheduler sent them).
            emitted: request id -> the tokens the step emitted for it.
            states: the requests' sampling states.

        Returns:
            request id -> ``num_lookahead_tokens`` draft token ids, for the
            chunks that sampled and asked for drafts (none for a request
            still catching up).
        """
        chunks, want = [], {}
        for chunk in scheduled:
            rid = chunk.request_id
            self._proposals.pop(rid, None)
            if chunk.is_new:  # (re)started: the draft K/V of its tokens is not known
                self._computed[rid] = 0
            if not (chunk.num_lookahead_tokens and emitted.get(rid)):
                continue
            start, end = self._computed.get(rid, 0), input_batch.num_tokens_of(rid)
            done = end - start <= self.max_catch_up
            stop = end if done else start + self.max_catch_up
            chunks.append(ScheduledRequest(rid, stop - start, start, (), sample=done,
                                           is_new=False))
            self._computed[rid] = stop
            if done:
                want[rid] = chunk.num_lookahead_tokens
        if not chunks:
            return {}
        drafts: dict[str, list[int]] = {rid: [] for rid in want}
        probs: dict[str, list[np.ndarray]] = {rid: [] for rid in want}
        appended: dict[str, int] = dict.fromkeys(want, 0)
        try:
            self._run(input_batch, chunks, want, states, drafts, probs, appended)
        finally:
            for rid, count in appended.items():
                input_batch.truncate_tokens(rid, count)
        for rid, tokens in drafts.items():
            self._proposals[rid] = Proposal(tuple(tokens),
                                            np.stack(probs[rid]) if probs[rid] else None)
        return drafts

    def _run(self, input_batch: InputBatch, chunks: list[ScheduledRequest],
             want: dict[str, int], states: Mapping[str, SamplingState],
             drafts: dict[str, list[int]], probs: dict[str, list[np.ndarray]],
             appended: dict[str, int]) -> None:
        """The catch-up pass, then one pass per further draft; each draft but
        the last is appended to ``input_batch`` and counted in ``appended``
        (the caller truncates them)."""
        while True:
            batch = input_batch.build(chunks)
            if not batch.sample_ids:
                self.model.batch_hidden_states(batch, self.kv_caches)
                return
            logits = np.asarray(self.ops.to_numpy(self.model.compute_logits(
                self.model.batch_hidden_states(batch, self.kv_caches))), dtype=np.float32)
            for rid, (token, q) in zip(batch.sample_ids,
                                       self._choose(logits, [states[r] for r in batch.sample_ids])):
                drafts[rid].append(token)
                if q is not None:
                    probs[rid].append(q)
            active = [rid for rid in batch.sample_ids if len(drafts[rid]) < want[rid]]
            if not active:
                return
            chunks = []
            for rid in active:
                input_batch.append_tokens(rid, [drafts[rid][-1]])
                appended[rid] += 1
                position = input_batch.num_tokens_of(rid) - 1
                chunks.append(ScheduledRequest(rid, 1, position, (), sample=True, is_new=False))

    def _choose(self, logits: np.ndarray, states: Sequence[SamplingState]
                ) -> list[tuple[int, np.ndarray | None]]:
        """A draft token per row of float32[R, V] draft logits: the argmax for
        greedy and seeded requests, else a draw from the warped distribution
        (returned with it)."""
        out: list[tuple[int, np.ndarray | None]] = [
            (int(token), None) for token in logits.argmax(axis=1)]
        random_rows = [i for i, state in enumerate(states)
                       if state.params.temperature > 0.0 and state.params.seed is None]
        if random_rows:
            rows = logits[random_rows]
            q = kernels.warped_probs(rows, _warpers([states[i].params for i in random_rows],
                                                    rows.shape[1]))
            u = self._generator.random(len(random_rows))
            for j, i in enumerate(random_rows):
                out[i] = (draw_from(q[j], u[j]), q[j])
        return out
