"""Request state and stop checks."""

import pytest

from kvserve.core.request import FinishReason, Request, RequestStatus, check_stop
from kvserve.core.sampling_params import SamplingParams

EOS = 2


def make(max_tokens=16, min_tokens=0, stop_token_ids=(), ignore_eos=False, prompt=(10, 11, 12),
         max_model_len=None):
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    return Request("r", list(prompt), params, eos_token_ids=(EOS,), max_model_len=max_model_len)


def test_token_views():
    req = make()
    req.append_output_token_ids(5)
    req.append_output_token_ids([6, 7])
    assert req.all_token_ids == [10, 11, 12, 5, 6, 7]
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (6, 3, 3)
    assert req.prompt_token_ids == (10, 11, 12)
    assert req.num_cached_tokens == -1 and req.status is RequestStatus.WAITING


def test_status_and_finish_reason_mapping():
    assert RequestStatus.FINISHED_STOPPED.finish_reason is FinishReason.STOP
    assert RequestStatus.FINISHED_LENGTH.finish_reason.value == "length"
    assert str(FinishReason.ABORT) == "abort"
    assert not RequestStatus.RUNNING.is_finished and RequestStatus.PREEMPTED.finish_reason is None
    assert all(RequestStatus.from_finish_reason(r).finish_reason is r for r in FinishReason)


def test_no_stop_without_output():
    assert check_stop(make()) is None


def test_eos_stops():
    req = make()
    req.append_output_token_ids([5, EOS])
    assert check_stop(req) is FinishReason.STOP


def test_ignore_eos():
    req = make(ignore_eos=True)
    req.append_output_token_ids([EOS])
    assert check_stop(req) is None


def test_min_tokens_suppresses_eos_and_stop_ids():
    req = make(min_tokens=3, stop_token_ids=(9,))
    req.append_output_token_ids([EOS])
    assert check_stop(req) is None
    req.append_output_token_ids([9])
    assert check_stop(req) is None
    req.append_output_token_ids([9])
    assert check_stop(req) is FinishReason.STOP


def test_stop_token_ids():
    req = make(stop_token_ids=(9,))
    req.append_output_token_ids([9])
    assert check_stop(req) is FinishReason.STOP


def test_max_tokens_length():
    req = make(max_tokens=2)
    req.append_output_token_ids([5])
    assert check_stop(req) is None
    req.append_output_token_ids([6])
    assert check_stop(req) is FinishReason.LENGTH


def test_eos_on_last_allowed_token_reports_stop():
    req = make(max_tokens=1)
    req.append_output_token_ids([EOS])
    assert check_stop(req) is FinishReason.STOP


def test_max_model_len_length():
    req = make(max_tokens=None, max_model_len=5)
    req.append_output_token_ids([5])
    assert check_stop(req) is None
    req.append_output_token_ids([6])
    assert check_stop(req) is FinishReason.LENGTH


def test_bad_inputs():
    with pytest.raises(ValueError):
        Request(1, [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Request("x", [1.5])  # type: ignore[list-item]
