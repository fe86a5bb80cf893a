"""Acceptance: every golden case through the in-process ``AsyncEngine``.

Checks, per ``shared/golden/README.md``: prompt token ids equal (from
``RequestAccepted``), first-step top-5 logits within 1e-3 (``raw_logits``
mode: logprob entries are logits), and greedy output token ids equal, a
divergence being accepted only where our own top-2 logits differ by < 1e-3.
"""

from __future__ import annotations

import pytest
from e2e_support import (
    EOS_ID,
    GOLDEN,
    assert_top5_close,
    first_divergence,
    make_request,
)

pytestmark = pytest.mark.model


def _request(entry: dict, request_id: str):
    case = entry["case"]
    return make_request(request_id, prompt=case.get("prompt"), messages=case.get("messages"),
                        max_tokens=case["max_tokens"], logprobs=5)


@pytest.mark.parametrize("entry", GOLDEN)
def test_golden_in_process(e2e_engine, entry: dict) -> None:
    name = entry["case"]["name"]
    result = e2e_engine.generate(_request(entry, f"golden-{name}"))

    assert result.failed is None, result.failed
    assert result.prompt_token_ids == tuple(entry["prompt_token_ids"])
    assert len(result.logprobs) == len(result.token_ids), "one logprob entry per output token"

    sampled, top = result.logprobs[0]
    assert len(top) == 5
    assert sampled == top[0][1], "greedy: the sampled token is the top-1"
    assert_top5_close(dict(top), entry["first_step_top5_ids"], entry["first_step_top5_logits"],
                      name)

    expected = entry["output_token_ids"]
    diverged = first_divergence(expected, result.token_ids, result.top2(), name)
    if diverged is None:
        assert result.text == entry["output_text"]
        want_reason = "stop" if expected[-1] == EOS_ID else "length"
        assert result.finish_reason == want_reason
