"""Token budget per step from a step-time target (``--max-step-ms``).

Every running stream waits for the whole step between two of its tokens, so
a step's duration is the inter-token latency (ITL) of every decoding request
in it. A fixed ``max_num_batched_tokens`` trades ITL for TTFT blindly: a
2,048-token prefill chunk takes seconds on a CPU. With a step-time target,
the scheduler sizes each step's budget from the measured cost per token, so
long prompts are split into chunks that keep ITL near the target whatever
the prompt lengths (the goal of vLLM's chunked prefill, with the chunk
chosen by time instead of a token count).

Cost model: a step of T tokens takes about ``T * c`` seconds, where ``c`` is
an exponential moving average of ``seconds / tokens`` over steps of at least
``min_observed_tokens`` tokens (smaller steps are dominated by fixed
overheads and would inflate ``c``). ``c`` includes the fixed per-step cost,
so the estimate errs on the short side. Pure logic: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepBudget:
    """Sizes each step's token budget to about ``max_step_seconds``.

    Args:
        max_step_seconds: the target step duration in seconds; None turns
            the budget off (always ``max_num_batched_tokens``).
        max_num_batched_tokens: the hard cap (tokens).
        min_tokens: the smallest budget (tokens), so that prefill always
            progresses even when the estimate is pessimistic.
        smoothing: weight of the newest observation in the moving average.
        min_observed_tokens: steps with fewer tokens do not update the cost.

    Raises:
        ValueError: a non-positive target, cap, ``min_tokens`` or a smoothing
            outside (0, 1].
    """

    max_step_seconds: float | None
    max_num_batched_tokens: int
    min_tokens: int = 32
    smoothing: float = 0.3
    min_observed_tokens: int = 16
    seconds_per_token: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.max_step_seconds is not None and not self.max_step_seconds > 0:
            raise ValueError(f"max_step_seconds must be > 0, got {self.max_step_seconds}")
        if self.max_num_batched_tokens < 1 or self.min_tokens < 1:
            raise ValueError("max_num_batched_tokens and min_tokens must be >= 1")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Account a finished step of ``num_tokens`` tokens that took ``seconds``."""
        if num_tokens < self.min_observed_tokens or seconds <= 0.0:
            return
        cost = seconds / num_tokens
        if self.seconds_per_token is None:
            self.seconds_per_token = cost
        else:
            self.seconds_per_token += self.smoothing * (cost - self.seconds_per_token)

    def tokens(self, num_decodes: int = 0) -> int:
        """The next step's token budget (tokens).

        ``max_num_batched_tokens`` until a cost is known or when no target is
        set; else ``target / cost``, at least ``num_decodes + min_tokens``
        (every running decode gets its token, and prefill still progresses)
        and at most ``max_num_batched_tokens``.
        """
        cap = self.max_num_batched_tokens
        if self.max_step_seconds is None or self.seconds_per_token is None:
            return cap
        by_time = int(self.max_step_seconds / self.seconds_per_token)
        return min(cap, max(by_time, num_decodes + self.min_tokens))
