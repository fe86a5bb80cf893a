"""``FaultInjection``: the test-only fault plan (``kvserve.testing.faults``) parses
its JSON strictly and picks the steps it says."""

import pytest

from kvserve.cli import build_parser
from kvserve.testing.faults import FaultInjection


def test_every_tenth_step_fails() -> None:
    faults = FaultInjection(step_every=10)
    assert [s for s in range(35) if faults.step_fails(s, ("a",))] == [9, 19, 29]


def test_a_named_request_fails_its_steps_and_its_samples_count() -> None:
    faults = FaultInjection(request_ids=frozenset({"bad"}))
    assert faults.step_fails(3, ("ok", "bad"))
    assert faults.step_fails(3, ("bad-1",))  # sample 1 of request "bad" (n > 1)
    assert not faults.step_fails(3, ("ok", "badge"))


def test_off_by_default() -> None:
    faults = FaultInjection()
    assert not faults.faults_steps and faults.kill_actor is None
    assert not any(faults.step_fails(s, ("a",)) for s in range(100))
    assert build_parser().parse_args(["serve"]).fault_injection is None


@pytest.mark.parametrize("text, word", [
    ('{"step_evry": 3}', "unknown"),
    ('{"kill_actor": "planner"}', "kill_actor"),
    ('{"step_every": -1}', ">= 0"),
    ('[1]', "object"),
])
def test_bad_plans_are_refused_with_the_reason(text: str, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        FaultInjection.from_json(text)


def test_the_cli_flag_parses_json() -> None:
    args = build_parser().parse_args(
        ["serve", "--fault-injection", '{"request_ids": ["r1"], "step_delay_seconds": 0.5}'])
    assert args.fault_injection == FaultInjection(request_ids=frozenset({"r1"}),
                                                  step_delay_seconds=0.5)
