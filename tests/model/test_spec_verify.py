"""verify_drafts: greedy keeps drafts while they are the argmax; sampled
verification emits exactly the target distribution (a fixed-seed
chi-square test on a 5-token vocabulary) and draws one uniform per emitted
token, as plain sampling does. verify_rejection (a draft model's drafts
drawn from q): the emitted tokens follow the target distribution p, and
a draft is accepted with probability sum_x min(p(x), q(x)) (Leviathan et
al. 2023, section 3.5), both computed here from the definitions."""

import numpy as np
import pytest

from kvserve.core.sampling_params import SamplingParams
from kvserve.model.sampler import SamplingState
from kvserve.model.spec_verify import verify_drafts, verify_rejection

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


def emits_the_target(step, temperature: float, top_k: int) -> int:
    """Run ``step`` (-> emitted tokens, drafts) ``TRIALS`` times; assert the
    first emitted token follows row 0's target distribution and, when the
    first draft was accepted, the second follows row 1's. Returns how often
    the first draft was accepted."""
    first = np.zeros(5, dtype=np.int64)
    second = np.zeros(5, dtype=np.int64)
    accepted_first = 0
    for _ in range(TRIALS):
        out, drafts = step()
        assert 1 <= len(out) <= len(drafts) + 1 and out[:-1] == drafts[:len(out) - 1]
        first[out[0]] += 1
        if len(out) > 1:
            accepted_first += 1
            second[out[1]] += 1
    p0 = target(LOGITS[0], temperature, top_k)
    p1 = target(LOGITS[1], temperature, top_k)
    assert chi_square(first, p0) < CHI2_4DF_P001, (first, p0)
    assert chi_square(second, p1) < CHI2_4DF_P001, (second, p1)
    return accepted_first


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    s = state(SamplingParams(temperature=0.0))
    assert verify_drafts(LOGITS, [0, 1], s) == [0, 1, 0]  # all accepted, then row 2's argmax
    assert verify_drafts(LOGITS, [0, 3], s) == [0, 1]  # draft 1 rejected: row 1's argmax
    assert verify_drafts(LOGITS, [4, 1], s) == [0]


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.3, 3)])
@pytest.mark.slow
def test_sampled_verification_emits_the_target_distribution(temperature, top_k):
    params = SamplingParams(temperature=temperature, top_k=top_k)
    s = state(params, seed=1234)
    drafts = [1, 3]  # a plausible but not the likeliest first draft
    accepted_first = emits_the_target(lambda: (verify_drafts(LOGITS, drafts, s), drafts),
                                      temperature, top_k)
    p0 = target(LOGITS[0], temperature, top_k)
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


# The draft model's distributions for positions 0 and 1: close to p, not equal.
DRAFT_Q = np.array([[0.30, 0.40, 0.10, 0.10, 0.10],
                    [0.05, 0.25, 0.20, 0.40, 0.10]])


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.3, 3)])
@pytest.mark.slow
def test_rejection_sampling_emits_the_target_distribution(temperature, top_k):
    params = SamplingParams(temperature=temperature, top_k=top_k)
    s = state(params, seed=4321)
    drafter = np.random.default_rng(99)  # draws the drafts from q, as the draft model does

    def one_step():
        drafts = [int(drafter.choice(5, p=DRAFT_Q[0])), int(drafter.choice(5, p=DRAFT_Q[1]))]
        return verify_rejection(LOGITS, drafts, DRAFT_Q, s), drafts
    accepted_first = emits_the_target(one_step, temperature, top_k)
    beta = np.minimum(target(LOGITS[0], temperature, top_k), DRAFT_Q[0]).sum()  # acceptance rate
    assert abs(accepted_first / TRIALS - beta) < 4 * np.sqrt(beta * (1 - beta) / TRIALS)


def test_rejection_sampling_accepts_every_draft_when_q_equals_p():
    p = np.stack([target(row, 1.0) for row in LOGITS[:2]])
    s = state(SamplingParams(temperature=1.0), seed=5)
    drafter = np.random.default_rng(6)
    for _ in range(200):
        drafts = [int(drafter.choice(5, p=p[0])), int(drafter.choice(5, p=p[1]))]
        assert verify_rejection(LOGITS, drafts, p, s)[:2] == drafts


def test_rejection_rows_and_drafts_must_agree():
    with pytest.raises(ValueError, match="rows"):
        verify_rejection(LOGITS, [1, 2], DRAFT_Q[:1], state(SamplingParams()))
