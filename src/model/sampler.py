"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, penalties.

Runs on the host in NumPy for every backend, batched over the rows: a
[R, vocab] float32 block is small next to the forward pass. This module turns
the requests' options and histories into arrays; ``sampling_kernels`` holds
the array code (written against an array module ``xp``, so a CUDA backend can
run it on the device with CuPy; the only host-only parts are the per-request
bookkeeping here and the generators' uniform draws).

Order of operations: logit bias, min_tokens masking (EOS and
``stop_token_ids`` banned while fewer than ``min_tokens`` tokens were
generated, except on a constrained row whose grammar allows nothing else:
it has finished, and ends the answer), repetition penalty, presence/frequency penalties; then, for
random rows, temperature -> top-k -> top-p -> min-p and one inverse-CDF draw
from the request's generator. Greedy rows (temperature 0) take the argmax of
the processed logits.

The warper order is Hugging Face transformers' (TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper) and llama.cpp's default
sampler chain for these three. vLLM V1 applies min-p before top-k/top-p; we
deliberately follow HF. The two differ: probabilities [.4, .3, .2, .1] with
top_p .75 and min_p .3 keep {0, 1, 2} here (top-p keeps the three tokens
reaching .75, min-p's threshold .12 keeps all three), {0, 1} in vLLM V1.

Ties rank the lower token id first; the draw walks the kept tokens in
ascending token-id order (``sampling_kernels`` gives the details). The
per-row sampler this replaced walked top-p survivors by descending
probability, so seeded top-k/top-p requests draw other (equally distributed)
tokens than before; seeded temperature/min-p requests draw the same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from kvserve.core.sampling_params import SamplingParams
from kvserve.model import sampling_kernels as kernels

LogprobEntry = tuple[float, tuple[tuple[int, float], ...]]

#: Rows per log-softmax block in ``prompt_logprobs`` (bounds float64 temporaries).
_LOGPROB_BLOCK = 64


class _TokenCounts:
    """Distinct token ids and their counts, grown one token at a time.

    ``ids``/``counts`` are int64 views into buffers that double when full,
    so ``add`` is amortised O(1) and reading them copies nothing.
    """

    def __init__(self, tokens: Sequence[int]) -> None:
        ids, counts = np.unique(np.asarray(tokens, dtype=np.int64), return_counts=True)
        self._size = len(ids)
        self._slot = dict(zip(ids.tolist(), range(self._size)))
        self._ids = np.zeros(max(16, 2 * self._size), dtype=np.int64)
        self._counts = np.zeros_like(self._ids)
        self._ids[:self._size], self._counts[:self._size] = ids, counts

    def add(self, token: int) -> None:
        slot = self._slot.get(token)
        if slot is None:
            slot = self._slot[token] = self._size
            self._size += 1
            if slot == len(self._ids):
                self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            self._ids[slot] = token
        self._counts[slot] += 1

    @property
    def ids(self) -> np.ndarray:
        return self._ids[:self._size]

    @property
    def counts(self) -> np.ndarray:
        return self._counts[:self._size]


@dataclass
class SamplingState:
    """Per-request sampling state the runner keeps between steps.

    ``generator`` gives one uniform draw per sampled token, so a seeded
    request's text does not depend on what else is in the batch; after a
    preemption the runner fast-forwards it by the tokens already generated.

    Penalty counts (distinct prompt+output tokens, output token counts) are
    built on first use and then kept up to date token by token: ``append``
    records a sampled token; tokens appended to ``output_token_ids`` directly
    are folded in on the next read. ``output_token_ids`` may only grow (a
    shorter list is recounted from scratch); ``prompt_token_ids`` is fixed.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    generator: np.random.Generator = field(default_factory=np.random.default_rng)
    #: Prompt logprob entries gathered so far (chunked prefill computes them
    #: over several steps), starting with None for the first prompt token;
    #: None when the request did not ask or they were already delivered.
    prompt_logprobs: list[LogprobEntry | None] | None = None
    _seen: _TokenCounts | None = field(default=None, init=False, repr=False, compare=False)
    _output: _TokenCounts | None = field(default=None, init=False, repr=False, compare=False)
    _counted: int = field(default=0, init=False, repr=False, compare=False)
    _bias: tuple[int, np.ndarray, np.ndarray] | None = field(
        default=None, init=False, repr=False, compare=False)

    @classmethod
    def create(cls, params: SamplingParams, prompt: list[int], output: list[int],
               eos_token_ids: tuple[int, ...], fallback: np.random.Generator) -> SamplingState:
        """Build the state; a seeded request gets its own generator, advanced by
        ``len(output)`` draws so recompute after preemption continues the stream."""
        if params.seed is not None:
            gen = np.random.default_rng(params.seed % 2**64)  # numpy wants seed >= 0
            if output:
                gen.random(len(output))
        else:
            gen = fallback
        state = cls(params, list(prompt), list(output), eos_token_ids, gen)
        if params.prompt_logprobs is not None and not output:
            state.prompt_logprobs = [None]  # delivered with the first sampled token
        return state

    def append(self, token: int) -> None:
        """Record one sampled token (the output list and, once built, the counts)."""
        self.output_token_ids.append(token)
        if self._seen is not None:
            self._catch_up()

    def seen_token_ids(self) -> np.ndarray:
        """int64[S]: distinct token ids of prompt and output (repetition penalty)."""
        self._catch_up()
        assert self._seen is not None
        return self._seen.ids

    def output_token_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(distinct output token ids int64[C], their counts int64[C])."""
        self._catch_up()
        assert self._output is not None
        return self._output.ids, self._output.counts

    def _catch_up(self) -> None:
        out = self.output_token_ids
        if self._seen is None or self._output is None or len(out) < self._counted:
            self._seen = _TokenCounts(self.prompt_token_ids + out)
            self._output = _TokenCounts(out)
        else:
            for token in out[self._counted:]:
                self._seen.add(token)
                self._output.add(token)
        self._counted = len(out)

    def bias_arrays(self, vocab: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64[B], biases float32[B]) of ``logit_bias`` inside the vocabulary."""
        if self._bias is None or self._bias[0] != vocab:
            pairs = [(t, b) for t, b in self.params.logit_bias if 0 <= t < vocab]
            self._bias = (vocab, np.array([t for t, _ in pairs], dtype=np.int64),
                          np.array([b for _, b in pairs], dtype=np.float32))
        return self._bias[1], self._bias[2]


def _needs_processing(p: SamplingParams) -> bool:
    """True when ``apply_penalties`` would change the row."""
    return bool(p.logit_bias or p.min_tokens or p.repetition_penalty != 1.0
                or p.presence_penalty or p.frequency_penalty)


class _Pairs:
    """(row, token id, values...) gathered row by row, flattened once for
    ``sampling_kernels.apply_penalties``."""

    def __init__(self, n_values: int) -> None:
        self.rows: list[int] = []
        self.ids: list[np.ndarray] = []
        self.values: list[list[np.ndarray]] = [[] for _ in range(n_values)]

    def add(self, row: int, ids: np.ndarray, *values: np.ndarray | float) -> None:
        """``values``: arrays shaped like ``ids``, or one number for the row."""
        self.rows.append(row)
        self.ids.append(ids)
        for column, value in zip(self.values, values):
            column.append(np.broadcast_to(np.float32(value), ids.shape)
                          if np.isscalar(value) else value)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(rows int64[N], token ids int64[N], each value column float32[N])."""
        rows = np.repeat(np.asarray(self.rows, dtype=np.int64), [a.size for a in self.ids])
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, dtype=np.int64)
        return rows, ids, *(np.concatenate(c).astype(np.float32) if c
                            else np.zeros(0, dtype=np.float32) for c in self.values)


def _penalize(logits: np.ndarray, states: Sequence[SamplingState], xp: Any = np) -> None:
    """Logit bias, min_tokens, repetition and presence/frequency penalties in
    place on float32[R, V] ``logits`` (row r: ``states[r]``), all rows at once.

    Repetition penalty as in CTRL (Keskar et al. 2019) / HF over prompt and
    output tokens; presence and frequency penalties as the OpenAI API
    reference defines them, over output tokens (see ``sampling_kernels``).
    """
    vocab = logits.shape[1]
    bias, banned, seen, counts = _Pairs(1), _Pairs(0), _Pairs(1), _Pairs(3)
    for r, state in enumerate(states):
        p = state.params
        if not _needs_processing(p):
            continue
        if p.logit_bias:
            bias.add(r, *state.bias_arrays(vocab))
        if len(state.output_token_ids) < p.min_tokens:
            stops = np.array([t for t in (*state.eos_token_ids, *p.stop_token_ids)
                              if 0 <= t < vocab], dtype=np.int64)
            # a finished grammar allows only the stop tokens: it ends the
            # answer, min_tokens or not (vLLM's rule), rather than leaving
            # no token to sample (argmax of all -inf: token 0)
            if p.structured_outputs is None or _others_allowed(logits, r, stops, xp):
                banned.add(r, stops)
        if p.repetition_penalty != 1.0:
            seen.add(r, state.seen_token_ids(), p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and state.output_token_ids:
            ids, n = state.output_token_counts()
            counts.add(r, ids, n, p.presence_penalty, p.frequency_penalty)
    if bias.rows or banned.rows or seen.rows or counts.rows:
        dev = Device.of(xp)
        kernels.apply_penalties(logits, *(tuple(dev.upload(a) for a in pairs.arrays())
                                          for pairs in (bias, banned, seen, counts)), xp=dev.xp)


def _others_allowed(logits: Any, row: int, stops: np.ndarray, xp: Any) -> bool:
    """Whether row ``row`` of ``logits`` (a constraint's mask applied) allows a
    token besides ``stops``."""
    module = Device.of(xp).xp
    values = logits[row].copy()
    if stops.size:
        values[module.asarray(stops)] = -np.inf
    return bool(module.isfinite(values).any())


def apply_penalties(logits: np.ndarray, state: SamplingState) -> None:
    """In place on one row float32[V]: logit bias, min_tokens, penalties
    (``_penalize`` on a one-row view)."""
    _penalize(logits[None, :], [state])


def _warpers(params: Sequence[SamplingParams], vocab: int, xp: Any = np
             ) -> kernels.Warpers:
    """The warper settings of random rows as arrays of ``xp`` (an array
    module or a ``Device``; top_k -1 or >= V: 0, off)."""
    up = Device.of(xp).upload
    return kernels.Warpers(up(np.array([p.temperature for p in params], dtype=np.float64)),
                           up(np.array([p.top_k if 0 < p.top_k < vocab else 0 for p in params],
                                       dtype=np.int64)),
                           up(np.array([p.top_p for p in params], dtype=np.float64)),
                           up(np.array([p.min_p for p in params], dtype=np.float64)))


def sample_row(logits: np.ndarray, state: SamplingState) -> int:
    """Draw one token id from processed float32[V] logits (random sampling),
    with exactly one uniform draw from ``state.generator``."""
    u = np.array([state.generator.random()])
    warpers = _warpers([state.params], logits.shape[0])
    return int(kernels.sample_random(logits[None, :], warpers, u)[0])


def _host(array) -> np.ndarray:
    """A small array on the host (token ids): ``.get()`` for CuPy, as is for NumPy."""
    return array.get() if hasattr(array, "get") else np.asarray(array)


@dataclass(frozen=True)
class Device:
    """Where the sampler's arrays live: the array module ``xp``, and the
    functions that copy a host array there (``upload``) and back
    (``download``). A backend's ops object with ``xp``, ``upload`` and
    ``download`` (``kvserve.cuda.ops.CudaOps``, which counts its copies)
    serves as one; an array module alone gets ``xp.asarray`` and ``_host``."""

    xp: ModuleType
    upload: Callable[[Any], Any]
    download: Callable[[Any], np.ndarray]

    @classmethod
    def of(cls, where: Any) -> Device:
        """The ``Device`` of an array module or of a backend's ops object."""
        if isinstance(where, Device):
            return where
        if hasattr(where, "upload") and hasattr(where, "download"):
            return cls(where.xp, where.upload, where.download)
        return cls(where, where.asarray, _host)


def _entries(values: np.ndarray, token_ids: Sequence[int], ks: Sequence[int],
             xp: Any = np) -> list[LogprobEntry]:
    """Logprob entries of float64[R, V] ``values`` (an array of ``xp``, an
    array module or a ``Device``): row r's value of ``token_ids[r]`` and its
    ``ks[r]`` largest (descending, ties by lower id). Only these numbers
    leave the device."""
    dev = Device.of(xp)
    rows = dev.xp.arange(len(token_ids))
    chosen = dev.download(values[rows, dev.upload(np.asarray(token_ids, dtype=np.int64))])
    chosen = chosen.tolist()
    kmax = min(max(ks, default=0), values.shape[1])
    if kmax <= 0:
        return [(lp, ()) for lp in chosen]
    ids, vals = (dev.download(a).tolist() for a in kernels.top_values(values, kmax, dev.xp))
    return [(lp, tuple(zip(i[:k], v[:k]))) for lp, i, v, k in zip(chosen, ids, vals, ks)]


def _values(rows: np.ndarray, mode: str, xp: Any = np) -> np.ndarray:
    """float64[R, V]: the logits themselves in ``raw_logits`` mode, else log-softmax."""
    if mode == "raw_logits":
        return rows.astype(np.float64)
    return kernels.log_softmax(rows, Device.of(xp).xp)


def top_logprobs(row: np.ndarray, token_id: int, k: int, mode: str) -> LogprobEntry:
    """Logprob of the sampled token and the top-k entries of one row.

    ``mode`` ``raw_logits`` returns logits instead of log-probabilities
    (vLLM's ``--logprobs-mode``); otherwise log-softmax in float64.
    """
    return _entries(_values(row[None, :], mode), [token_id], [k])[0]


def prompt_logprobs(logits: np.ndarray, target_ids: np.ndarray, k: int, temperature: float,
                    mode: str) -> list[LogprobEntry]:
    """Logprob entries of prompt tokens (``echo`` / ``prompt_logprobs``).

    Row r of ``logits`` (float32[P, V]) is the model's prediction at prompt
    position j, scored against the prompt's token j + 1 (``target_ids[r]``).
    Same definition as for sampled tokens, but without logit bias and
    penalties (they belong to the generated tokens): the log-softmax of
    ``logits / temperature`` (temperature 0 counts as 1) in
    ``processed_logprobs`` mode, of the raw logits in ``raw_logprobs`` mode,
    the raw logits themselves in ``raw_logits`` mode.
    """
    scale = 1.0 if mode.startswith("raw") or not temperature else 1.0 / temperature
    out: list[LogprobEntry] = []
    for start in range(0, len(logits), _LOGPROB_BLOCK):
        block = logits[start:start + _LOGPROB_BLOCK]
        block = block * scale if scale != 1.0 else block
        targets = [int(t) for t in target_ids[start:start + _LOGPROB_BLOCK]]
        out.extend(_entries(_values(block, mode), targets, [k] * len(targets)))
    return out


def sample(logits: np.ndarray, states: list[SamplingState],
           logprobs_mode: str = "processed_logprobs", xp: Any = np
           ) -> tuple[list[int], list[LogprobEntry | None]]:
    """Sample one token per row.

    Args:
        logits: float32[R, V] array of ``xp`` (NumPy, or CuPy on the device:
            then only token ids and the requested logprobs are copied back),
            row r belongs to ``states[r]``. Modified in place.
        states: the rows' sampling states.
        logprobs_mode: ``processed_logprobs`` (after penalties and temperature,
            as the OpenAI reference describes), ``raw_logprobs`` or ``raw_logits``.
        xp: the array module of ``logits``, or a ``Device`` (or a backend's
            ops object) whose ``upload`` / ``download`` make every copy
            between host and device (a greedy batch: one download of its
            token ids).

    Returns:
        (token ids, logprob entries; None where the request did not ask).
    """
    dev = Device.of(xp)
    xp = dev.xp
    params = [s.params for s in states]
    asked = [r for r, p in enumerate(params) if p.logprobs is not None]
    raw = logits[asked] if asked and logprobs_mode.startswith("raw") else None  # a copy
    _penalize(logits, states, dev)
    temperature = np.array([p.temperature for p in params], dtype=np.float64)
    tokens = np.zeros(len(states), dtype=np.int64)
    greedy = np.flatnonzero(temperature == 0.0)
    if greedy.size:
        tokens[greedy] = dev.download(logits.argmax(axis=1))[greedy]
    rand = np.flatnonzero(temperature != 0.0)
    if rand.size:
        u = dev.upload(np.array([states[r].generator.random() for r in rand]))
        warpers = _warpers([params[r] for r in rand], logits.shape[1], dev)
        x = logits if rand.size == len(states) else logits[dev.upload(rand)]
        tokens[rand] = dev.download(kernels.sample_random(x, warpers, u, xp))
    token_list = tokens.tolist()
    entries: list[LogprobEntry | None] = [None] * len(states)
    if asked:
        if raw is None:
            scale = dev.upload(np.array([params[r].temperature or 1.0 for r in asked],
                                        dtype=np.float32))
            raw = logits[asked] / scale[:, None]
        got = _entries(_values(raw, logprobs_mode, dev), [token_list[r] for r in asked],
                       [params[r].logprobs or 0 for r in asked], dev)
        for r, entry in zip(asked, got):
            entries[r] = entry
    return token_list, entries
