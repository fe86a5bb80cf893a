"""Sampler tests: penalties, warpers (temperature -> top-k -> top-p -> min-p),
seeds, statistics and logprobs, each against a plain float64 NumPy reference
written here (never against the code under test). No model needed."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.core.sampling_params import SamplingParams
from kvserve.model.sampler import (
    SamplingState,
    apply_penalties,
    prompt_logprobs,
    sample,
    sample_row,
    top_logprobs,
)

EOS = 7
#: Chi-square critical values at alpha = 1e-3 by degrees of freedom.
CHI2_CRIT_1E3 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


# ---------------------------------------------------------------- reference


def ref_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_log_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def _renorm(probs: np.ndarray, keep: np.ndarray) -> np.ndarray:
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def ref_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Hugging Face order: temperature, top-k, top-p, min-p; renormalised float64[V]."""
    probs = ref_softmax(np.asarray(logits, dtype=np.float64) / temperature)
    vocab = len(probs)
    ranked = sorted(range(vocab), key=lambda i: -probs[i])
    keep = np.ones(vocab, dtype=bool)
    if top_k > 0:
        for i in ranked[top_k:]:
            keep[i] = False
        probs = _renorm(probs, keep)
    if top_p < 1.0:
        mass_before = 0.0
        for i in ranked:
            if keep[i]:
                if mass_before >= top_p:  # the token crossing top_p is kept
                    keep[i] = False
                mass_before += probs[i]
        probs = _renorm(probs, keep)
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
        probs = _renorm(probs, keep)
    return probs


def ref_penalties(logits, prompt=(), output=(), repetition=1.0, presence=0.0,
                  frequency=0.0, bias=None) -> np.ndarray:
    """Bias, then CTRL/HF repetition penalty, then OpenAI presence/frequency."""
    out = np.asarray(logits, dtype=np.float64).copy()
    for tok, b in (bias or {}).items():
        out[tok] += b
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    for tok in set(output):
        count = list(output).count(tok)
        out[tok] -= presence * (count > 0) + frequency * count
    return out


# ---------------------------------------------------------------- helpers


def make_state(prompt=(), output=(), seed: int | None = 1234, **kw) -> SamplingState:
    params = SamplingParams(seed=seed, **kw)
    return SamplingState.create(params, list(prompt), list(output), (EOS,),
                                np.random.default_rng(99))


def draw(logits, n: int, seed: int = 1234, **kw) -> np.ndarray:
    """n tokens from sample_row on one float32 row, one seeded generator."""
    row = np.asarray(logits, dtype=np.float32)
    state = make_state(seed=seed, **kw)
    return np.array([sample_row(row, state) for _ in range(n)])


def support(tokens: np.ndarray) -> set[int]:
    return {int(t) for t in np.unique(tokens)}


