"""Bottleneck diagnosis: one set of rules for logs (``kvserve analyze``) and
live metrics (``kvserve diagnose``).

"It got slower" becomes one of four verdicts, each with its evidence:

- ``queueing``: TTFT rises with queue time -- offered load exceeds capacity.
  Queue time is most of TTFT (mean queue / mean TTFT >= 0.5), its p90 is at
  least 0.25 s, and (from logs) it moves with TTFT (correlation >= 0.5).
- ``prefill``: TTFT grows with prompt length -- prefill dominates. Prefill is
  most of TTFT (>= 0.5) and a large part of E2E (>= 0.3), its mean is at
  least 0.1 s, and (from logs) prompt lengths vary at least 2x (p90/p10) and
  TTFT correlates with prompt length (>= 0.6).
- ``kv_capacity``: KV usage stays high with preemptions -- KV-cache capacity
  limits concurrency. At least one preemption and KV usage at >= 0.9 at some
  point or >= 0.8 for half the samples.
- ``decode``: good TTFT with poor TPOT -- decode speed or prefill/decode
  interference. Neither TTFT verdict holds and TPOT is poor for most
  requests (p50 >= 1.5x and p90 >= 2x the best decile, p10), or ITL p90 >= 3x
  ITL p50 (metrics), and requests actually ran concurrently (with one
  request at a time there is no interference: uneven TPOT then points at the
  host, e.g. CPU contention, and the report says so without a verdict), with steps that mix prefill and decode
  slower than pure decode steps as supporting evidence when steps are known.

- ``target_missed``: the median TTFT or TPOT is above its target
  (``--ttft-target``, default ``TTFT_TARGET_S``; ``--tpot-target``, default
  ``TPOT_TARGET_S``), whatever the rules above found: a server that is
  uniformly slow (every request at 0.02 tokens/s, no queue, no spread) has
  no relative symptom, and a 9.7 s median TTFT is not "fine". It names what
  missed by how much and, when no other verdict explains it, the cause the
  shape points at (each step slow: the machine's compute, memory bandwidth
  or other load; or the prompts' prefill). Without finished requests
  (``kvserve diagnose`` over a short window) the TPOT is estimated from the
  window's output tokens per running request.

Verdicts come in precedence order (kv_capacity, queueing, prefill, decode,
target_missed): KV capacity is a cause of queueing, so it is named first
when both hold. An empty list means no bottleneck: the server is lightly
loaded and within its targets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

QUEUE_SHARE = 0.5
QUEUE_P90_FLOOR_S = 0.25
QUEUE_CORR = 0.5
PREFILL_SHARE_TTFT = 0.5
PREFILL_SHARE_E2E = 0.3
PREFILL_FLOOR_S = 0.1
PROMPT_CORR = 0.6
PROMPT_SPREAD = 2.0
#: Default latency targets (seconds): a first token within 2 s, and 10
#: output tokens/s per request (TPOT 0.1 s), about reading speed. vLLM's
#: benchmark takes them as ``--goodput ttft:MS tpot:MS`` with no default;
#: these are kvserve's, stated in every ``target_missed`` verdict.
TTFT_TARGET_S = 2.0
TPOT_TARGET_S = 0.1
KV_MAX = 0.9
KV_HIGH = 0.8
KV_HIGH_FRACTION = 0.5
TPOT_SPREAD = 2.0
TPOT_MEDIAN_SPREAD = 1.5
ITL_SPREAD = 3.0


@dataclass
class Features:
    """What the rules look at; None where the source cannot tell.

    Times in seconds, shares are fractions, KV usage 0..1.
    """

    source: str
    num_requests: int = 0
    ttft_mean: float | None = None
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    e2e_mean: float | None = None
    queue_mean: float | None = None
    queue_p50: float | None = None
    queue_p90: float | None = None
    queue_ttft_corr: float | None = None
    queue_first_third_mean: float | None = None
    queue_last_third_mean: float | None = None
    max_waiting: float | None = None
    prefill_mean: float | None = None
    prompt_tokens_mean: float | None = None
    prompt_ttft_corr: float | None = None
    prompt_spread: float | None = None
    ttft_per_1k_prompt_tokens: float | None = None
    preemptions: int = 0
    preempted_requests: int | None = None
    kv_usage_max: float | None = None
    kv_high_fraction: float | None = None
    kv_usage_mean: float | None = None
    tpot_p10: float | None = None
    tpot_p50: float | None = None
    tpot_p90: float | None = None
    itl_p50: float | None = None
    itl_p90: float | None = None
    decode_step_s: float | None = None
    max_concurrency: float | None = None
    mixed_step_s: float | None = None
    #: Output tokens/s per running request over the window (metrics), for
    #: a window in which nothing finished.
    decode_rate_per_request: float | None = None
    ttft_target: float = TTFT_TARGET_S
    tpot_target: float = TPOT_TARGET_S
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def queue_share(self) -> float | None:
        return _ratio(self.queue_mean, self.ttft_mean)

    @property
    def prefill_share_of_ttft(self) -> float | None:
        return _ratio(self.prefill_mean, self.ttft_mean)

    @property
    def prefill_share_of_e2e(self) -> float | None:
        return _ratio(self.prefill_mean, self.e2e_mean)


@dataclass(frozen=True)
class Verdict:
    """One diagnosed bottleneck: ``kind``, a sentence, and the numbers behind it."""

    kind: str
    title: str
    summary: str
    evidence: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def markdown(self) -> str:
        lines = [f"### {self.title} (`{self.kind}`)", "", self.summary, ""]
        lines += [f"- {key}: {_fmt(value)}" for key, value in self.evidence.items()]
        return "\n".join(lines)


def diagnose(f: Features) -> list[Verdict]:
    """Apply the rules; verdicts in precedence order ([] = no bottleneck)."""
    verdicts = []
    kv = _kv_rule(f)
    if kv is not None:
        verdicts.append(kv)
    queue = _queue_rule(f)
    if queue is not None:
        verdicts.append(queue)
    prefill = _prefill_rule(f)
    if prefill is not None:
        verdicts.append(prefill)
    if queue is None and prefill is None:
        decode = _decode_rule(f)
        if decode is not None:
            verdicts.append(decode)
    target = _target_rule(f, explained=bool(verdicts))
    if target is not None:
        verdicts.append(target)
    return verdicts


def _target_rule(f: Features, explained: bool) -> Verdict | None:
    """``target_missed`` (module docstring); ``explained``: another verdict
    already names a cause."""
    tpot, tpot_source = f.tpot_p50, "tpot_p50_s"
    if tpot is None and f.decode_rate_per_request:
        tpot, tpot_source = 1.0 / f.decode_rate_per_request, "tpot_from_token_rate_s"
    misses = []
    if f.ttft_p50 is not None and f.ttft_p50 > f.ttft_target:
        misses.append(f"the median TTFT is {f.ttft_p50:.2f} s against a target of "
                      f"{f.ttft_target:g} s")
    if tpot is not None and tpot > f.tpot_target:
        misses.append(f"the median TPOT is {tpot:.3f} s ({1 / tpot:.2f} tokens/s per request) "
                      f"against a target of {f.tpot_target:g} s")
    if not misses:
        return None
    if explained:
        why = "The verdicts above say why."
    elif tpot is not None and tpot > f.tpot_target:
        why = ("No queue, KV pressure or uneven spread explains it: every step is slow for "
               "every request alike. The model is too large for this machine's compute or "
               "memory bandwidth at this concurrency, or other processes take the CPU/GPU "
               "(compare the load average, and `kvserve plan`); fewer concurrent sequences, "
               "a smaller or quantized model (-q), or more cores help.")
    else:
        why = ("No queue explains it: the prompts' prefill itself takes longer than the "
               "target; shorter prompts, prefix caching of shared prefixes, or a faster "
               "machine help.")
    evidence = _drop_none({"ttft_p50_s": f.ttft_p50, "ttft_target_s": f.ttft_target,
                           tpot_source: tpot, "tpot_target_s": f.tpot_target,
                           "requests": f.num_requests})
    return Verdict("target_missed", "Latency targets missed",
                   f"{'; '.join(misses)[:1].upper()}{'; '.join(misses)[1:]}. {why}", evidence)


def _kv_rule(f: Features) -> Verdict | None:
    if f.preemptions < 1:
        return None
    high = ((f.kv_usage_max is not None and f.kv_usage_max >= KV_MAX)
            or (f.kv_high_fraction is not None and f.kv_high_fraction >= KV_HIGH_FRACTION))
    if not high and (f.kv_usage_max is not None or f.kv_high_fraction is not None):
        return None
    evidence = _drop_none({
        "preemptions": f.preemptions, "preempted_requests": f.preempted_requests,
        "requests": f.num_requests, "kv_usage_max": f.kv_usage_max,
        "kv_usage_mean": f.kv_usage_mean,
        f"fraction_of_samples_kv_usage>={KV_HIGH}": f.kv_high_fraction,
        "queue_p90_s": f.queue_p90, "max_waiting": f.max_waiting})
    return Verdict(
        "kv_capacity", "KV-cache capacity limits concurrency",
        f"KV usage stays high ({_pct(f.kv_usage_max)} at peak) and {f.preemptions} "
        "preemption(s) by recompute happened: the KV cache cannot hold the batch the "
        "scheduler wants, so requests wait and recompute. More KV memory, a shorter "
        "max_model_len or fewer concurrent sequences (max_num_seqs) help.", evidence)


def _queue_rule(f: Features) -> Verdict | None:
    share = f.queue_share
    if share is None or f.queue_p90 is None:
        return None
    if share < QUEUE_SHARE or f.queue_p90 < QUEUE_P90_FLOOR_S:
        return None
    if f.queue_ttft_corr is not None and f.queue_ttft_corr < QUEUE_CORR:
        return None
    evidence = _drop_none({
        "queue_share_of_ttft": share, "queue_p50_s": f.queue_p50, "queue_p90_s": f.queue_p90,
        "ttft_p50_s": f.ttft_p50, "ttft_p90_s": f.ttft_p90,
        "corr(queue, ttft)": f.queue_ttft_corr,
        "queue_mean_first_third_of_arrivals_s": f.queue_first_third_mean,
        "queue_mean_last_third_of_arrivals_s": f.queue_last_third_mean,
        "max_waiting": f.max_waiting, "requests": f.num_requests})
    return Verdict(
        "queueing", "Offered load exceeds capacity (queueing)",
        f"TTFT rises with queue time: queueing is {_pct(share)} of TTFT (p90 queue "
        f"{_s(f.queue_p90)}). Requests arrive faster than the engine finishes them; add "
        "capacity, raise max_num_seqs if KV allows, or shed load (--max-waiting-requests).",
        evidence)


def _prefill_rule(f: Features) -> Verdict | None:
    share_ttft, share_e2e = f.prefill_share_of_ttft, f.prefill_share_of_e2e
    if share_ttft is None or share_e2e is None or f.prefill_mean is None:
        return None
    if (share_ttft < PREFILL_SHARE_TTFT or share_e2e < PREFILL_SHARE_E2E
            or f.prefill_mean < PREFILL_FLOOR_S):
        return None
    if f.source == "logs":  # per-request data: TTFT must grow with prompt length
        if (f.prompt_spread is None or f.prompt_spread < PROMPT_SPREAD
                or f.prompt_ttft_corr is None or f.prompt_ttft_corr < PROMPT_CORR):
            return None
    evidence = _drop_none({
        "prefill_share_of_ttft": share_ttft, "prefill_share_of_e2e": share_e2e,
        "prefill_mean_s": f.prefill_mean, "ttft_p50_s": f.ttft_p50, "ttft_p90_s": f.ttft_p90,
        "corr(prompt_tokens, ttft)": f.prompt_ttft_corr,
        "ttft_s_per_1k_prompt_tokens": f.ttft_per_1k_prompt_tokens,
        "prompt_tokens_mean": f.prompt_tokens_mean,
        "prompt_length_spread_p90/p10": f.prompt_spread, **f.extra.get("ttft_by_bucket", {})})
    return Verdict(
        "prefill", "Prefill dominates (long prompts)",
        f"TTFT grows with prompt length: prefill is {_pct(share_ttft)} of TTFT and "
        f"{_pct(share_e2e)} of E2E (mean {_s(f.prefill_mean)}). Prefix caching of shared "
        "prefixes, shorter prompts, or a smaller --max-num-batched-tokens (so decodes are "
        "not stalled behind long prefill chunks) help.", evidence)


def _decode_rule(f: Features) -> Verdict | None:
    if f.max_concurrency is not None and f.max_concurrency <= 1:
        return None  # one request at a time: nothing to interfere; see host_note()
    # Most requests (the median, not one outlier) are slower than the best decile.
    tpot_uneven = (f.tpot_p10 is not None and f.tpot_p50 is not None and f.tpot_p90 is not None
                   and f.tpot_p10 > 0 and f.tpot_p50 >= TPOT_MEDIAN_SPREAD * f.tpot_p10
                   and f.tpot_p90 >= TPOT_SPREAD * f.tpot_p10)
    itl_uneven = (f.itl_p50 is not None and f.itl_p90 is not None and f.itl_p50 > 0
                  and f.itl_p90 >= ITL_SPREAD * f.itl_p50)
    if not (tpot_uneven or itl_uneven):
        return None
    evidence = _drop_none({
        "ttft_p50_s": f.ttft_p50, "ttft_p90_s": f.ttft_p90, "tpot_p10_s": f.tpot_p10,
        "tpot_p50_s": f.tpot_p50, "tpot_p90_s": f.tpot_p90, "itl_p50_s": f.itl_p50,
        "itl_p90_s": f.itl_p90, "decode_only_step_mean_s": f.decode_step_s,
        "mixed_prefill_decode_step_mean_s": f.mixed_step_s})
    return Verdict(
        "decode", "Decode speed or prefill/decode interference",
        "TTFT is fine but TPOT is poor and uneven: decode steps are slow or stalled by "
        "prefill chunks sharing the step. A smaller --max-num-batched-tokens (shorter "
        "prefill chunks) or fewer concurrent sequences help.", evidence)


def host_note(f: Features) -> str | None:
    """A note (not a verdict) when TPOT is uneven although requests never
    overlapped: the host, not the engine's batching, was slow."""
    if f.max_concurrency is None or f.max_concurrency > 1:
        return None
    if (f.tpot_p10 and f.tpot_p50 and f.tpot_p90 and f.tpot_p50 >= TPOT_MEDIAN_SPREAD * f.tpot_p10
            and f.tpot_p90 >= TPOT_SPREAD * f.tpot_p10):
        return (f"TPOT is uneven (p10 {f.tpot_p10:.3f} s, p50 {f.tpot_p50:.3f} s, p90 "
                f"{f.tpot_p90:.3f} s) although requests ran one at a time: the host was slow "
                "or contended (other processes on the CPU/GPU), not the engine's batching.")
    return None


