"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It keeps a per-request state between steps: the sampling state and, in the
persistent ``InputBatch``, the token ids and block table. Both are created
when the scheduler marks a request ``is_new`` (first scheduling or resumption
after preemption), grown by each step's deltas (new blocks; the tokens the
runner samples) and dropped when the scheduler lists the request as
finished. From them it gathers the flat batch: input ids, positions, slot
mapping, block tables, sequence lengths, query start offsets and the rows to
sample (vLLM's "attention metadata").

Runs on the worker thread; nothing here touches asyncio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from kvserve.config import ModelConfig
from kvserve.constraints.masks import StructuredOutputs
from kvserve.core.kv_layout import model_kv_layout
from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.kv_offload.host_tier import BlockLost
from kvserve.kv_offload.kv_connector import KVConnector, TransferResult
from kvserve.model.drafter import DraftProposer
from kvserve.model.input_batch import BatchInputs, InputBatch
from kvserve.model.llama import AttentionMetadata, LlamaModel
from kvserve.model.ops import Ops
from kvserve.model.sampler import Device, LogprobEntry, SamplingState, prompt_logprobs, sample
from kvserve.model.spec_verify import verify_drafts, verify_rejection


#: Prompt-logprob rows scored per LM-head call (bounds the [rows, vocab] block).
PROMPT_LOGITS_ROWS = 256


class KVCacheLost(RuntimeError):
    """The K/V that the scheduler's blocks describe are gone (a pipeline
    stage's process died and Ray restarted it empty): the step fails, and
    the scheduler must forget every cached block (``StepResult.kv_lost``)."""


class KVLoadLost(RuntimeError):
    """A KV block the step was to load from an offload tier is gone or bad
    (``kvserve.kv_offload.host_tier.BlockLost``): the step computes
    nothing, and the scheduler restarts its requests from their prompts
    (``StepResult.kv_load_lost``) instead of failing them."""


@dataclass
class ModelRunnerOutput:
    """Sampled tokens of one step.

    ``sampled`` maps request id -> new token ids (empty list or absent for
    requests that only advanced a prefill chunk); ``logprobs`` maps request id
    -> one entry per new token for requests that asked; ``prompt_logprobs``
    maps request id -> one entry per prompt token (None for the first), sent
    once, in the step that samples the request's first token (chunked prefill
    gathers them over several steps); ``draft_token_ids`` maps request id ->
    the draft model's proposal for its next step (``num_lookahead_tokens``);
    ``prepare_seconds`` (request states and batch building),
    ``forward_seconds`` and ``sample_seconds`` are wall-clock seconds of the
    three phases, ``draft_seconds`` of the draft model's passes.
    """

    sampled: dict[str, list[int]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[LogprobEntry | None]] = field(default_factory=dict)
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    draft_seconds: float = 0.0
    #: The step's KV transfers (``kvserve.kv_offload.kv_connector``), or None.
    kv_transfer: TransferResult | None = None
    #: Pipeline parallelism: each stage's forward seconds in its process.
    stage_seconds: tuple[float, ...] = ()
    #: The KV cache was found lost (a restarted stage) when the step began;
    #: the step itself read none of it. The scheduler forgets cached blocks.
    kv_lost: bool = False


@dataclass
class _Step:
    """A step between ``ModelRunner._prepare`` and ``_complete``: its
    requests, flat batch, logits rows (``num_logits`` sampled and draft
    rows first, then prompt-logprob rows), constraint rows and masks (being
    filled), speculation and prompt-logprob rows, KV transfers, start time."""

    scheduled: list[ScheduledRequest]
    batch: BatchInputs
    num_logits: int
    constrained: list
    masks: object
    spec_rows: dict
    prompt_rows: list
    transfer: TransferResult | None
    t_start: float


class ModelRunner:
    """Owns the model, the KV cache buffers and the per-request sampling state.

    Args:
        model_config: architecture.
        model: the loaded ``LlamaModel``.
        ops: the backend.
        num_blocks: KV blocks per buffer.
        block_size: tokens per block.
        logprobs_mode: see ``EngineConfig.logprobs_mode``.
        seed: seed of the generator shared by unseeded requests.
        structured: the matchers of requests with ``structured_outputs``
            (None: such requests run unconstrained; the engine always gives one).
        kv_connector: copies the steps' KV transfers (offload tier, exports,
            imports) before their forward passes; None when there are none.
        drafter: the draft model of ``draft_model`` speculation, run after
            each step's sampling; None without one.
    """

    def __init__(self, model_config: ModelConfig, model: LlamaModel, ops: Ops,
                 num_blocks: int, block_size: int,
                 logprobs_mode: str = "processed_logprobs", seed: int = 0,
                 structured: StructuredOutputs | None = None,
                 kv_connector: KVConnector | None = None,
                 drafter: DraftProposer | None = None, kv_cache_dtype: str = "auto") -> None:
        self.config = model_config
        self.model = model
        self.ops = ops
        self.block_size = block_size
        self.logprobs_mode = logprobs_mode
        #: The KV-cache groups: one buffer per layer of a group, each shared
        #: by one layer of every group (``kvserve.core.kv_layout``).
        self.kv_layout = model_kv_layout(model_config)
        #: Per layer, its buffer (the same object for the layers of a slot).
        self.kv_caches = self._allocate_kv_caches(num_blocks, block_size, kv_cache_dtype)
        self.states: dict[str, SamplingState] = {}
        self.input_batch = InputBatch(block_size, num_groups=self.kv_layout.num_groups)
        self.xp = ops.xp  # the array module of the backend's arrays
        #: Where sampling runs: the backend's counted copies when it has them.
        self.device = Device.of(ops if hasattr(ops, "upload") else self.xp)
        self._generator = np.random.default_rng(seed)
        self.structured = structured
        self.kv_connector = kv_connector
        self.drafter = drafter
        #: The backend's decode CUDA graphs (``kvserve.cuda.graphs``), or None.
        self.graphs = None
        #: Requests of a failed step: the step scheduled behind it (async
        #: scheduling) may still hold them; they are skipped until the
        #: scheduler reports them finished.
        self._failed: set[str] = set()

    def _allocate_kv_caches(self, num_blocks: int, block_size: int, kv_cache_dtype: str) -> list:
        """One KV buffer per layer (the layers of a KV-cache group slot share one)."""
        cfg = self.config
        buffers = [self.ops.allocate_kv_cache(num_blocks, block_size, cfg.num_key_value_heads,
                                              cfg.head_dim, kv_cache_dtype=kv_cache_dtype)
                   for _ in range(self.kv_layout.group_size)]
        return [buffers[slot] for slot in self.kv_layout.layer_slot]

    def stages_down(self) -> list[int]:
        """Pipeline stages that do not answer now (none in one process: a
        ``PipelineRunner``'s restarting stages); the engine's ``/health``
        reads it."""
        return []

    def close(self) -> None:
        """Release what outlives the engine's actors (a ``PipelineRunner``'s
        stage processes); nothing in one process."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: update request states, forward, sample.

        Raises whatever the backend raises, after dropping the state of the
        step's requests (their rows may be half-updated); the worker turns
        that into a failed step for exactly the requests in it. A block lost
        from an offload tier raises ``KVLoadLost`` (the transfers run before
        the forward pass: nothing was computed).
        """
        try:
            return self._execute(scheduler_output)
        except Exception as exc:
            self._drop_failed(scheduler_output)
            if self.kv_connector is not None:
                self.kv_connector.poison(scheduler_output.written_block_ids)
            if isinstance(exc, BlockLost):
                raise KVLoadLost(str(exc)) from exc
            raise

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        step = self._prepare(scheduler_output)
        if isinstance(step, ModelRunnerOutput):
            return step
        t0 = time.perf_counter()
        if (self.graphs is not None and not step.prompt_rows and not step.spec_rows
                and self.graphs.accepts(step.batch)):
            hidden, logits = None, self.graphs.replay(step.batch)  # a decode step's graph
        else:
            hidden, logits = self._forward_logits(step.batch, step.num_logits)
        return self._complete(step, hidden, logits, t0)

    def _prepare(self, scheduler_output: SchedulerOutput) -> _Step | ModelRunnerOutput:
        """The step up to its forward pass: KV transfers, request states,
        the flat batch and its logits rows; a ``ModelRunnerOutput`` at once
        when no request of the step is left to compute."""
        t_start = time.perf_counter()
        transfer = (self.kv_connector.run(self.kv_caches, scheduler_output)
                    if self.kv_connector is not None else None)
        self._update_states(scheduler_output)
        scheduled = [c for c in scheduler_output.scheduled if c.request_id not in self._failed]
        if not scheduled:
            return ModelRunnerOutput(kv_transfer=transfer)
        batch = self._build(scheduled)
        num_sampled = len(batch.sample_ids)
        constrained = self.structured.rows(batch.sample_ids) if self.structured else []
        masks = self.structured.fill(constrained) if constrained else None  # during the forward
        spec_extra, spec_rows = self._spec_rows(scheduled, batch)
        prompt_rows = self._prompt_logprob_rows(scheduled, batch)
        if prompt_rows or spec_rows:
            extra = [spec_extra] + [rows for _, rows, _ in prompt_rows]
            batch = replace(batch, logits_indices=np.concatenate([batch.logits_indices, *extra]))
        return _Step(scheduled, batch, num_sampled + len(spec_extra), constrained, masks,
                     spec_rows, prompt_rows, transfer, t_start)

    def _forward_logits(self, batch: BatchInputs, num_logits: int):
        """``(hidden [R, H], logits float32[num_logits, V])`` of the batch's
        logits rows, both on the backend."""
        hidden = self._forward(batch)
        return hidden, self._sampling_logits(hidden[:num_logits])

    def _complete(self, step: _Step, hidden, logits, t0: float) -> ModelRunnerOutput:
        """The step after its forward pass (``t0``: when it began):
        constraint masks, prompt logprobs, sampling, drafts, timings."""
        if step.masks is not None:
            self.structured.apply(logits, step.constrained, step.masks.result(), self.xp)
        t1 = time.perf_counter()
        if step.prompt_rows:
            self._gather_prompt_logprobs(step.prompt_rows, hidden[step.num_logits:])
        output = self._sample(step.batch, logits, step.spec_rows)
        t2 = time.perf_counter()
        if self.drafter is not None:
            output.draft_token_ids = self.drafter.propose(self.input_batch, step.scheduled,
                                                          output.sampled, self.states)
        output.kv_transfer = step.transfer
        output.prepare_seconds = t0 - step.t_start
        output.forward_seconds, output.sample_seconds = t1 - t0, t2 - t1
        output.draft_seconds = time.perf_counter() - t2
        return output

    def _build(self, scheduled: list[ScheduledRequest]) -> BatchInputs:
        """The flat batch; a speculating request's chunk ends with its drafts,
        which the input batch holds only while the batch is built."""
        drafts = [(c.request_id, c.spec_token_ids) for c in scheduled if c.spec_token_ids]
        for request_id, tokens in drafts:
            self.input_batch.append_tokens(request_id, tokens)
        try:
            return self.input_batch.build(scheduled)
        finally:
            for request_id, tokens in drafts:
                self.input_batch.truncate_tokens(request_id, len(tokens))

    def _spec_rows(self, scheduled: list[ScheduledRequest], batch: BatchInputs
                   ) -> tuple[np.ndarray, dict[str, tuple[list[int], tuple[int, ...]]]]:
        """Logits rows of the speculating requests: the batch positions to
        score besides the sampled rows (int64[E]: each chunk's last known
        token and drafts but the last), and per request its 1 + d rows in
        the logits array (the extra ones follow the sampled rows) and drafts."""
        extra: list[np.ndarray] = []
        rows: dict[str, tuple[list[int], tuple[int, ...]]] = {}
        if not any(chunk.spec_token_ids for chunk in scheduled):
            return np.zeros(0, dtype=np.int64), rows
        sample_row = {rid: i for i, rid in enumerate(batch.sample_ids)}
        offset = len(batch.sample_ids)
        for index, chunk in enumerate(scheduled):
            drafts = chunk.spec_token_ids
            if not drafts or chunk.request_id not in sample_row:
                continue
            end = int(batch.query_start_loc[index + 1])
            extra.append(np.arange(end - 1 - len(drafts), end - 1, dtype=np.int64))
            rows[chunk.request_id] = (list(range(offset, offset + len(drafts)))
                                      + [sample_row[chunk.request_id]], drafts)
            offset += len(drafts)
        return (np.concatenate(extra) if extra else np.zeros(0, dtype=np.int64)), rows

    def _prompt_logprob_rows(self, scheduled: list[ScheduledRequest], batch: BatchInputs
                             ) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """``(request id, batch rows, target token ids)`` of the prompt positions
        whose logits score the next prompt token, for requests gathering
        prompt logprobs: position j of a chunk scores prompt token j + 1, for
        j + 1 < the prompt length (the last prompt position is the sampled row).
        """
        out = []
        for s, chunk in enumerate(scheduled):
            state = self.states.get(chunk.request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            prompt = state.prompt_token_ids
            start = chunk.start_position
            stop = min(start + chunk.num_tokens, len(prompt) - 1)
            if stop <= start:
                continue
            # Positions before ``start`` were computed without us (cannot happen:
            # such requests get no prefix-cache hits); their entries stay None.
            state.prompt_logprobs.extend([None] * max(0, start + 1 - len(state.prompt_logprobs)))
            rows = int(batch.query_start_loc[s]) + np.arange(stop - start, dtype=np.int64)
            out.append((chunk.request_id, rows, np.asarray(prompt[start + 1:stop + 1])))
        return out

    def _gather_prompt_logprobs(self, prompt_rows: list[tuple[str, np.ndarray, np.ndarray]],
                                hidden) -> None:
        """Score the prompt rows from their hidden states (backend [P, H]),
        ``PROMPT_LOGITS_ROWS`` rows at a time, so the [rows, vocab] logits block
        stays bounded (about 50 MB for a 49,152-token vocabulary) however long
        the chunk."""
        offset = 0
        for request_id, rows, targets in prompt_rows:
            state = self.states[request_id]
            params = state.params
            assert state.prompt_logprobs is not None
            for start in range(0, len(rows), PROMPT_LOGITS_ROWS):
                stop = min(start + PROMPT_LOGITS_ROWS, len(rows))
                block = self._logits(hidden[offset + start:offset + stop])
                state.prompt_logprobs.extend(prompt_logprobs(
                    block, targets[start:stop], params.prompt_logprobs or 0,
                    params.temperature, self.logprobs_mode))
            offset += len(rows)

    def _sampling_logits(self, hidden):
        """float32[R, V] logits of the sampled rows, left on the backend (the
        sampler runs on its array module; only token ids and the requested
        logprobs come back)."""
        logits = self.model.compute_logits(hidden)
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)

    def _logits(self, hidden) -> np.ndarray:
        """float32[R, V] host logits of backend hidden states [R, H]."""
        return np.asarray(self.ops.to_numpy(self.model.compute_logits(hidden)), dtype=np.float32)

    def _drop_failed(self, scheduler_output: SchedulerOutput) -> None:
        """Forget the requests of a step that raised."""
        for chunk in scheduler_output.scheduled:
            self._failed.add(chunk.request_id)
            self.input_batch.remove(chunk.request_id)
            self.states.pop(chunk.request_id, None)
            if self.structured is not None:
                self.structured.remove(chunk.request_id)
            if self.drafter is not None:
                self.drafter.forget([chunk.request_id])

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the step's deltas to the input batch and the sampling states."""
        self._failed.difference_update(scheduler_output.finished_request_ids)
        self._failed.difference_update(n.request_id for n in scheduler_output.new_requests)
        self.input_batch.apply(scheduler_output, skip=self._failed)
        for request_id in scheduler_output.finished_request_ids:
            self.states.pop(request_id, None)
            if self.structured is not None:
                self.structured.remove(request_id)
        if self.drafter is not None:
            self.drafter.forget(scheduler_output.finished_request_ids)
        for new in scheduler_output.new_requests:
            self.states[new.request_id] = SamplingState.create(
                new.sampling_params, list(new.prompt_token_ids), list(new.output_token_ids),
                self.config.eos_token_ids, self._generator)
            constraint = new.sampling_params.structured_outputs
            if constraint is not None and self.structured is not None:
                self.structured.add(new.request_id, constraint, new.output_token_ids)

    def _forward(self, batch: BatchInputs):
        """Backend hidden states [R, H] of the batch's logits rows."""
        return self.model.batch_hidden_states(batch, self.kv_caches)

    def _sample(self, batch: BatchInputs, logits: np.ndarray,
                spec_rows: dict[str, tuple[list[int], tuple[int, ...]]]) -> ModelRunnerOutput:
        """One token per plain sampled row; a speculating request's drafts
        verified (``spec_decode.verify_drafts``) for 1 to d + 1 tokens."""
        output = ModelRunnerOutput()
        plain = [i for i, rid in enumerate(batch.sample_ids) if rid not in spec_rows]
        if plain:
            rows = (logits if len(plain) == logits.shape[0]
                    else logits[self.device.upload(np.asarray(plain, dtype=np.int64))])
            ids = [batch.sample_ids[i] for i in plain]
            tokens, entries = sample(rows, [self.states[rid] for rid in ids],
                                     self.logprobs_mode, self.device)
            for rid, token, entry in zip(ids, tokens, entries):
                self._emit(output, rid, [token], entry)
        for rid, (rows_of, drafts) in spec_rows.items():
            self._emit(output, rid, self._verify(rid, logits[self.xp.asarray(rows_of)], drafts),
                       None)
        return output

    def _verify(self, rid: str, logits, drafts: tuple[int, ...]) -> list[int]:
        """A speculating request's tokens: rejection sampling against the
        draft model's distributions when it drew the drafts at random, else
        ``verify_drafts`` (n-gram, argmax or trimmed drafts)."""
        proposal = self.drafter.take(rid) if self.drafter is not None else None
        if (proposal is not None and proposal.probs is not None
                and proposal.token_ids[:len(drafts)] == drafts):
            return verify_rejection(logits, drafts, proposal.probs[:len(drafts)],
                                    self.states[rid], self.xp)
        return verify_drafts(logits, drafts, self.states[rid], self.xp)

    def _emit(self, output: ModelRunnerOutput, rid: str, tokens: list[int],
              entry: LogprobEntry | None) -> None:
        """Record a request's new tokens in its state, the input batch and ``output``."""
        state = self.states[rid]
        for token in tokens:
            state.append(token)  # keeps the penalty counts current
            if self.structured is not None:
                self.structured.accept(rid, token)
        self.input_batch.append_tokens(rid, tokens)
        output.sampled[rid] = tokens
        if entry is not None:
            output.logprobs[rid] = [entry]
        if state.prompt_logprobs is not None:
            output.prompt_logprobs[rid] = state.prompt_logprobs
            state.prompt_logprobs = None


def profile_forward(model: LlamaModel, ops: Ops, num_tokens: int, block_size: int,
                    kv_cache_dtype: str = "auto") -> None:
    """One forward pass of ``num_tokens`` prompt tokens (a single sequence,
    the largest step the scheduler builds) on a temporary KV cache, then the
    LM head on every row: how a GPU backend measures its activation peak
    before it sizes the KV cache (vLLM's profile run). Token ids are 0; the
    LM head scores the last ``PROMPT_LOGITS_ROWS`` rows (the most a step
    scores at once)."""
    config = model.config
    num_blocks = -(-num_tokens // block_size)
    caches = [ops.allocate_kv_cache(num_blocks, block_size, config.num_key_value_heads,
                                    config.head_dim, kv_cache_dtype=kv_cache_dtype)
              for _ in range(config.num_hidden_layers)]
    positions = np.arange(num_tokens, dtype=np.int64)
    to = ops.to_device
    attn = AttentionMetadata(
        slot_mapping=to(positions),
        block_tables=to(np.arange(num_blocks, dtype=np.int32)[None, :]),
        seq_lens=to(np.array([num_tokens], dtype=np.int32)),
        query_start_loc=to(np.array([0, num_tokens], dtype=np.int32)))
    rows = positions[-PROMPT_LOGITS_ROWS:]
    hidden = model.hidden_states(to(np.zeros(num_tokens, dtype=np.int64)), to(positions), attn,
                                 caches, to(rows))
    model.compute_logits(hidden)