def expected_support(probs: np.ndarray) -> set[int]:
    return {int(i) for i in np.nonzero(probs > 0)[0]}


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic over the kept tokens, and its degrees of freedom."""
    counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    kept = probs > 0
    assert counts[~kept].sum() == 0, "sampled a token the reference drops"
    expected = probs[kept] * len(tokens)
    return float(((counts[kept] - expected) ** 2 / expected).sum()), int(kept.sum()) - 1


def assert_frequencies(tokens: np.ndarray, probs: np.ndarray) -> None:
    stat, dof = chi_square(tokens, probs)
    assert stat < CHI2_CRIT_1E3[dof], (stat, dof)
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs))
    sigma = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - n * probs) <= 5 * sigma + 1e-9)


LOGITS6 = np.log(np.array([0.3, 0.25, 0.2, 0.12, 0.08, 0.05]))


# ---------------------------------------------------------------- reference sanity


def test_reference_filters_on_known_cases():
    p4 = np.log([0.4, 0.3, 0.2, 0.1])
    assert expected_support(ref_distribution(p4, top_p=0.75, min_p=0.3)) == {0, 1, 2}
    assert expected_support(ref_distribution(p4, top_k=2, top_p=0.5)) == {0}
    assert expected_support(ref_distribution(np.log([0.5, 0.3, 0.2]), top_p=0.6)) == {0, 1}


# ---------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.slow
def test_temperature_frequencies_match_scaled_softmax(temperature):
    tokens = draw(LOGITS6, 20_000, temperature=temperature)
    assert_frequencies(tokens, ref_softmax(LOGITS6 / temperature))


# ---------------------------------------------------------------- warpers alone


def test_top_k_alone_keeps_k_largest():
    logits = np.array([0.1, 1.0, 0.9, -0.5, 0.95, 0.3, -2.0, 0.0])
    tokens = draw(logits, 4000, top_k=3)
    assert support(tokens) == {1, 2, 4} == expected_support(ref_distribution(logits, top_k=3))


@pytest.mark.parametrize("top_k", [0, -1, 8, 50])
def test_top_k_disabled_or_vocab_sized_keeps_all(top_k):
    logits = np.log(np.full(8, 1 / 8))
    assert support(draw(logits, 2000, top_k=top_k)) == set(range(8))


@pytest.mark.parametrize(("top_p", "kept"), [
    (0.45, {0}),        # token 0 alone (0.5) already crosses 0.45
    (0.6, {0, 1}),      # 0.5 < 0.6: token 1 crosses the threshold and stays
    (0.79, {0, 1}),
    (0.85, {0, 1, 2}),  # 0.8 < 0.85: token 2 crosses and stays
])
@pytest.mark.slow
def test_top_p_keeps_token_crossing_threshold(top_p, kept):
    logits = np.log([0.5, 0.3, 0.2])
    assert expected_support(ref_distribution(logits, top_p=top_p)) == kept
    assert support(draw(logits, 3000, top_p=top_p)) == kept


def test_min_p_alone_drops_below_fraction_of_max():
    logits = np.log([0.4, 0.3, 0.2, 0.06, 0.04])
    tokens = draw(logits, 4000, min_p=0.12)  # threshold 0.048: drops token 4 only
    assert support(tokens) == {0, 1, 2, 3} == expected_support(ref_distribution(logits, min_p=0.12))


def test_top_p_applies_before_min_p():
    """[.4,.3,.2,.1], top_p .75 then min_p .3 keeps {0,1,2} (HF order);
    min-p first (vLLM V1) would keep {0,1}."""
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    ref = ref_distribution(logits, top_p=0.75, min_p=0.3)
    tokens = draw(logits, 5000, top_p=0.75, min_p=0.3)
    counts = np.bincount(tokens, minlength=4)
    assert counts[3] == 0
    assert counts[0] > 0 and counts[1] > 0 and counts[2] > 0
    assert_frequencies(tokens, ref)


def test_top_k_applies_before_top_p():
    """top_k 2 renormalises [.4,.3] to [.57,.43], so top_p .5 keeps only token 0."""
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    assert support(draw(logits, 2000, top_k=2, top_p=0.5)) == {0}


@pytest.mark.slow
def test_combined_chain_chi_square():
    """20,000 draws through all warpers match the reference by chi-square."""
    logits = np.array([2.0, 1.6, 1.3, 1.0, 0.4, -0.3, -1.0, -3.0])
    kw = dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.35)
    ref = ref_distribution(logits, **kw)  # top-k drops 6, 7; top-p 4, 5; min-p 3
    assert expected_support(ref) == {0, 1, 2}
    tokens = draw(logits, 20_000, seed=2024, **kw)
    assert_frequencies(tokens, ref)


# ---------------------------------------------------------------- penalties


def processed_row(logits, **kw) -> np.ndarray:
    row = np.asarray(logits, dtype=np.float32).copy()
    apply_penalties(row, make_state(**kw))
    return row


LOGITS_PN = np.array([2.0, -1.0, 0.5, -0.25, 1.5, 0.0, 3.0, -2.0, 0.75, 1.0])


def test_repetition_penalty_divides_positive_multiplies_negative():
    prompt, output = [0, 1, 1, 5], [2, 3]
    got = processed_row(LOGITS_PN, prompt=prompt, output=output, repetition_penalty=1.5)
    want = ref_penalties(LOGITS_PN, prompt, output, repetition=1.5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got[0] == pytest.approx(2.0 / 1.5) and got[1] == pytest.approx(-1.5)
    assert got[6] == pytest.approx(3.0)  # unseen token untouched


def test_repetition_penalty_changes_greedy_choice():
    logits = np.array([[2.0, 1.5, -1.0], [-0.5, -0.6, -3.0]], dtype=np.float32)
    states = [make_state(prompt=[0], temperature=0.0, repetition_penalty=1.5),
              make_state(prompt=[0], temperature=0.0, repetition_penalty=1.5)]
    tokens, _ = sample(logits, states)
    assert tokens == [1, 1]  # 2/1.5 < 1.5 and -0.5*1.5 < -0.6


def test_presence_frequency_penalties_formula():
    output = [3, 3, 1, 8, 3]
    got = processed_row(LOGITS_PN, output=output, presence_penalty=0.5, frequency_penalty=0.25)
    want = ref_penalties(LOGITS_PN, (), output, presence=0.5, frequency=0.25)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert got[3] == pytest.approx(-0.25 - 0.5 - 0.75)  # seen 3 times: lowered
    assert got[1] < LOGITS_PN[1] and got[8] < LOGITS_PN[8]
    assert got[0] == pytest.approx(2.0)


def test_negative_presence_penalty_raises_seen_tokens():
    got = processed_row(LOGITS_PN, output=[1, 1], presence_penalty=-1.0, frequency_penalty=-0.5)
    assert got[1] == pytest.approx(-1.0 + 1.0 + 1.0)


def test_all_penalties_with_bias_together():
    prompt, output = [0, 4, 9], [6, 6, 2, 0]
    kw = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
              logit_bias={5: 2.5, 7: -1.0})
    got = processed_row(LOGITS_PN, prompt=prompt, output=output, **kw)
    want = ref_penalties(LOGITS_PN, prompt, output, repetition=1.3, presence=0.4,
                         frequency=0.3, bias={5: 2.5, 7: -1.0})
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_presence_penalty_changes_greedy_choice_and_logprobs():
    logits = np.array([1.0, 0.2, -0.5, 1.6], dtype=np.float32)
    output = [3, 3]
    state = make_state(output=output, temperature=0.0, presence_penalty=0.5,
                       frequency_penalty=0.2, logprobs=4)
    tokens, entries = sample(logits[None, :].copy(), [state])
    want = ref_penalties(logits, (), output, presence=0.5, frequency=0.2)
    assert tokens == [int(np.argmax(want))] == [0]  # 1.6 - 0.9 = 0.7 < 1.0
    lp, top = entries[0]
    ref_lp = ref_log_softmax(want)
    assert lp == pytest.approx(ref_lp[0], abs=1e-5)
    assert [t for t, _ in top] == [0, 3, 1, 2]
    np.testing.assert_allclose([v for _, v in top], ref_lp[[0, 3, 1, 2]], atol=1e-5)


# ---------------------------------------------------------------- bias, min_tokens


def test_logit_bias_greedy_and_out_of_range_ignored():
    logits = np.array([[3.0, 1.0, 0.5, 0.0, 2.0]], dtype=np.float32)
    tokens, _ = sample(logits.copy(), [make_state(temperature=0.0, logit_bias={4: 1.5, 99: 5.0})])
    assert tokens == [4]
    tokens, _ = sample(logits.copy(), [make_state(temperature=0.0, logit_bias={0: -100})])
    assert tokens == [4]


def test_logit_bias_random_sampling_suppresses_token():
    tokens = [sample(np.zeros((1, 4), np.float32), [s])[0][0]
              for s in [make_state(seed=i, logit_bias={2: -100}) for i in range(300)]]
    assert 2 not in tokens and set(tokens) == {0, 1, 3}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_and_stop_ids_until_reached(temperature):
    logits = np.full(10, -5.0, dtype=np.float32)
    logits[EOS], logits[5], logits[2] = 10.0, 9.0, 0.0
    params = dict(min_tokens=3, stop_token_ids=[5], temperature=temperature)
    for n_out in range(3):
        state = make_state(output=[1] * n_out, **params)
        row = logits.copy()
        apply_penalties(row, state)
        assert row[EOS] == -np.inf and row[5] == -np.inf
        tokens, _ = sample(logits[None, :].copy(), [make_state(output=[1] * n_out, **params)])
        assert tokens[0] not in (EOS, 5)
    tokens, _ = sample(logits[None, :].copy(), [make_state(output=[1] * 3, **params)])
    if temperature == 0.0:
        assert tokens == [EOS]
    row = logits.copy()
    apply_penalties(row, make_state(output=[1] * 3, **params))
    np.testing.assert_array_equal(row, logits)


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_per_row():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(16, 50)).astype(np.float32)
    want = np.argmax(logits.astype(np.float64), axis=1).tolist()
    states = [make_state(temperature=0.0, seed=None) for _ in range(16)]
    tokens, entries = sample(logits.copy(), states)
    assert tokens == want and entries == [None] * 16


# ---------------------------------------------------------------- seeds


def run_steps(logits: np.ndarray, state: SamplingState, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        token = sample(logits[None, :].copy(), [state])[0][0]
        state.output_token_ids.append(token)
        out.append(token)
    return out


LOGITS50 = np.random.default_rng(11).normal(size=50).astype(np.float32)


def test_same_seed_same_tokens_different_seed_differs():
    kw = dict(temperature=1.0, top_p=0.95, presence_penalty=0.3)
    a = run_steps(LOGITS50, make_state(seed=42, **kw), 30)
    b = run_steps(LOGITS50, make_state(seed=42, **kw), 30)
    c = run_steps(LOGITS50, make_state(seed=43, **kw), 30)
    assert a == b and a != c


def test_seeded_row_independent_of_batch_and_order():
    rng = np.random.default_rng(3)
    batch = rng.normal(size=(3, 50)).astype(np.float32)
    alone = run_steps(batch[0], make_state(seed=7), 10)

    def in_batch(order):
        states = {0: make_state(seed=7), 1: make_state(seed=8), 2: make_state(seed=None)}
        got = []
        for _ in range(10):
            tokens, _ = sample(batch[order].copy(), [states[i] for i in order])
            got.append(tokens[order.index(0)])
        return got

    assert in_batch([0, 1, 2]) == alone
    assert in_batch([2, 1, 0]) == alone
    assert in_batch([1, 0]) == alone


def test_resume_fast_forwards_generator():
    kw = dict(seed=2**63 - 1, temperature=0.9, frequency_penalty=0.2, repetition_penalty=1.1)
    full = run_steps(LOGITS50, make_state(prompt=[1, 2], **kw), 12)
    resumed = make_state(prompt=[1, 2], output=full[:5], **kw)
    assert run_steps(LOGITS50, resumed, 7) == full[5:]


def test_create_sets_prompt_logprobs_only_before_first_token():
    assert make_state(prompt_logprobs=2).prompt_logprobs == [None]
    assert make_state(prompt_logprobs=2, output=[1]).prompt_logprobs is None
    assert make_state().prompt_logprobs is None


# ---------------------------------------------------------------- logprobs


def check_entry(entry, token, values, k):
    lp, top = entry
    assert lp == pytest.approx(values[token], abs=1e-5)
    order = sorted(range(len(values)), key=lambda i: -values[i])[:k]
    assert [t for t, _ in top] == order
    got_vals = [v for _, v in top]
    assert got_vals == sorted(got_vals, reverse=True)
    np.testing.assert_allclose(got_vals, np.asarray(values)[order], atol=1e-5)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs", "raw_logits"])
def test_sample_logprobs_modes(mode):
    raw = np.array([1.0, 0.3, -0.4, 2.2, 0.9, -1.5], dtype=np.float32)
    output = [3, 3, 4]
    kw = dict(temperature=0.7, presence_penalty=0.6, frequency_penalty=0.1,
              logit_bias={2: 1.25}, logprobs=3)
    state = make_state(output=output, **kw)
    tokens, entries = sample(raw[None, :].copy(), [state], logprobs_mode=mode)
    processed = ref_penalties(raw, (), output, presence=0.6, frequency=0.1, bias={2: 1.25})
    values = {"processed_logprobs": ref_log_softmax(processed / 0.7),
              "raw_logprobs": ref_log_softmax(raw),
              "raw_logits": raw.astype(np.float64)}[mode]
    check_entry(entries[0], tokens[0], values, 3)


def test_greedy_logprobs_not_scaled_and_none_when_not_asked():
    raw = np.array([[0.5, 2.0, -1.0, 1.0], [0.0, 1.0, 2.0, 3.0]], dtype=np.float32)
    states = [make_state(temperature=0.0, logprobs=2), make_state(temperature=0.0)]
    tokens, entries = sample(raw.copy(), states)
    assert tokens == [1, 3] and entries[1] is None
    check_entry(entries[0], 1, ref_log_softmax(raw[0]), 2)


def test_top_logprobs_direct():
    row = np.array([0.1, 3.0, -2.0, 1.5, 1.4], dtype=np.float32)
    ref = ref_log_softmax(row)
    check_entry(top_logprobs(row, 2, 4, "processed_logprobs"), 2, ref, 4)
    check_entry(top_logprobs(row, 0, 2, "raw_logits"), 0, row.astype(np.float64), 2)
    lp, top = top_logprobs(row, 4, 0, "raw_logprobs")
    assert top == () and lp == pytest.approx(ref[4], abs=1e-6)


@pytest.mark.parametrize(("mode", "temperature"), [
    ("processed_logprobs", 0.5), ("processed_logprobs", 0.0),
    ("raw_logprobs", 0.5), ("raw_logits", 0.5)])
def test_prompt_logprobs(mode, temperature):
    logits = np.random.default_rng(8).normal(size=(4, 12)).astype(np.float32)
    targets = np.array([3, 0, 11, 7])
    entries = prompt_logprobs(logits, targets, 3, temperature, mode)
    assert len(entries) == 4
    scale = 1.0 / temperature if mode == "processed_logprobs" and temperature else 1.0
    for row, target, entry in zip(logits, targets, entries):
        if mode == "raw_logits":
            values = row.astype(np.float64)
        else:
            values = ref_log_softmax(row.astype(np.float64) * scale)
        check_entry(entry, int(target), values, 3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_finished_grammar_ends_the_answer_under_min_tokens(temperature):
    """Issue 47, item 5: a constrained row whose mask (applied before the
    penalties) allows only EOS has finished its grammar: min_tokens does not
    ban EOS there, so the answer ends with it rather than with the argmax of
    all -inf (token 0, then a pad of rejected tokens); a constrained row with
    anything else allowed keeps the ban."""
    from kvserve.core.structured_outputs import StructuredOutputsParams

    constrained = dict(min_tokens=6, temperature=temperature,
                       structured_outputs=StructuredOutputsParams(json={"type": "boolean"}))
    finished = np.full((1, 10), -np.inf, dtype=np.float32)
    finished[0, EOS] = 1.0
    tokens, _ = sample(finished.copy(), [make_state(output=[1, 2], **constrained)])
    assert tokens == [EOS]
    open_row = finished.copy()
    open_row[0, 3] = 0.5
    tokens, _ = sample(open_row, [make_state(output=[1, 2], **constrained)])
    assert tokens == [3]
