"""SamplingParams validation (OpenAI / vLLM ranges)."""

import pytest

from kvserve.core.sampling_params import SamplingParams


def test_defaults_are_valid_and_not_greedy():
    params = SamplingParams()
    assert params.max_tokens == 16 and params.n == 1
    assert not params.greedy and not params.top_k_enabled


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(top_k=1), dict(temperature=0)])
def test_greedy(kwargs):
    assert SamplingParams(**kwargs).greedy


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", -0.1), ("min_p", 1.1), ("max_tokens", 0),
    ("min_tokens", -1), ("presence_penalty", 2.5), ("frequency_penalty", -2.1),
    ("repetition_penalty", 0.0), ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21),
    ("n", 1.5), ("max_tokens", "3"), ("seed", 1.0),
])
def test_out_of_range_raises_value_error_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_not_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_allowed_values(top_k):
    assert SamplingParams(top_k=top_k).top_k == top_k


def test_lists_normalized_to_tuples_and_hashable():
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[5], logit_bias={7: 1.0, 3: -2})
    assert params.stop == ("a", "b") and params.stop_token_ids == (5,)
    assert params.logit_bias == ((3, -2.0), (7, 1.0))
    assert SamplingParams(stop="x").stop == ("x",)
    hash(params)


def test_bad_container_contents():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=["a"])
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[1])


def test_frozen():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize("temperature", [1e-38, 1e-320, 9.99e-6])
def test_a_temperature_below_the_epsilon_is_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0 and params.greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5  # the epsilon itself samples


@pytest.mark.parametrize("penalty", [1e-320, 0.009])
def test_a_repetition_penalty_below_the_bound_is_refused(penalty):
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=penalty)
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01


@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty",
                                  "repetition_penalty"])
def test_infinite_values_are_refused(name):
    """JSON parses 1e309 as infinity: a temperature of inf sampled uniformly."""
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: float("inf")})
