"""Admission's waiting-load estimate: built from messages only, never low."""

from kvserve.actors.admission import WaitingEstimate
from kvserve.actors.messages import QueueLoad


def test_in_transit_requests_count_until_the_scheduler_reports_them():
    estimate = WaitingEstimate()
    assert estimate.load() == (0, 0)
    for tokens in (10, 20, 30):  # a burst: nothing reported yet
        estimate.sent(tokens)
    assert estimate.load() == (3, 60)
    # The scheduler queued the first two; one of them was admitted to run.
    estimate.report = QueueLoad(waiting_requests=1, waiting_tokens=20, queued_requests=2,
                                queued_tokens=30)
    assert estimate.load() == (1 + 1, 20 + 30)
    estimate.report = QueueLoad(0, 0, 3, 60)  # all queued and running
    assert estimate.load() == (0, 0)


def test_a_stale_report_overestimates():
    """A report older than the queue's shrinking errs on the full side."""
    estimate = WaitingEstimate()
    estimate.sent(5)
    estimate.report = QueueLoad(1, 5, 1, 5)  # then the request ran, unreported
    assert estimate.load() == (1, 5)
