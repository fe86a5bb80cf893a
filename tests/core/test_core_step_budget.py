"""StepBudget: the token budget of a step from a step-time target (plain numbers)."""

import pytest

from kvserve.core.step_budget import StepBudget


def test_without_target_or_estimate_the_cap_holds():
    assert StepBudget(None, 2048).tokens(5) == 2048
    budget = StepBudget(0.5, 2048)
    assert budget.tokens(5) == 2048  # nothing measured yet
    budget.observe(1000, 2.0)
    assert StepBudget(None, 2048).tokens() == 2048


def test_budget_is_target_over_cost_per_token():
    budget = StepBudget(0.5, 2048)
    budget.observe(1000, 2.0)  # 2 ms per token
    assert budget.seconds_per_token == pytest.approx(0.002)
    assert budget.tokens(0) == 250
    assert budget.tokens(240) == 240 + budget.min_tokens  # decodes plus some prefill
    budget.observe(100, 0.1)  # 1 ms per token: moving average with weight 0.3
    assert budget.seconds_per_token == pytest.approx(0.002 + 0.3 * (0.001 - 0.002))
    assert budget.tokens(0) == int(0.5 / 0.0017)


def test_cap_floor_and_ignored_small_steps():
    budget = StepBudget(10.0, 512, min_tokens=32)
    budget.observe(64, 0.0064)  # 0.1 ms per token: 100,000 by time, capped
    assert budget.tokens(0) == 512
    slow = StepBudget(0.001, 512, min_tokens=32)
    slow.observe(64, 6.4)
    assert slow.tokens(3) == 35
    small = StepBudget(0.5, 512)
    small.observe(4, 1.0)  # a 4-token step is all overhead: not used
    small.observe(100, 0.0)
    assert small.seconds_per_token is None


@pytest.mark.parametrize("kwargs", [dict(max_step_seconds=0.0), dict(max_step_seconds=-1.0),
                                    dict(max_num_batched_tokens=0), dict(min_tokens=0),
                                    dict(smoothing=0.0), dict(smoothing=1.5)])
def test_bad_settings_are_refused(kwargs):
    args = dict(max_step_seconds=0.5, max_num_batched_tokens=2048) | kwargs
    with pytest.raises(ValueError):
        StepBudget(**args)
