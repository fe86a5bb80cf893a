"""The soak's request plans: what one request is (``Plan``), what the
server is (``Target``), and the ordinary kinds of the mix: well-formed
generations (stream, plain, disconnect, slow, burst), malformed requests
(``bad``), prompts too long for the context (``oversized``), issue 47's
sample kinds (``samples``) and the probe stream. The hostile kinds are in
``kvserve.testing.soak_attacks``; what a right answer is, in
``kvserve.testing.soak_send``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from kvserve.bench.workload import synth_text


@dataclass(frozen=True)
class Plan:
    """One request to send and what a right answer is."""

    kind: str  # the mix kind (a burst's requests are "burst")
    label: str  # kind plus detail, e.g. "bad/unknown_model", "stream/chat"
    path: str
    body: dict | None = None
    raw: bytes | None = None  # sent as is instead of ``body`` (invalid JSON)
    wire: bytes | None = None  # a whole HTTP request sent as is on a new TCP connection
    stream: bool = False
    expect: str = "ok"  # see ``classify``
    max_tokens: int | None = None
    ignore_eos: bool = False
    hangup_after: int = 0  # stream events to read before hanging up (0: never)
    pause_s: float = 0.0  # pause after each stream event (slow client), seconds


@dataclass(frozen=True)
class Target:
    """What the request builders need to know about the server."""

    model: str | None
    max_model_len: int | None
    max_tokens: int = 32
    burst_size: int = 8


def text_body(chat: bool, prompt: str, model: str | None) -> dict:
    """A chat (``messages``) or completion (``prompt``) body of ``prompt``,
    naming ``model`` when it is known."""
    body: dict = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    if model:
        body["model"] = model
    return body


def generation_plan(kind: str, rng: random.Random, target: Target, *, stream: bool,
                    max_tokens: int | None = None, ignore_eos: bool | None = None) -> Plan:
    """A well-formed request of ``kind`` with a short prompt (4-24 words)."""
    chat = rng.random() < 0.5
    prompt = synth_text(rng.randint(4, 24), np.random.default_rng(rng.getrandbits(32)))
    tokens = max_tokens or rng.randint(1, target.max_tokens)
    eos = rng.random() < 0.5 if ignore_eos is None else ignore_eos
    body = {**text_body(chat, prompt, target.model), "max_tokens": tokens,
            "temperature": rng.choice([0.0, 0.7]), "stream": stream, "ignore_eos": eos}
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    label = f"{kind}/{'chat' if chat else 'completions'}"
    return Plan(kind, label, path, body, stream=stream, max_tokens=tokens, ignore_eos=eos)


def _bad_variants(chat: bool, good: dict) -> dict[str, dict | bytes]:
    """Malformed bodies (bytes: sent raw) by name; each must get a 4xx."""
    return {
        "invalid_json": b'{"model": "x", "messages": [',
        "not_object": b"[1, 2, 3]",
        "unknown_model": {**good, "model": "no-such-model-soak"},
        "negative_max_tokens": {**good, "max_tokens": -5},
        "string_max_tokens": {**good, "max_tokens": "ten"},
        "wrong_input_type": {"messages": "hello"} if chat else {"prompt": {"text": 1}},
        "missing_input": {"max_tokens": 4},
        "string_temperature": {**good, "temperature": "hot"},
        "top_p_out_of_range": {**good, "top_p": 1.5},
    }


def bad_plan(rng: random.Random, target: Target) -> Plan:
    """A malformed request (one of ``_bad_variants``) expecting a 4xx."""
    chat = rng.random() < 0.5
    good = {**text_body(chat, "Say hi.", target.model), "max_tokens": 4}
    variants = _bad_variants(chat, good)
    name = rng.choice(sorted(variants))
    value = variants[name]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    raw = value if isinstance(value, bytes) else None
    body = None if raw is not None else value
    return Plan("bad", f"bad/{name}", path, body, raw=raw, expect="4xx")


#: Characters per ``max_model_len`` token of an ``oversized/chars`` prompt (more
#: than any token of common tokenizers has, e.g. 81 for SmolLM2), and the most
#: characters sent (under ``kvserve serve``'s default 1 MiB ``--max-request-bytes``).
OVERSIZED_CHARS_PER_TOKEN, OVERSIZED_MAX_CHARS = 96, 900_000


def oversized_prompt(rng: random.Random, max_model_len: int) -> tuple[str, str]:
    """(variant, prompt) too long for ``max_model_len`` tokens: ``chars``, more
    characters than that many tokens can hold (kvserve refuses it before
    tokenizing), or ``tokens``, 2 x ``max_model_len`` + 64 common words (one
    token or more each)."""
    gen = np.random.default_rng(rng.getrandbits(32))
    chars = OVERSIZED_CHARS_PER_TOKEN * max_model_len
    if rng.random() < 0.5 and chars <= OVERSIZED_MAX_CHARS:
        unit = synth_text(64, gen) + " "
        return "chars", (unit * (chars // len(unit) + 1))[:chars]
    return "tokens", synth_text(2 * max_model_len + 64, gen)


def oversized_plan(rng: random.Random, target: Target) -> Plan:
    """A prompt that cannot fit in ``max_model_len`` (``oversized_prompt``): must get a 400."""
    chat = rng.random() < 0.5
    variant, prompt = oversized_prompt(rng, int(target.max_model_len or 0))
    body = {**text_body(chat, prompt, target.model), "max_tokens": 4,
            "stream": rng.random() < 0.5}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Plan("oversized", f"oversized/{variant}", path, body, stream=body["stream"],
                expect="400")


# Constraints: the server's default ``--structured-outputs-max-bytes`` (64 KiB, counted


def samples_plan(rng: random.Random, target: Target) -> Plan:
    """``n_echo`` or ``min_tokens_grammar`` (see ``kvserve.testing.soak``)."""
    prompt = synth_text(rng.randint(4, 24), np.random.default_rng(rng.getrandbits(32)))
    if rng.random() < 0.5:
        n, tokens = rng.randint(2, 4), rng.randint(2, 6)
        body = {**text_body(False, prompt, target.model), "n": n, "echo": True,
                "logprobs": 1, "max_tokens": tokens, "temperature": 0.7}
        return Plan("samples", "samples/n_echo", "/v1/completions", body, max_tokens=n * tokens)
    schema = {"name": "answer", "schema": {"type": "boolean"}}
    body = {**text_body(True, prompt, target.model), "max_tokens": 8, "min_tokens": 6,
            "temperature": 0.0, "response_format": {"type": "json_schema", "json_schema": schema}}
    return Plan("samples", "samples/min_tokens_grammar", "/v1/chat/completions", body,
                max_tokens=8)


def probe_plan(target: Target) -> Plan:
    """The probe: a chat stream of ``max_tokens`` tokens (EOS ignored)."""
    body = {**text_body(True, "Count slowly from one to one hundred.", target.model),
            "max_tokens": target.max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    return Plan("probe", "probe", "/v1/chat/completions", body, stream=True,
                max_tokens=target.max_tokens, ignore_eos=True)
