"""How fast the waiting queue drains, for the ``Retry-After`` of a 429.

A refused client should come back when the queue has room for it: when as
many sequences (and prompt tokens) as it overflows the waiting limits by
have left the queue. ``DrainRate`` measures sequences and tokens released
per second over a sliding window and turns an overflow into seconds
(RFC 9110, section 10.2.3: ``Retry-After`` is how long the client ought to
wait). Pure arithmetic on the times it is given: no clock, no asyncio.
"""

from __future__ import annotations

import math
from collections import deque

#: Seconds of releases the rate is measured over.
WINDOW_SECONDS = 20.0
#: Bounds of the advice, in seconds: at least 1 (the header's unit), and a
#: stalled queue does not tell clients to go away for long.
MIN_RETRY_SECONDS, MAX_RETRY_SECONDS = 1.0, 60.0


class DrainRate:
    """Sequences and tokens leaving the waiting queue per second.

    ``record(now, sequences, tokens)`` after each release; ``retry_after(now,
    sequences, tokens)`` is the seconds until that many have left at the
    measured rate, in ``[MIN_RETRY_SECONDS, MAX_RETRY_SECONDS]``, or
    ``default`` while the window holds no release (nothing measured yet).
    Times are seconds on any monotonic clock.
    """

    def __init__(self, window_seconds: float = WINDOW_SECONDS) -> None:
        self.window = window_seconds
        self._releases: deque[tuple[float, int, int]] = deque()
        self._sequences = 0
        self._tokens = 0
        self._start: float | None = None  # first record: the rate's time base until a window passed

    def record(self, now: float, sequences: int, tokens: int) -> None:
        """``sequences`` sequences with ``tokens`` tokens to compute left the queue at ``now``."""
        if self._start is None:
            self._start = now
        if sequences:
            self._releases.append((now, sequences, tokens))
            self._sequences += sequences
            self._tokens += tokens
        self._expire(now)

    def rates(self, now: float) -> tuple[float, float] | None:
        """(sequences/s, tokens/s) over the window, or None with no release in it."""
        self._expire(now)
        if not self._releases or self._start is None:
            return None
        span = max(min(self.window, now - self._start), 1e-3)
        return self._sequences / span, self._tokens / span

    def retry_after(self, now: float, sequences: int, tokens: int, default: float) -> float:
        """Seconds until ``sequences`` sequences and ``tokens`` tokens have drained."""
        rates = self.rates(now)
        if rates is None:
            return default
        seq_rate, token_rate = rates
        seconds = max(sequences / seq_rate if sequences else 0.0,
                      tokens / token_rate if tokens and token_rate else 0.0)
        return min(MAX_RETRY_SECONDS, max(MIN_RETRY_SECONDS, math.ceil(seconds)))

    def _expire(self, now: float) -> None:
        while self._releases and self._releases[0][0] < now - self.window:
            _, sequences, tokens = self._releases.popleft()
            self._sequences -= sequences
            self._tokens -= tokens
