"""Sampling parameters of one request, validated on construction.

Field names, defaults and allowed ranges follow the OpenAI API reference
(https://platform.openai.com/docs/api-reference/chat/create, /completions) and
vLLM's ``SamplingParams`` (vllm/sampling_params.py), so requests port over
unchanged. Invalid values raise ``ValueError`` with a message that names the
field and its allowed range; the API layer turns that into a 400 error whose
``param`` is the field name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.core.structured_outputs import StructuredOutputsParams

#: Largest ``logprobs`` / ``prompt_logprobs`` (OpenAI's limit for top logprobs).
MAX_LOGPROBS = 20
#: Largest ``n`` (completions per prompt). OpenAI documents no limit; every
#: sample is a sequence of its own in the batch, so a request may not take
#: more than this many of them (a request over it gets a 400 naming ``n``).
MAX_N = 16
#: ``seed`` must fit a signed 64-bit integer (as in vLLM); the generator is
#: seeded with ``seed mod 2**64``.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE_EPS = 1e-5
#: Smallest ``repetition_penalty``: positive logits are divided by it, so a
#: tiny one overflows them to inf.
MIN_REPETITION_PENALTY = 0.01


def _as_tuple(value: Any, field_name: str, item_type: type) -> tuple:
    """Normalize a list/tuple (or a lone item) to a tuple of ``item_type``."""
    if value is None:
        return ()
    if isinstance(value, item_type):
        value = (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{field_name} must be a list of {item_type.__name__}, got {value!r}")
    items = tuple(value)
    for item in items:
        if not isinstance(item, item_type) or isinstance(item, bool):
            raise ValueError(f"{field_name} must contain only {item_type.__name__} values, "
                             f"got {item!r}")
    return items


def _as_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """Normalize a ``{token_id: bias}`` mapping or pair sequence to sorted pairs."""
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, Mapping) else value
    out: dict[int, float] = {}
    for pair in pairs:
        try:
            token_id, bias = pair
            token_id, bias = int(token_id), float(bias)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"logit_bias must map token ids to numbers, got {pair!r}") from exc
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} "
                             f"for token {token_id}")
        out[token_id] = bias
    return tuple(sorted(out.items()))


def _check_range(name: str, value: float, low: float | None, high: float | None,
                 low_open: bool = False, text: str | None = None) -> None:
    """Raise ``ValueError`` unless ``low (<|<=) value <= high`` and ``value``
    is finite (JSON parses 1e309 as infinity: a temperature of inf sampled
    uniformly at random)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        if text is None:
            left = "(" if low_open else "["
            text = f"in {left}{low}, {high}]"
        raise ValueError(f"{name} must be {text}, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the tokens of one request (OpenAI / vLLM semantics).

    Fields (tokens are counted in tokens, not characters):

    - ``n``: completions per prompt, in [1, ``MAX_N``].
    - ``temperature``: >= 0; 0 means greedy. OpenAI documents [0, 2]; like vLLM
      we accept any non-negative value, and like vLLM's ``_SAMPLING_EPS`` a
      temperature below ``GREEDY_TEMPERATURE_EPS`` (1e-5) is greedy (stored
      as 0): dividing logits by a denormal gave inf and NaN.
    - ``top_p``: nucleus mass in (0, 1]; 1 disables it.
    - ``top_k``: keep the k most likely tokens; 0 or -1 disables it.
    - ``min_p``: in [0, 1]; drop tokens below ``min_p`` x the top probability.
    - ``seed``: per-request RNG seed (a signed 64-bit integer), or None for
      the engine's generator.
    - ``max_tokens``: most generated tokens (>= 1), or None for "up to the
      model's context length".
    - ``min_tokens``: EOS and ``stop_token_ids`` are ignored until this many
      tokens were generated (0 <= min_tokens <= max_tokens).
    - ``stop`` / ``stop_token_ids``: stop strings (handled by the
      detokenizer) and stop token ids (handled by the scheduler).
    - ``ignore_eos``: keep generating past EOS.
    - ``include_stop_str_in_output``: keep the matched stop string in the text.
    - ``logprobs``: top-k logprobs per generated token, in [0, 20] or None.
      The values are the log-softmax of the logits after logit bias,
      penalties and temperature (temperature 0 counts as 1: greedy rows are
      not scaled), as the OpenAI reference describes, under the engine's
      default ``--logprobs-mode processed_logprobs``.
    - ``prompt_logprobs``: top-k logprobs per prompt token, in [0, 20] or None
      (disables prefix-cache hits for the request: every prompt token's
      logits are needed). Same definition, without penalties (they depend
      on the generated tokens); the first prompt token has none.
    - ``presence_penalty`` / ``frequency_penalty``: in [-2, 2] (OpenAI).
    - ``repetition_penalty``: in [``MIN_REPETITION_PENALTY``, inf) (0.01);
      1 disables it (vLLM / HF semantics; both only require > 0, but a
      denormal penalty turned the logits it divides into inf).
    - ``logit_bias``: sorted ``(token_id, bias)`` pairs, bias in [-100, 100];
      a dict is accepted and normalized.
    - ``skip_special_tokens``: drop special tokens when detokenizing.
    - ``structured_outputs``: what the output must match (a JSON schema,
      regex, choice or grammar; ``kvserve.core.structured_outputs``), or None.
    - ``export_kv``: engine-internal, never set from an HTTP request: the
      prefill half of a disaggregated request, whose full prompt blocks the
      engine copies out when it finishes (``kvserve.core.kv_transfer``).

    Lists are accepted for the tuple fields and normalized to tuples, so the
    object stays hashable. Raises ``ValueError`` (never ``AssertionError``)
    naming the offending field and its allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    export_kv: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool) \
                and 0.0 < self.temperature < GREEDY_TEMPERATURE_EPS:
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids",
                           _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        object.__setattr__(self, "logit_bias", _as_logit_bias(self.logit_bias))
        self._check_ints()
        self._check_sampling()
        self._check_lengths()
        self._check_penalties()

    def _check_ints(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer or null, got {value!r}")

    def _check_sampling(self) -> None:
        _check_range("n", self.n, 1, MAX_N)
        _check_range("temperature", self.temperature, 0.0, None, text=">= 0")
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_range("top_k", self.top_k, -1, None,
                     text=">= -1 (0 or -1 disables top-k)")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_range(name, value, 0, MAX_LOGPROBS)

        if self.seed is not None:
            _check_range("seed", self.seed, SEED_MIN, SEED_MAX)

    def _check_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_range("max_tokens", self.max_tokens, 1, None, text=">= 1")
        high = self.max_tokens
        text = "in [0, max_tokens]" if high is not None else ">= 0"
        _check_range("min_tokens", self.min_tokens, 0, high, text=text)

    def _check_penalties(self) -> None:
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                     None, text=f">= {MIN_REPETITION_PENALTY}")

    @property
    def greedy(self) -> bool:
        """True when sampling is deterministic argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering applies (``top_k`` not 0 or -1)."""
        return self.top_k > 0
