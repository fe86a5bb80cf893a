"""Batched sampler vs a plain per-row float64 reference written here.

With the same uniform draw per row, ``sample`` must return the token the
reference's inverse CDF picks on the reference-filtered distribution, for
random mixes of rows (greedy, temperature, top-k, top-p, min-p, penalties,
logit bias, min_tokens), also when few candidates force the retry passes.
Kept sets are compared directly by a hypothesis property over small
vocabularies with ties. Seeded rows must not depend on the batch; the
incremental penalty counts must equal a recount.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvserve.core.sampling_params import SamplingParams
from kvserve.model import sampling_kernels as kernels
from kvserve.model.sampler import SamplingState, prompt_logprobs, sample

EOS = 2
FALLBACK_SEED = 77


# ---------------------------------------------------------------- reference


def ref_log_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def ref_penalized(row, prompt, output, p: SamplingParams) -> np.ndarray:
    """Bias, min_tokens bans, CTRL/HF repetition, OpenAI presence/frequency."""
    out = np.asarray(row, dtype=np.float64).copy()
    vocab = len(out)
    for tok, bias in p.logit_bias:
        if 0 <= tok < vocab:
            out[tok] += bias
    if len(output) < p.min_tokens:
        for tok in (EOS, *p.stop_token_ids):
            if 0 <= tok < vocab:
                out[tok] = -np.inf
    if p.repetition_penalty != 1.0:
        for tok in set(prompt) | set(output):
            out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else \
                out[tok] * p.repetition_penalty
    for tok in set(output):
        count = list(output).count(tok)
        out[tok] -= p.presence_penalty * (count > 0) + p.frequency_penalty * count
    return out


def ref_filter(row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0
               ) -> tuple[np.ndarray, np.ndarray]:
    """(renormalised probabilities float64[V], kept bool[V]): HF order; tokens
    ranked by logit, ties by the lower token id (logits closer than float64
    resolves after exp still rank by logit)."""
    x = np.asarray(row, dtype=np.float64) / temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    vocab = len(probs)
    ranked = sorted(range(vocab), key=lambda i: (-row[i], i))
    keep = np.ones(vocab, dtype=bool)

    def renorm():
        out = np.where(keep, probs, 0.0)
        return out / out.sum()

    if 0 < top_k < vocab:
        for i in ranked[top_k:]:
            keep[i] = False
        probs = renorm()
    if top_p < 1.0:
        mass_before = 0.0
        for i in ranked:
            if keep[i]:
                if mass_before >= top_p:
                    keep[i] = False
                mass_before += probs[i]
        probs = renorm()
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
        probs = renorm()
    return probs, keep


def ref_draw(probs: np.ndarray, keep: np.ndarray, u: float) -> int:
    """Walk the kept tokens by ascending id; the first whose running mass exceeds u."""
    target = u * probs[keep].sum()
    running = 0.0
    for i in np.nonzero(keep)[0]:
        running += probs[i]
        if running > target:
            return int(i)
    return int(np.nonzero(keep)[0][-1])


def ref_uniforms(cases) -> list[float | None]:
    """The draw each row gets: its own generator (advanced past its output) or,
    in row order, the shared fallback one; None for greedy rows."""
    fallback = np.random.default_rng(FALLBACK_SEED)
    out = []
    for params, _, output in cases:
        if params.temperature == 0.0:
            out.append(None)
        elif params.seed is None:
            out.append(fallback.random())
        else:
            gen = np.random.default_rng(params.seed % 2**64)
            if output:
                gen.random(len(output))
            out.append(gen.random())
    return out


# ---------------------------------------------------------------- cases


def random_params(rng: np.random.Generator, vocab: int) -> SamplingParams:
    kind = rng.choice(["greedy", "temp", "top_k", "top_p", "min_p", "combo"])
    kw: dict = dict(seed=int(rng.integers(-2**63, 2**63 - 1)) if rng.random() < 0.7 else None)
    if kind == "greedy":
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = float(rng.choice([0.3, 0.8, 1.0, 1.7]))
    if kind in ("top_k", "combo"):
        kw["top_k"] = int(rng.choice([-1, 1, 3, 17, vocab - 1, vocab, vocab + 9]))
    if kind in ("top_p", "combo"):
        kw["top_p"] = float(rng.choice([0.2, 0.5, 0.9, 0.95, 0.999]))
    if kind in ("min_p", "combo"):
        kw["min_p"] = float(rng.choice([0.01, 0.1, 0.3]))
    if rng.random() < 0.4:
        kw["repetition_penalty"] = float(rng.choice([0.7, 1.2, 1.5]))
    if rng.random() < 0.4:
        kw["presence_penalty"] = float(rng.uniform(-1.5, 1.5))
        kw["frequency_penalty"] = float(rng.uniform(-1.0, 1.0))
    if rng.random() < 0.3:
        kw["logit_bias"] = {int(t): float(rng.choice([-100.0, -3.0, 2.5, 8.0]))
                            for t in rng.integers(0, vocab + 5, 4)}
    if rng.random() < 0.3:
        kw["min_tokens"], kw["stop_token_ids"] = 4, [int(rng.integers(0, vocab))]
    if rng.random() < 0.3:
        kw["logprobs"] = int(rng.integers(0, 6))
    return SamplingParams(max_tokens=None, **kw)


def random_cases(rng: np.random.Generator, rows: int, vocab: int):
    cases = []
    for _ in range(rows):
        params = random_params(rng, vocab)
        prompt = rng.integers(0, vocab, rng.integers(0, 30)).tolist()
        output = rng.integers(0, min(vocab, 12), rng.integers(0, 9)).tolist()  # repeats
        cases.append((params, prompt, output))
    return cases


def random_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    logits = rng.normal(size=(rows, vocab)) * 2.5
    tied = rng.random(rows) < 0.3  # some rows on a coarse grid: many ties
    logits[tied] = np.round(logits[tied])
    return logits.astype(np.float32)


def make_states(cases) -> list[SamplingState]:
    fallback = np.random.default_rng(FALLBACK_SEED)
    return [SamplingState.create(p, prompt, output, (EOS,), fallback)
            for p, prompt, output in cases]


# ---------------------------------------------------------------- batched vs reference


@pytest.mark.parametrize("candidates", [3, 64, kernels.CANDIDATES])
@pytest.mark.parametrize("seed", range(6))
def test_batched_sample_matches_per_row_reference(seed, candidates, monkeypatch):
    monkeypatch.setattr(kernels, "CANDIDATES", candidates)
    rng = np.random.default_rng(seed)
    vocab, rows = int(rng.choice([40, 300])), 24
    cases = random_cases(rng, rows, vocab)
    raw = random_logits(rng, rows, vocab)
    logits = raw.copy()
    tokens, entries = sample(logits, make_states(cases))  # penalizes ``logits`` in place
    for r, ((params, prompt, output), u) in enumerate(zip(cases, ref_uniforms(cases))):
        want = ref_penalized(raw[r], prompt, output, params)
        np.testing.assert_allclose(logits[r], want, rtol=1e-6, atol=1e-5)
        if u is None:
            assert tokens[r] == int(np.argmax(logits[r]))
        else:
            probs, keep = ref_filter(logits[r], params.temperature, params.top_k,
                                     params.top_p, params.min_p)
            assert tokens[r] == ref_draw(probs, keep, u), (r, params)
        if params.logprobs is None:
            assert entries[r] is None
            continue
        values = ref_log_softmax(logits[r].astype(np.float64) / (params.temperature or 1.0))
        lp, top = entries[r]
        assert lp == pytest.approx(values[tokens[r]], abs=1e-5)
        assert len(top) == params.logprobs
        np.testing.assert_allclose([v for _, v in top],
                                   np.sort(values)[::-1][:params.logprobs], atol=1e-5)
        for tok, v in top:
            assert v == pytest.approx(values[tok], abs=1e-5)


def test_large_vocabulary_top_p_needs_retry_passes():
    """V = 49,152 at N(0, 9): top_p .999 needs more than the first candidates."""
    rng = np.random.default_rng(1)
    vocab, rows = 49_152, 4
    logits = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    cases = [(SamplingParams(seed=s, temperature=0.8, top_p=top_p, max_tokens=None), [], [])
             for s, top_p in zip(range(rows), (0.5, 0.95, 0.999, 0.999))]
    tokens, _ = sample(logits.copy(), make_states(cases))
    for r, ((params, _, _), u) in enumerate(zip(cases, ref_uniforms(cases))):
        probs, keep = ref_filter(logits[r], params.temperature, top_p=params.top_p)
        assert tokens[r] == ref_draw(probs, keep, u)
    needed = ref_filter(logits[2], 0.8, top_p=0.999)[1].sum()
    assert needed > kernels.CANDIDATES


# ---------------------------------------------------------------- kept sets


def _ambiguous(row, temperature, top_k, top_p, min_p) -> bool:
    """True when float rounding could decide the reference's top-p or min-p
    boundary (the two sides would then be both right)."""
    x = np.asarray(row, dtype=np.float64) / temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = sorted(range(len(probs)), key=lambda i: (-row[i], i))
    if 0 < top_k < len(probs):
        order = order[:top_k]
    kept = probs[order] / probs[order].sum()
    before = np.concatenate([[0.0], np.cumsum(kept)[:-1]])
    near_p = top_p < 1.0 and bool(np.any(np.abs(before - top_p) < 1e-9))
    ratio = kept / kept.max()
    near_min = min_p > 0.0 and bool(np.any(np.abs(ratio - min_p) < 1e-9))
    return near_p or near_min


ROW = st.integers(5, 60).flatmap(lambda v: st.lists(
    st.one_of(st.integers(-4, 4).map(float), st.floats(-12, 12, width=32)),
    min_size=v, max_size=v))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_kept_set_matches_reference(data):
    row = np.array(data.draw(ROW), dtype=np.float32)
    vocab = len(row)
    temperature = data.draw(st.sampled_from([0.25, 0.7, 1.0, 1.6]))
    top_k = data.draw(st.integers(-1, vocab + 2))
    top_p = data.draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0)))
    min_p = data.draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
    candidates = data.draw(st.sampled_from([1, 2, 3, 8, 2048]))
    assume(not _ambiguous(row, temperature, top_k, top_p, min_p))
    # the row twice, the second copy reversed, so the batch has two rows
    block = np.stack([row, row[::-1]])
    warp = kernels.Warpers(np.full(2, temperature),
                           np.full(2, top_k if 0 < top_k < vocab else 0, dtype=np.int64),
                           np.full(2, top_p), np.full(2, min_p))
    got = kernels.kept_mask(block, warp, candidates=candidates)
    for r in range(2):
        _, want = ref_filter(block[r], temperature, top_k, top_p, min_p)
        np.testing.assert_array_equal(got[r], want)


def test_ties_rank_lower_token_id_first():
    block = np.zeros((1, 10), dtype=np.float32)
    warp = kernels.Warpers(np.ones(1), np.array([3]), np.ones(1), np.zeros(1))
    for candidates in (1, 2, 4, 10):
        mask = kernels.kept_mask(block, warp, candidates=candidates)
        assert np.nonzero(mask[0])[0].tolist() == [0, 1, 2]


# ---------------------------------------------------------------- seeds and batches


def _run(cases, order, logits_per_step, steps):
    """Tokens of every case after ``steps`` steps, batched in ``order``."""
    states = {i: s for i, s in zip(order, make_states([cases[i] for i in order]))}
    got: dict[int, list[int]] = {i: [] for i in order}
    for step in range(steps):
        block = np.stack([logits_per_step[step][i] for i in order])
        tokens, _ = sample(block, [states[i] for i in order])
        for i, token in zip(order, tokens):
            states[i].append(token)
            got[i].append(token)
    return got


@pytest.mark.parametrize("candidates", [4, kernels.CANDIDATES])
def test_seeded_row_same_alone_and_in_any_batch_order(candidates, monkeypatch):
    monkeypatch.setattr(kernels, "CANDIDATES", candidates)
    rng = np.random.default_rng(21)
    vocab, steps = 500, 8
    cases = [(SamplingParams(seed=5, temperature=0.9, top_p=0.9, top_k=50,
                             repetition_penalty=1.2, presence_penalty=0.4,
                             frequency_penalty=0.2, max_tokens=None), [1, 2, 3, 3], [4])]
    cases += [(random_params(rng, vocab), rng.integers(0, vocab, 10).tolist(), [])
              for _ in range(7)]
    logits_per_step = [random_logits(rng, 8, vocab) for _ in range(steps)]
    alone = _run(cases, [0], logits_per_step, steps)[0]
    for _ in range(4):
        order = rng.permutation(8).tolist()
        assert _run(cases, order, logits_per_step, steps)[0] == alone


def test_greedy_rows_draw_nothing_from_the_generator():
    state = SamplingState.create(SamplingParams(temperature=0.0, seed=3, logprobs=2),
                                 [], [], (EOS,), np.random.default_rng(0))
    logits = np.random.default_rng(4).normal(size=(1, 30)).astype(np.float32)
    tokens, entries = sample(logits.copy(), [state])
    assert tokens == [int(np.argmax(logits[0]))] and entries[0] is not None
    assert state.generator.random() == np.random.default_rng(3).random()


# ---------------------------------------------------------------- counts


def test_incremental_counts_equal_recount():
    rng = np.random.default_rng(9)
    prompt = rng.integers(0, 50, 40).tolist()
    state = SamplingState.create(SamplingParams(repetition_penalty=1.1), prompt, [7, 7, 8],
                                 (EOS,), rng)
    for step in range(300):
        token = int(rng.integers(0, 60))
        if step % 3 == 0:
            state.output_token_ids.append(token)  # direct appends are folded in on read
        else:
            state.append(token)
        if step % 7 == 0 or step == 299:
            out = state.output_token_ids
            seen = state.seen_token_ids()
            np.testing.assert_array_equal(np.sort(seen), np.unique(prompt + out))
            ids, counts = state.output_token_counts()
            want_ids, want_counts = np.unique(out, return_counts=True)
            order = np.argsort(ids)
            np.testing.assert_array_equal(ids[order], want_ids)
            np.testing.assert_array_equal(counts[order], want_counts)
    state.output_token_ids = [5]  # shorter list: recounted
    np.testing.assert_array_equal(state.output_token_counts()[0], [5])


# ---------------------------------------------------------------- prompt logprobs


def test_prompt_logprobs_across_blocks():
    logits = np.random.default_rng(2).normal(size=(150, 40)).astype(np.float32)
    targets = np.random.default_rng(3).integers(0, 40, 150)
    entries = prompt_logprobs(logits, targets, 3, 0.5, "processed_logprobs")
    assert len(entries) == 150
    for row, target, (lp, top) in zip(logits, targets, entries):
        values = ref_log_softmax(row.astype(np.float64) * 2.0)
        assert lp == pytest.approx(values[target], abs=1e-5)
        assert [t for t, _ in top] == np.argsort(-values, kind="stable")[:3].tolist()