# ---------------------------------------------------------------- helpers


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()
            if v is not None}


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x * 100:.0f}%"


def _s(x: float | None) -> str:
    return "?" if x is None else f"{x:.3f} s"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ------------------------------------------------------- metrics scrapes

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _sum(samples: Samples, name: str, **match: str) -> float:
    return sum(v for labels, v in samples.get(name, ())
               if all(labels.get(k) == want for k, want in match.items()))


def _buckets(samples: Samples, name: str) -> list[tuple[float, float]]:
    out: dict[float, float] = {}
    for labels, value in samples.get(name + "_bucket", ()):
        le = float(labels["le"])
        out[le] = out.get(le, 0.0) + value
    return sorted(out.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``(le, count)`` buckets."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def features_from_scrapes(before: Samples, after: Samples, prefix: str = "kvserve:",
                          seconds: float | None = None) -> Features:
    """Features of the window between two ``/metrics`` scrapes (deltas of
    counters and histograms; gauges as the max of the two scrapes);
    ``seconds``: the window's length, for the output tokens/s per running
    request."""

    def delta(name: str) -> float:
        return _sum(after, prefix + name) - _sum(before, prefix + name)

    def mean(name: str) -> float | None:
        count = delta(name + "_count")
        return delta(name + "_sum") / count if count > 0 else None

    def dbuckets(name: str) -> list[tuple[float, float]]:
        b0 = dict(_buckets(before, prefix + name))
        return [(le, c - b0.get(le, 0.0)) for le, c in _buckets(after, prefix + name)]

    def gauge(name: str) -> float | None:
        values = [_sum(s, prefix + name) for s in (before, after) if prefix + name in s]
        return max(values) if values else None

    queue_b, ttft_b = dbuckets("request_queue_time_seconds"), dbuckets("time_to_first_token_seconds")
    tpot_b, itl_b = dbuckets("request_time_per_output_token_seconds"), \
        dbuckets("inter_token_latency_seconds")
    kv_max = gauge("kv_cache_usage_perc")
    running = gauge("num_requests_running")
    generated = delta("generation_tokens_total")
    rate = (generated / seconds / running if seconds and running and generated > 0
            else None)
    return Features(
        source="metrics",
        num_requests=int(delta("e2e_request_latency_seconds_count")),
        ttft_mean=mean("time_to_first_token_seconds"),
        ttft_p50=histogram_quantile(0.5, ttft_b), ttft_p90=histogram_quantile(0.9, ttft_b),
        e2e_mean=mean("e2e_request_latency_seconds"),
        queue_mean=mean("request_queue_time_seconds"),
        queue_p50=histogram_quantile(0.5, queue_b), queue_p90=histogram_quantile(0.9, queue_b),
        max_waiting=gauge("num_requests_waiting"),
        prefill_mean=mean("request_prefill_time_seconds"),
        prompt_tokens_mean=mean("request_prompt_tokens"),
        preemptions=int(delta("num_preemptions_total")),
        kv_usage_max=kv_max,
        # the gauges at the two scrapes: one request at a time has nothing to interfere with
        max_concurrency=gauge("num_requests_running"),
        tpot_p10=histogram_quantile(0.1, tpot_b), tpot_p50=histogram_quantile(0.5, tpot_b),
        tpot_p90=histogram_quantile(0.9, tpot_b),
        itl_p50=histogram_quantile(0.5, itl_b), itl_p90=histogram_quantile(0.9, itl_b),
        decode_rate_per_request=rate,
        extra={"generation_tokens": generated,
               "prompt_tokens": delta("prompt_tokens_total"),
               "prefix_cache_queries": delta("prefix_cache_queries_total"),
               "prefix_cache_hits": delta("prefix_cache_hits_total"),
               "running": gauge("num_requests_running")})


def busy_summary(features: Features, seconds: float) -> str | None:
    """What a window without a verdict was doing, from gauges and token
    counters rather than finished requests, or None when it was idle.

    A request running at one token per second finishes nothing in a short
    window; "lightly loaded" would be wrong about it (issue 15, item 5).
    """
    running = int(features.extra.get("running") or 0)
    waiting = int(features.max_waiting or 0)
    generated = features.extra.get("generation_tokens") or 0.0
    prompt = features.extra.get("prompt_tokens") or 0.0
    if not (running or waiting or generated or prompt):
        return None
    rate = generated / seconds if seconds > 0 else 0.0
    per_request = f", {rate / running:.2f} tokens/s per running request" if running else ""
    kv = features.kv_usage_max
    kv_text = f", KV cache {kv:.0%} used" if kv is not None else ""
    return (f"Busy: {running} running, {waiting} waiting; {generated:,.0f} output tokens "
            f"({rate:,.1f}/s{per_request}) and {prompt:,.0f} prompt tokens in the window"
            f"{kv_text}. No latency verdict: {features.num_requests} request(s) finished in "
            "the window; a longer --interval sees more.")
