"""verify_drafts: greedy keeps drafts while they are the argmax; sampled
verification emits exactly the target distribution (a fixed-seed
chi-square test on a 5-token vocabulary) and draws one uniform per emitted
token, as plain sampling does."""

import numpy as np
import pytest

from kvserve.core.sampling_params import SamplingParams
from kvserve.model.sampler import SamplingState
from kvserve.model.spec_decode import verify_drafts

#: Chi-square critical value for 4 degrees of freedom at p = 0.001.
CHI2_4DF_P001 = 18.47
TRIALS = 10000

# rows: after the last known token, after draft 0, after draft 1
LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0],
                   [0.0, 1.5, 0.2, 0.9, 0.1],
                   [1.0, 1.0, 1.0, 1.0, 1.0]], dtype=np.float32)


def state(params: SamplingParams, seed: int = 0) -> SamplingState:
    return SamplingState.create(params, [1, 2], [], (99,), np.random.default_rng(seed))


def target(row: np.ndarray, temperature: float, top_k: int = 0) -> np.ndarray:
    """The target distribution of one row, computed here from its definition."""
    z = row.astype(np.float64) / temperature
    if top_k:
        z[np.argsort(-z)[top_k:]] = -np.inf
    p = np.exp(z - z.max())
    return p / p.sum()


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the support was emitted"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    s = state(SamplingParams(temperature=0.0))
    assert verify_drafts(LOGITS, [0, 1], s) == [0, 1, 0]  # all accepted, then row 2's argmax
    assert verify_drafts(LOGITS, [0, 3], s) == [0, 1]  # draft 1 rejected: row 1's argmax
    assert verify_drafts(LOGITS, [4, 1], s) == [0]


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.3, 3)])
def test_sampled_verification_emits_the_target_distribution(temperature, top_k):
    params = SamplingParams(temperature=temperature, top_k=top_k)
    s = state(params, seed=1234)
    drafts = [1, 3]  # a plausible but not the likeliest first draft
    first = np.zeros(5, dtype=np.int64)
    second = np.zeros(5, dtype=np.int64)  # given the first draft was accepted
    accepted_first = 0
    for _ in range(TRIALS):
        out = verify_drafts(LOGITS, drafts, s)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            accepted_first += 1
            second[out[1]] += 1
    p0 = target(LOGITS[0], temperature, top_k)
    p1 = target(LOGITS[1], temperature, top_k)
    assert chi_square(first, p0) < CHI2_4DF_P001, (first, p0)
    assert chi_square(second, p1) < CHI2_4DF_P001, (second, p1)
    assert abs(accepted_first / TRIALS - p0[drafts[0]]) < 4 * np.sqrt(p0[1] * (1 - p0[1]) / TRIALS)


def test_one_uniform_per_emitted_token():
    params = SamplingParams(temperature=1.0, seed=7)
    s = state(params)
    reference = np.random.default_rng(7)
    emitted = 0
    for _ in range(50):
        emitted += len(verify_drafts(LOGITS, [1, 3], s))
    reference.random(emitted)
    assert s.generator.random() == reference.random()


def test_rows_and_drafts_must_agree():
    with pytest.raises(ValueError, match="rows"):
        verify_drafts(LOGITS, [1], state(SamplingParams()))
