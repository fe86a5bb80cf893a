"""Soak test: bounded mixed traffic against a server on loopback, then leak checks.

``--concurrency`` workers (seeded, each with its own random stream) send, until
``--duration`` seconds or ``--max-requests`` requests, a mix of: streaming and
non-streaming requests to ``/v1/chat/completions`` and ``/v1/completions``
with short prompts and 1..``--max-tokens`` tokens; streams the client hangs up
on after 1-2 chunks; bad requests (invalid JSON, unknown model, negative
``max_tokens``, wrong types, ...) that must get a 4xx; bursts of
``--burst-size`` requests at once; prompts too long for ``max_model_len``
(from ``GET /v1/models``) that must get a 400; slow clients that pause
between chunks; and three hostile kinds, a few percent each:

- ``constraint``: a chat (``max_tokens`` 4-8, temperature 0) with a
  structured-output constraint in one of ``guided_json``,
  ``response_format`` (``json_schema``), ``guided_regex``,
  ``guided_choice``, ``guided_grammar`` or ``tools`` (with ``tool_choice:
  "required"``): ``oversized`` (70-100 KB, over kvserve's default
  ``--structured-outputs-max-bytes`` of 64 KiB) and ``invalid`` (a small
  one that does not compile, e.g. ``{"type": "nonsense"}``) must get a
  400; ``large`` (40-56 KB, valid, salted so that the server's compile
  cache never has it: each one costs a real compile; not in ``tools``, whose
  schemas also go into the prompt) must complete;
- ``smuggle``: request smuggling on a raw TCP connection: a ``POST
  /v1/completions`` with both ``Content-Length`` and ``Transfer-Encoding``
  (``chunked``, ``gzip, chunked`` or ``transfer-encoding: Chunked``; either
  header first) whose body hides a ``GET /v1/models``. Everything up to the
  server's close must be exactly one response, a 400;
- ``flood``: a chat of more messages than ``max_model_len`` tokens can hold
  (``max_model_len`` + 1..1000, sometimes 20,000; under 1 MB of JSON): a 400;
- ``samples`` (issue 47's request kinds): ``n_echo``, a completion of n =
  2-4 samples with ``echo`` and ``logprobs`` (one prompt pass for all: item
  4), and ``min_tokens_grammar``, a chat whose boolean schema is done
  before its ``min_tokens`` (it must stop, not pad: item 5); both complete.

A probe stream runs throughout; its inter-token latencies (ITL) are
reported as p50/p99. Kinds that need ``max_model_len`` (``oversized``,
``flood``) send a normal stream when it is unknown.

Every request gets one outcome: ``complete`` (200 and a full answer; a stream
ends with ``[DONE]``), ``4xx`` (a bad request refused as it should be),
``429/503`` (refused for load: acceptable), ``disconnect`` (we hung up on
purpose), or a failure: ``5xx``, ``transport_error`` (for a smuggling attempt:
also a close with no response), ``timeout`` (for a smuggling attempt: also no
close by the deadline), ``unexpected_4xx`` (a 4xx for a well-formed request,
or another 4xx than the 400 expected), ``unexpected_2xx`` (a bad request
accepted), ``bad_body`` (a 200 with a malformed body or stream; bytes that
are no HTTP response), ``smuggled`` (more than one response to a smuggling
attempt: the hidden request ran). The check ``accounted`` fails unless the
outcomes are exactly as many as the requests sent (probe included).

After the load, waiting on each condition up to ``--settle-timeout`` seconds:
``/health`` is 200; the gauges ``kvserve:num_requests_running`` and
``kvserve:num_requests_waiting`` are 0 and ``kvserve:kv_cache_usage_perc`` is
back to its baseline; the server's open file descriptors are back to their
baseline (+``--fd-tolerance``); peak RSS minus the RSS after warm-up is at
most ``--max-rss-growth-mib`` (the CPU backend commits its KV cache at
start-up, so the baseline holds it). The fd and RSS checks need
the server's pid (known when the soak starts the server, else ``--server-pid``).

Exit status: 0 when every check passes and no request failed, 1 otherwise,
2 for bad usage (e.g. a ``--url`` that is not on loopback).

    python tools/soak.py --duration 60
    python tools/soak.py --url http://127.0.0.1:8000 --server-pid 1234 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from kvserve.bench import BENCH_VERSION
from kvserve.bench.workload import synth_text

#: Every outcome class, in table order.
OUTCOMES = ("complete", "4xx", "429/503", "disconnect", "5xx", "transport_error", "timeout",
            "unexpected_4xx", "unexpected_2xx", "bad_body", "smuggled")
#: The outcomes that fail the soak.
FAILURES = frozenset({"5xx", "transport_error", "timeout", "unexpected_4xx", "unexpected_2xx",
                      "bad_body", "smuggled"})
#: Default traffic mix (relative weights of the request kinds).
DEFAULT_MIX = {"stream": 0.3, "plain": 0.2, "disconnect": 0.1, "bad": 0.15, "burst": 0.05,
               "oversized": 0.05, "slow": 0.15, "constraint": 0.04, "smuggle": 0.03,
               "flood": 0.03, "samples": 0.03}
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
GAUGES = ("kvserve:num_requests_running", "kvserve:num_requests_waiting",
          "kvserve:kv_cache_usage_perc")
MIB = 1024 * 1024


# --------------------------------------------------------------------------- pure parts


def loopback_error(url: str) -> str | None:
    """Why ``url`` may not be soaked (not http(s), or a host other than
    127.0.0.1 / localhost / ::1), or None when it may."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"--url must be an http(s) URL, got {url!r}"
    if (parts.hostname or "").lower() not in LOOPBACK_HOSTS:
        return (f"--url host {parts.hostname!r} is not loopback: the soak only runs "
                "against 127.0.0.1, localhost or ::1")
    return None


def classify(expect: str, status: int | None, *, error: str | None = None,
             body_ok: bool = True, hung_up: bool = False) -> str:
    """The outcome class of one request (see the module doc).

    Args:
        expect: ``"ok"`` (well-formed), ``"4xx"`` (any 4xx is right) or
            ``"400"`` (exactly 400 is right, e.g. an oversized prompt).
        status: the HTTP status, None when no response came.
        error: ``"timeout"`` or ``"transport_error"`` when the request raised.
        body_ok: whether a 200's body (or the stream read so far) was well-formed.
        hung_up: whether we closed the stream on purpose before its end.
    """
    if error is not None or status is None:
        return error or "transport_error"
    if status in (429, 503):
        return "429/503"
    if status >= 500:
        return "5xx"
    if 400 <= status < 500:
        right = expect == "4xx" or (expect == "400" and status == 400)
        return "4xx" if right else "unexpected_4xx"
    if expect != "ok":
        return "unexpected_2xx" if 200 <= status < 300 else "bad_body"
    if status != 200 or not body_ok:
        return "bad_body"
    return "disconnect" if hung_up else "complete"


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated
    between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def parse_mix(text: str | None) -> dict[str, float]:
    """``"stream=3,bad=1"`` -> weights (kinds left out get 0); None: the default."""
    if not text:
        return dict(DEFAULT_MIX)
    mix = dict.fromkeys(DEFAULT_MIX, 0.0)
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or name not in DEFAULT_MIX or float(value) < 0:
            raise ValueError(f"bad --mix item {item!r}: use KIND=WEIGHT with KIND in "
                             f"{', '.join(DEFAULT_MIX)}")
        mix[name] = float(value)
    if sum(mix.values()) <= 0:
        raise ValueError("--mix needs a positive weight")
    return mix


def parse_gauges(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        value = rest.rsplit("}", 1)[-1].split() if "{" in line else rest.split()
        try:
            out[name] = out.get(name, 0.0) + float(value[0])
        except (IndexError, ValueError):
            continue
    return out


# --------------------------------------------------------------------------- request plans


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


def _text_body(chat: bool, prompt: str, model: str | None) -> dict:
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
    body = {**_text_body(chat, prompt, target.model), "max_tokens": tokens,
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
    good = {**_text_body(chat, "Say hi.", target.model), "max_tokens": 4}
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
    body = {**_text_body(chat, prompt, target.model), "max_tokens": 4,
            "stream": rng.random() < 0.5}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Plan("oversized", f"oversized/{variant}", path, body, stream=body["stream"],
                expect="400")


# Constraints: the server's default ``--structured-outputs-max-bytes`` (64 KiB, counted
# as ``constraint_bytes`` does), the request fields that carry one, and the sizes
# (bytes) drawn for a ``large`` constraint (valid, under the limit) and an
# ``oversized`` one (over it).
CONSTRAINT_MAX_BYTES = 64 * 1024
CONSTRAINT_FIELDS = ("guided_json", "response_format", "guided_regex", "guided_choice",
                     "guided_grammar", "tools")
LARGE_CONSTRAINT_BYTES, OVERSIZED_CONSTRAINT_BYTES = (40_000, 56_000), (70_000, 100_000)
#: The fields of a ``large`` constraint: not ``tools``, whose schemas are also
#: written into the prompt (40 KB of schema is over any small ``max_model_len``).
LARGE_FIELDS = CONSTRAINT_FIELDS[:-1]
#: Small constraints that do not compile (or are malformed), by field.
INVALID_CONSTRAINTS: dict[str, Any] = {
    "guided_json": {"type": "nonsense"},
    "response_format": {"type": "nonsense"},
    "guided_regex": "[0-9",
    "guided_choice": [],
    "guided_grammar": "start: (",
    "tools": {"type": "object", "properties": {"a": {"type": "bogus"}}},
}


def constraint_bytes(name: str, value: Any) -> int:
    """The size kvserve counts of constraint ``value`` of field ``name``: UTF-8
    bytes of a regex or grammar, of a schema's JSON text (``json.dumps``; for
    ``tools``, of the ``parameters`` schema: the server counts the grammar
    that embeds it, ~400 bytes more), for ``guided_choice`` each option's
    bytes + 3."""
    if name == "guided_choice":
        return sum(len(option.encode()) + 3 for option in value)
    return len((value if isinstance(value, str) else json.dumps(value)).encode())


def _smallest(make: Callable[[int], Any], name: str, size: int) -> Any:
    """``make(n)`` of the fewest items ``n`` with at least ``size`` bytes
    (``constraint_bytes``; it grows with ``n``)."""
    lo, hi = 1, 64
    while constraint_bytes(name, make(hi)) < size:
        lo, hi = hi + 1, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if constraint_bytes(name, make(mid)) >= size else (mid + 1, hi)
    return make(lo)


def sized_constraint(name: str, size: int, rng: random.Random) -> Any:
    """A valid constraint of field ``name`` of at least ``size`` bytes and at
    most one item more (``constraint_bytes``), salted with random letters so
    that the server's compile cache never has it: a schema of many optional
    properties (~60 bytes each: 50 KB is ~850 of them, ~0.2 s of llguidance
    on one idle core; without descriptions twice as many cost ~0.5 s, too
    close to the server's 5 s deadline for its compiler child at low CPU
    priority on a loaded machine), an alternation of words, many choices,
    or a Lark grammar of many one-literal rules (over
    ``CONSTRAINT_MAX_BYTES``: chained rules, the costly kind to compile)."""
    salt = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=8))
    types = ("integer", "string", "boolean")
    makers: dict[str, Callable[[int], Any]] = {
        "schema": lambda n: {"type": "object", "properties": {
            f"{salt}_{i}": {"type": types[i % 3], "description": f"field {i}"}
            for i in range(n)}},
        "guided_regex": lambda n: "(" + "|".join(f"{salt}{i}" for i in range(n)) + ")",
        "guided_choice": lambda n: [f"{salt} choice {i}" for i in range(n)],
        "flat": lambda n: ("start: " + " | ".join(f"w{i}" for i in range(n)) + "\n"
                           + "".join(f'w{i}: "{salt} {i}"\n' for i in range(n))),
        "chained": lambda n: ("start: r0\n" + "".join(f'r{i}: r{i + 1} "x"\n' for i in range(n))
                              + f'r{n}: "{salt}"\n'),
    }
    kind = {"guided_json": "schema", "response_format": "schema", "tools": "schema",
            "guided_grammar": "chained" if size > CONSTRAINT_MAX_BYTES else "flat"}.get(name, name)
    return _smallest(makers[kind], name, size)


def constraint_fields(name: str, value: Any) -> dict[str, Any]:
    """The request fields that set constraint ``value`` by ``name``
    (``tools``: one function with ``value`` as its ``parameters``, required)."""
    if name == "response_format":
        return {name: {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}}
    if name == "tools":
        return {"tools": [{"type": "function", "function": {
                    "name": "soak_tool", "description": "Record the fields.",
                    "parameters": value}}],
                "tool_choice": "required"}
    return {name: value}


def constraint_plan(rng: random.Random, target: Target) -> Plan:
    """A chat with a structured-output constraint of a random field and
    variant (``constraint_request``)."""
    variant = rng.choice(("oversized", "large", "invalid"))
    fields = LARGE_FIELDS if variant == "large" else CONSTRAINT_FIELDS
    return constraint_request(variant, rng.choice(fields), rng, target)


def constraint_request(variant: str, name: str, rng: random.Random, target: Target) -> Plan:
    """A chat whose field ``name`` holds a constraint that is ``oversized``
    (over ``CONSTRAINT_MAX_BYTES``: must get a 400), ``large`` (valid, under
    it: must complete; ``name`` one of ``LARGE_FIELDS``) or ``invalid``
    (``INVALID_CONSTRAINTS``: a 400)."""
    if variant == "invalid":
        value = INVALID_CONSTRAINTS[name]
    else:
        sizes = LARGE_CONSTRAINT_BYTES if variant == "large" else OVERSIZED_CONSTRAINT_BYTES
        value = sized_constraint(name, rng.randint(*sizes), rng)
    tokens = rng.randint(4, 8)
    body = {**_text_body(True, "Fill in the fields.", target.model), "max_tokens": tokens,
            "temperature": 0.0, **constraint_fields(name, value)}
    return Plan("constraint", f"constraint/{variant}/{name}", "/v1/chat/completions", body,
                expect="ok" if variant == "large" else "400", max_tokens=tokens)


#: A flood's messages: the most bytes of its JSON body (under ``kvserve serve``'s
#: default 1 MiB ``--max-request-bytes``) and the large count sometimes sent.
FLOOD_MAX_BYTES, FLOOD_LARGE_COUNT = 1_000_000, 20_000


def flood_plan(rng: random.Random, target: Target) -> Plan | None:
    """A chat of more short messages than ``max_model_len`` tokens can hold
    (``max_model_len`` + 1..1000, or sometimes ``FLOOD_LARGE_COUNT``): must
    get a 400. None when its JSON would pass ``FLOOD_MAX_BYTES``."""
    limit = int(target.max_model_len or 0)
    large = rng.random() < 0.25 and FLOOD_LARGE_COUNT > limit
    count = FLOOD_LARGE_COUNT if large else limit + rng.randint(1, 1000)
    messages = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(count - 1)]
    body = {**_text_body(True, "Say hi.", target.model), "max_tokens": 4,
            "stream": rng.random() < 0.5}
    body["messages"] = [*messages, *body["messages"]]
    if len(json.dumps(body).encode()) > FLOOD_MAX_BYTES:
        return None
    return Plan("flood", f"flood/{'large' if large else 'over_context'}", "/v1/chat/completions",
                body, stream=body["stream"], expect="400")


def samples_plan(rng: random.Random, target: Target) -> Plan:
    """``n_echo`` or ``min_tokens_grammar`` (see the module docstring)."""
    prompt = synth_text(rng.randint(4, 24), np.random.default_rng(rng.getrandbits(32)))
    if rng.random() < 0.5:
        n, tokens = rng.randint(2, 4), rng.randint(2, 6)
        body = {**_text_body(False, prompt, target.model), "n": n, "echo": True,
                "logprobs": 1, "max_tokens": tokens, "temperature": 0.7}
        return Plan("samples", "samples/n_echo", "/v1/completions", body, max_tokens=n * tokens)
    schema = {"name": "answer", "schema": {"type": "boolean"}}
    body = {**_text_body(True, prompt, target.model), "max_tokens": 8, "min_tokens": 6,
            "temperature": 0.0, "response_format": {"type": "json_schema", "json_schema": schema}}
    return Plan("samples", "samples/min_tokens_grammar", "/v1/chat/completions", body,
                max_tokens=8)


#: The request a smuggling attempt hides in its body; the spellings of
#: ``Transfer-Encoding`` tried (``(name, value)``).
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
SMUGGLE_ENCODINGS = {"chunked": ("Transfer-Encoding", "chunked"),
                     "gzip_chunked": ("Transfer-Encoding", "gzip, chunked"),
                     "mixed_case": ("transfer-encoding", "Chunked")}


def smuggle_request(desync: str, order: str, encoding: str) -> bytes:
    """A ``POST /v1/completions`` with both ``Content-Length`` and
    ``Transfer-Encoding`` (``SMUGGLE_ENCODINGS[encoding]``; ``order``
    ``cl_first`` or ``te_first``) whose body hides ``SMUGGLED``: after an
    empty last chunk, inside ``Content-Length`` (``cl.te``: a server that
    reads chunks sees it as the next request), or as a chunk's data beyond
    a short ``Content-Length`` (``te.cl``: one that reads the length does)."""
    if desync == "cl.te":
        body, length = b"0\r\n\r\n" + SMUGGLED, None
    else:
        size = f"{len(SMUGGLED):x}\r\n".encode()
        body, length = size + SMUGGLED + b"\r\n0\r\n\r\n", len(size)
    te_name, te_value = SMUGGLE_ENCODINGS[encoding]
    framing = [f"Content-Length: {len(body) if length is None else length}",
               f"{te_name}: {te_value}"]
    if order == "te_first":
        framing.reverse()
    head = ["POST /v1/completions HTTP/1.1", "Host: localhost",
            "Content-Type: application/json", *framing]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


def smuggle_plan(rng: random.Random, target: Target) -> Plan:
    """A request smuggling attempt (``smuggle_request``) sent as is over a new
    TCP connection: must get exactly one response, a 400, then a close
    (``wire_outcome``)."""
    desync, order = rng.choice(("cl.te", "te.cl")), rng.choice(("cl_first", "te_first"))
    encoding = rng.choice(sorted(SMUGGLE_ENCODINGS))
    return Plan("smuggle", f"smuggle/{desync}/{encoding}/{order}", "/v1/completions",
                wire=smuggle_request(desync, order, encoding), expect="400")


def make_plans(kind: str, rng: random.Random, target: Target) -> list[Plan]:
    """The request(s) of one draw of the mix: one, or ``burst_size`` for a burst."""
    if kind in ("stream", "plain"):
        return [generation_plan(kind, rng, target, stream=kind == "stream")]
    if kind == "disconnect":
        plan = generation_plan(kind, rng, target, stream=True, max_tokens=target.max_tokens,
                               ignore_eos=True)
        return [replace(plan, hangup_after=rng.randint(1, 2))]
    if kind == "slow":
        plan = generation_plan(kind, rng, target, stream=True,
                               max_tokens=rng.randint(2, max(2, target.max_tokens // 2)))
        return [replace(plan, pause_s=round(rng.uniform(0.05, 0.4), 3))]
    if kind == "bad":
        return [bad_plan(rng, target)]
    if kind in ("oversized", "flood"):
        plan = None
        if target.max_model_len:  # unknown limit: nothing is sure to be too long
            plan = oversized_plan(rng, target) if kind == "oversized" else flood_plan(rng, target)
        return [plan or generation_plan("stream", rng, target, stream=True)]
    if kind == "constraint":
        return [constraint_plan(rng, target)]
    if kind == "smuggle":
        return [smuggle_plan(rng, target)]
    if kind == "samples":
        return [samples_plan(rng, target)]
    if kind == "burst":
        return [generation_plan("burst", rng, target, stream=rng.random() < 0.5)
                for _ in range(target.burst_size)]
    raise ValueError(f"unknown request kind {kind!r}")


def probe_plan(target: Target) -> Plan:
    """The probe: a chat stream of ``max_tokens`` tokens (EOS ignored)."""
    body = {**_text_body(True, "Count slowly from one to one hundred.", target.model),
            "max_tokens": target.max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    return Plan("probe", "probe", "/v1/chat/completions", body, stream=True,
                max_tokens=target.max_tokens, ignore_eos=True)


# --------------------------------------------------------------------------- sending


@dataclass
class Attempt:
    """The result of one request (times in seconds)."""

    kind: str
    label: str
    outcome: str
    status: int | None = None
    detail: str | None = None
    seconds: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content events


@dataclass
class StreamRead:
    """What reading an SSE stream found."""

    events: int = 0
    done: bool = False
    finish_reason: str | None = None
    usage: dict | None = None
    problem: str | None = None
    hung_up: bool = False
    itl: list[float] = field(default_factory=list)


async def sse_payloads(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data:`` payloads of an event stream, one per event."""
    data: list[str] = []
    async for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[6:] if line[5:6] == " " else line[5:])
    if data:
        yield "\n".join(data)


def _content(choice: dict) -> str:
    delta = choice.get("delta") or choice.get("message") or {}
    text = delta.get("content") if isinstance(delta, dict) else None
    return text if isinstance(text, str) else (choice.get("text") or "")


def usage_problem(usage: dict | None, plan: Plan) -> str | None:
    """Why ``usage`` contradicts ``plan`` (completion tokens above max_tokens,
    or not equal to it with EOS ignored), or None."""
    if not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
        return "no usage with completion_tokens"
    got, limit = usage["completion_tokens"], plan.max_tokens
    if limit is not None and (got > limit or (plan.ignore_eos and got != limit)):
        return f"completion_tokens {got} with max_tokens {limit} (ignore_eos {plan.ignore_eos})"
    return None


def finish_problem(reason: Any, plan: Plan) -> str | None:
    """Why ``reason`` cannot end ``plan``'s answer (``stop`` or ``length``;
    ``tool_calls`` too when it offers tools), or None."""
    tools = isinstance(plan.body, dict) and bool(plan.body.get("tools"))
    return None if reason in ("stop", "length") or (tools and reason == "tool_calls") \
        else f"finish_reason {reason!r}"


def body_problem(raw: bytes, plan: Plan) -> str | None:
    """Why a non-streamed 200 body is malformed, or None."""
    try:
        data = json.loads(raw)
    except ValueError:
        return f"body is not JSON: {raw[:80]!r}"
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return "no choices"
    return finish_problem(choices[0].get("finish_reason"), plan) \
        or usage_problem(data.get("usage"), plan)


def apply_event(st: StreamRead, payload: str, plan: Plan) -> bool:
    """Account for one SSE payload in ``st`` (sets ``st.problem`` when it is
    malformed); True when it carried content (a token)."""
    st.events += 1
    if st.done:
        st.problem = "an event after [DONE]"
        return False
    if payload.strip() == "[DONE]":
        st.done = True
        return False
    try:
        chunk = json.loads(payload)
    except ValueError:
        st.problem = f"event is not JSON: {payload[:80]!r}"
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list) or "error" in chunk \
            or not all(isinstance(c, dict) for c in choices):
        st.problem = f"error or malformed event: {payload[:160]}"
        return False
    st.usage = chunk.get("usage") or st.usage
    content = False
    for choice in choices:
        st.finish_reason = choice.get("finish_reason") or st.finish_reason
        content = content or bool(_content(choice))
    return content


def stream_end_problem(st: StreamRead, plan: Plan) -> str | None:
    """Why a stream read to its end is not a full answer, or None."""
    if not st.done:
        return f"stream ended without [DONE] after {st.events} events"
    return finish_problem(st.finish_reason, plan) or usage_problem(st.usage, plan)


async def read_stream(resp: httpx.Response, plan: Plan) -> StreamRead:
    """Read (or hang up on) a 200 event stream, checking every event; ITL
    gaps (seconds) between content events are recorded."""
    st = StreamRead()
    last: float | None = None
    async for payload in sse_payloads(resp.aiter_lines()):
        if apply_event(st, payload, plan):
            now = time.perf_counter()
            if last is not None:
                st.itl.append(now - last)
            last = now
        if st.problem:
            return st
        if plan.hangup_after and st.events >= plan.hangup_after and not st.done:
            st.hung_up = True
            return st
        if plan.pause_s and not st.done:
            await asyncio.sleep(plan.pause_s)
    st.problem = stream_end_problem(st, plan)
    return st


def _error_text(raw: bytes) -> str:
    return raw[:200].decode("utf-8", "replace")


#: A response's status line, and a ``Content-Length`` header line within its head.
STATUS_LINE = re.compile(rb"HTTP/\d(?:\.\d)? (\d{3})[^\r\n]*\r\n")
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
#: The most bytes read back on a raw connection (``Plan.wire``).
WIRE_MAX_BYTES = MIB


def http_statuses(data: bytes) -> list[int]:
    """The statuses of the HTTP responses in ``data``, one after another:
    each body is skipped by its ``Content-Length``; after a head without
    one, the next status line anywhere starts another response."""
    statuses, pos = [], 0
    while (line := STATUS_LINE.search(data, pos)) is not None:
        statuses.append(int(line[1]))
        end = data.find(b"\r\n\r\n", line.start())
        if end < 0:
            break
        length = CONTENT_LENGTH.search(data, line.end() - 2, end + 2)
        pos = end + 4 + (int(length[1]) if length else 0)
    return statuses


def wire_outcome(expect: str, data: bytes) -> tuple[str, int | None, str | None]:
    """(outcome, status, detail) of all that came back on a raw connection
    before its close: one response, classified by its status (``classify``);
    ``smuggled`` for more than one (a request hidden in the body ran);
    ``transport_error`` for nothing; ``bad_body`` for bytes that are not
    an HTTP response."""
    statuses = http_statuses(data)
    if not data:
        return "transport_error", None, "connection closed with no response"
    if not data.startswith(b"HTTP/") or not statuses:
        return "bad_body", None, f"not an HTTP response: {data[:80]!r}"
    if len(statuses) > 1:
        return "smuggled", statuses[0], f"{len(statuses)} responses, statuses {statuses}"
    return classify(expect, statuses[0]), statuses[0], _error_text(data.partition(b"\r\n\r\n")[2])


async def _exchange_wire(client: httpx.AsyncClient, plan: Plan) -> Attempt:
    """Send ``plan.wire`` on a new TCP connection to ``client``'s server, read
    until the server closes it (``WIRE_MAX_BYTES`` at most) and classify
    what came (``wire_outcome``). A reset after some bytes ends the read;
    one before any raises (``ConnectionResetError``)."""
    url, data = client.base_url, b""
    tls = url.scheme == "https"
    reader, writer = await asyncio.open_connection(url.host, url.port or (443 if tls else 80),
                                                   ssl=tls or None)
    try:
        writer.write(plan.wire or b"")
        await writer.drain()
        while len(data) < WIRE_MAX_BYTES and (chunk := await reader.read(65536)):
            data += chunk
    except ConnectionResetError:
        if not data:
            raise
    finally:
        writer.close()
    outcome, status, detail = wire_outcome(plan.expect, data)
    return Attempt(plan.kind, plan.label, outcome, status, detail)


async def _exchange(client: httpx.AsyncClient, plan: Plan) -> Attempt:
    """Send ``plan`` and classify the answer (exceptions propagate)."""
    if plan.wire is not None:
        return await _exchange_wire(client, plan)
    if plan.raw is not None:
        kwargs: dict[str, Any] = {"content": plan.raw,
                                  "headers": {"content-type": "application/json"}}
    else:
        kwargs = {"json": plan.body}
    async with client.stream("POST", plan.path, **kwargs) as resp:
        status = resp.status_code
        if status != 200 or not plan.stream:
            raw = await resp.aread()
            problem = body_problem(raw, plan) if status == 200 else None
            outcome = classify(plan.expect, status, body_ok=problem is None)
            detail = problem if status == 200 else _error_text(raw)
            return Attempt(plan.kind, plan.label, outcome, status, detail)
        st = await read_stream(resp, plan)
        outcome = classify(plan.expect, status, body_ok=st.problem is None, hung_up=st.hung_up)
        return Attempt(plan.kind, plan.label, outcome, status, st.problem, itl=st.itl)


async def send(client: httpx.AsyncClient, plan: Plan, timeout_s: float) -> Attempt:
    """Send one request with a total deadline of ``timeout_s`` seconds; any
    exception becomes a ``timeout`` or ``transport_error`` outcome."""
    start = time.perf_counter()
    try:
        attempt = await asyncio.wait_for(_exchange(client, plan), timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        attempt = Attempt(plan.kind, plan.label, "timeout", detail=type(exc).__name__)
    except (httpx.HTTPError, OSError) as exc:
        attempt = Attempt(plan.kind, plan.label, "transport_error",
                          detail=f"{type(exc).__name__}: {exc}"[:200])
    except Exception as exc:  # noqa: BLE001 - an answer malformed in a way the checks missed
        attempt = Attempt(plan.kind, plan.label, "bad_body",
                          detail=f"{type(exc).__name__}: {exc}"[:200])
    attempt.seconds = time.perf_counter() - start
    return attempt


# --------------------------------------------------------------------------- load


class Budget:
    """Requests left to send: stops at ``deadline`` (``time.monotonic``
    seconds), after ``max_requests``, or at ``stop()``, whichever comes first.
    ``granted`` counts the requests granted: each must end as one outcome
    (``check_accounted``)."""

    def __init__(self, deadline: float, max_requests: int | None) -> None:
        self.deadline = deadline
        self.left = max_requests if max_requests is not None else 1 << 62
        self.granted = 0
        self.stopped: str | None = None  # why the load stopped early

    def stop(self, reason: str) -> None:
        self.stopped = self.stopped or reason

    def take(self, n: int) -> int:
        """Reserve up to ``n`` requests; how many were granted (0: stop)."""
        if time.monotonic() >= self.deadline or self.left <= 0 or self.stopped:
            return 0
        granted = min(n, self.left)
        self.left -= granted
        self.granted += granted
        return granted


async def _worker(client: httpx.AsyncClient, rng: random.Random, mix: dict[str, float],
                  target: Target, budget: Budget, timeout_s: float,
                  results: list[Attempt]) -> None:
    kinds, weights = list(mix), list(mix.values())
    while True:
        plans = make_plans(rng.choices(kinds, weights)[0], rng, target)
        granted = budget.take(len(plans))
        if not granted:
            return
        attempts = await asyncio.gather(*(send(client, p, timeout_s) for p in plans[:granted]))
        _stop_if_server_gone(budget, attempts)
        results.extend(attempts)


def _stop_if_server_gone(budget: Budget, attempts: list[Attempt]) -> None:
    """A refused connection means no server on the port: stop the load
    rather than spin on connection errors."""
    for a in attempts:
        if a.outcome == "transport_error" and \
                (a.detail or "").startswith(("ConnectError", "ConnectionRefusedError")):
            budget.stop(f"cannot connect: {a.detail}")


async def _probe(client: httpx.AsyncClient, target: Target, budget: Budget, timeout_s: float,
                 results: list[Attempt]) -> None:
    plan = probe_plan(target)
    while budget.take(1):
        attempt = await send(client, plan, timeout_s)
        _stop_if_server_gone(budget, [attempt])
        results.append(attempt)


@dataclass
class Load:
    """What ``run_load`` did: the attempts, its duration (s), the requests
    the budget granted and why it stopped early (None: it ran to its bound)."""

    attempts: list[Attempt]
    duration_s: float
    granted: int
    stopped: str | None


async def run_load(base_url: str, target: Target, *, concurrency: int, mix: dict[str, float],
                   seed: int, duration_s: float, max_requests: int | None, timeout_s: float,
                   headers: dict[str, str]) -> Load:
    """``concurrency`` workers and the probe until the budget is spent; in-flight
    requests are let finish."""
    budget = Budget(time.monotonic() + duration_s, max_requests)
    results: list[Attempt] = []
    limits = httpx.Limits(max_connections=concurrency * (target.burst_size + 1) + 8)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits,
                                 headers=headers) as client:
        tasks = [_worker(client, random.Random(f"{seed}/{i}"), mix, target, budget, timeout_s,
                         results) for i in range(concurrency)]
        await asyncio.gather(_probe(client, target, budget, timeout_s, results), *tasks)
    return Load(results, time.perf_counter() - start, budget.granted, budget.stopped)


# --------------------------------------------------------------------------- server state


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (``/proc/PID/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def fd_count(pid: int) -> int | None:
    """Open file descriptors of process ``pid`` (``/proc/PID/fd``); None if
    unreadable or the process is gone."""
    try:
        count = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    return count if alive(pid) else None


def rss_mib(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB (``VmRSS`` of ``/proc/PID/status``)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler:
    """Samples ``rss_mib(pid)`` every ``period_s`` seconds in the background;
    keeps the peak and every ``(seconds since start, MiB)`` sample."""

    def __init__(self, pid: int | None, period_s: float = 1.0) -> None:
        self.pid, self.period_s = pid, period_s
        self.peak: float | None = None
        self.samples: list[tuple[float, float]] = []
        self._start = time.monotonic()
        self._task: asyncio.Task | None = None

    def sample(self) -> float | None:
        value = rss_mib(self.pid) if self.pid else None
        if value is not None:
            self.peak = value if self.peak is None else max(self.peak, value)
            self.samples.append((round(time.monotonic() - self._start, 1), value))
        return value

    async def _loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        if self.pid:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sample()


async def wait_until(read: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool],
                     deadline: float, interval_s: float = 0.25) -> tuple[bool, Any]:
    """Poll ``read()`` until ``ok(value)`` or ``deadline`` (``time.monotonic``
    seconds); returns (ok, the last value)."""
    while True:
        value = await read()
        if ok(value):
            return True, value
        if time.monotonic() >= deadline:
            return False, value
        await asyncio.sleep(interval_s)


class Server:
    """Read-only views of the server under test (HTTP and ``/proc``)."""

    def __init__(self, client: httpx.AsyncClient, pid: int | None) -> None:
        self.client, self.pid = client, pid

    async def health(self) -> int | None:
        try:
            return (await self.client.get("/health")).status_code
        except httpx.HTTPError:
            return None

    async def gauges(self) -> dict[str, float] | None:
        """The load gauges found in ``/metrics`` ({}: none, e.g. no such
        route); None when the server did not answer."""
        try:
            resp = await self.client.get("/metrics")
        except httpx.HTTPError:
            return None
        values = parse_gauges(resp.text) if resp.status_code == 200 else {}
        return {name: values[name] for name in GAUGES if name in values}

    async def fds(self) -> int | None:
        return fd_count(self.pid) if self.pid else None

    async def target(self, max_tokens: int, burst_size: int) -> Target:
        """Model id and ``max_model_len`` from ``GET /v1/models``."""
        resp = await self.client.get("/v1/models")
        resp.raise_for_status()
        card = (resp.json().get("data") or [{}])[0]
        return Target(card.get("id"), card.get("max_model_len"), max_tokens, burst_size)


def _idle(baseline_kv: float) -> Callable[[dict[str, float] | None], bool]:
    def ok(g: dict[str, float] | None) -> bool:
        return g is not None and g.get(GAUGES[0], 0.0) == 0 and g.get(GAUGES[1], 0.0) == 0 \
            and g.get(GAUGES[2], 0.0) <= baseline_kv + 1e-9
    return ok


# --------------------------------------------------------------------------- checks


@dataclass
class Check:
    """One end-of-run check: ``PASS``, ``FAIL`` or ``not checked``."""

    name: str
    status: str
    detail: str = ""


@dataclass
class Baseline:
    """The server after warm-up: fds, RSS (MiB) and KV usage (0..1)."""

    fds: int | None
    rss_mib: float | None
    kv_usage: float


async def measure_baseline(server: Server, deadline: float) -> Baseline:
    """Wait (until ``deadline``) for the server to be idle, then read its fds, RSS and KV."""
    _, gauges = await wait_until(server.gauges, _idle(0.0), deadline)
    kv = (gauges or {}).get(GAUGES[2], 0.0)
    rss = rss_mib(server.pid) if server.pid else None
    return Baseline(await server.fds(), rss, kv)


async def check_health(server: Server, deadline: float) -> Check:
    ok, status = await wait_until(server.health, lambda s: s == 200, deadline)
    return Check("health", "PASS" if ok else "FAIL", f"/health {status}")


async def check_gauges(server: Server, base: Baseline, deadline: float) -> Check:
    ok, g = await wait_until(server.gauges, _idle(base.kv_usage), deadline)
    if g is None:
        return Check("idle gauges", "FAIL", "/metrics did not answer")
    if not g:
        return Check("idle gauges", "not checked", "no kvserve gauges in /metrics")
    detail = (f"running {g.get(GAUGES[0], 0):g}, waiting {g.get(GAUGES[1], 0):g}, "
              f"kv {g.get(GAUGES[2], 0):.3f} (baseline {base.kv_usage:.3f})")
    return Check("idle gauges", "PASS" if ok else "FAIL", detail)


async def check_fds(server: Server, base: Baseline, tolerance: int, deadline: float) -> Check:
    if base.fds is None:
        return Check("fds", "not checked", "no server pid")
    ok, now = await wait_until(server.fds, lambda n: n is not None and n <= base.fds + tolerance,
                               deadline)
    if now is None:
        return Check("fds", "FAIL", f"server process {server.pid} is gone")
    return Check("fds", "PASS" if ok else "FAIL", f"{base.fds} -> {now} (tolerance +{tolerance})")


def check_rss(base: Baseline, peak: float | None, limit_mib: float) -> Check:
    if base.rss_mib is None or peak is None:
        return Check("rss growth", "not checked", "no server pid")
    growth = peak - base.rss_mib
    return Check("rss growth", "PASS" if growth <= limit_mib else "FAIL",
                 f"{growth:+.1f} MiB (limit {limit_mib:g})")


def check_accounted(granted: int, attempts: list[Attempt]) -> Check:
    """Every request the budget granted ended as exactly one known outcome."""
    unknown = Counter(a.outcome for a in attempts if a.outcome not in OUTCOMES)
    ok = len(attempts) == granted and not unknown
    detail = f"{len(attempts)} outcomes for {granted} requests" + (
        f"; unknown outcomes {dict(unknown)}" if unknown else "")
    return Check("accounted", "PASS" if ok else "FAIL", detail)


def check_outcomes(counts: Counter) -> Check:
    bad = {k: counts[k] for k in OUTCOMES if k in FAILURES and counts[k]}
    return Check("no failures", "FAIL" if bad else "PASS",
                 ", ".join(f"{k} {v}" for k, v in bad.items()) or "0 failure outcomes")


# --------------------------------------------------------------------------- report


def summarize(attempts: list[Attempt], duration_s: float, base: Baseline,
              rss_samples: list[tuple[float, float]], fds_after: int | None,
              checks: list[Check], granted: int) -> dict:
    """The result dict (the ``--json`` file); ``passed`` decides the exit status.
    ``rss_samples``: (seconds, MiB) of the server's RSS from the baseline on;
    ``granted``: the requests the budget granted (``accounted``)."""
    peak = max((mib for _, mib in rss_samples), default=None)
    counts = Counter(a.outcome for a in attempts)
    itl_ms = [g * 1000.0 for a in attempts if a.kind == "probe" for g in a.itl]
    by_kind: dict[str, dict[str, int]] = {}
    for a in attempts:
        by_kind.setdefault(a.kind, {}).setdefault(a.outcome, 0)
        by_kind[a.kind][a.outcome] += 1
    return {
        "outcomes": {k: counts[k] for k in OUTCOMES},
        "total": len(attempts),
        "accounted": {"requests": granted, "outcomes": len(attempts)},
        "failures": sum(counts[k] for k in FAILURES),
        "duration_s": round(duration_s, 3),
        "requests_per_s": round(len(attempts) / duration_s, 3) if duration_s > 0 else None,
        "probe_itl_ms": {"n": len(itl_ms), "p50": percentile(itl_ms, 50),
                         "p99": percentile(itl_ms, 99)},
        "rss_mib": {"baseline": base.rss_mib, "peak": peak,
                    "end": rss_samples[-1][1] if rss_samples else None,
                    "growth": None if peak is None or base.rss_mib is None
                    else peak - base.rss_mib,
                    "samples": [(t, round(mib, 1)) for t, mib in rss_samples]},
        "fds": {"before": base.fds, "after": fds_after},
        "checks": [asdict(c) for c in checks],
        "by_kind": by_kind,
        "failure_examples": [asdict(a) | {"itl": None} for a in attempts
                             if a.outcome in FAILURES][:20],
        "passed": all(c.status != "FAIL" for c in checks),
    }


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def format_table(result: dict) -> str:
    """The one summary table printed at the end."""
    rows: list[tuple[str, str]] = []
    for name, count in result["outcomes"].items():
        rows.append((f"  {name}" + (" (failure)" if name in FAILURES else ""), str(count)))
    itl = result["probe_itl_ms"]
    rss = result["rss_mib"]
    accounted = result["accounted"]
    rows += [("total requests", str(result["total"])),
             ("requests granted / outcomes",
              f"{accounted['requests']} / {accounted['outcomes']}"),
             ("duration (s)", _num(result["duration_s"])),
             ("requests/s", _num(result["requests_per_s"], ".2f")),
             (f"probe ITL p50 / p99 (ms, n={itl['n']})",
              f"{_num(itl['p50'])} / {_num(itl['p99'])}"),
             ("RSS baseline / peak / end (MiB)",
              f"{_num(rss['baseline'])} / {_num(rss['peak'])} / {_num(rss['end'])}"),
             ("RSS growth (MiB)", _num(rss["growth"], "+.1f")),
             ("fds before / after", f"{_num(result['fds']['before'], 'd')} / "
                                    f"{_num(result['fds']['after'], 'd')}")]
    rows += [(f"check {c['name']}", f"{c['status']}  {c['detail']}") for c in result["checks"]]
    rows.append(("result", "PASS" if result["passed"] else "FAIL"))
    width = max(len(label) for label, _ in rows) + 2
    lines = ["=" * 22 + " kvserve soak " + "=" * 22, f"{'outcome':<{width}}count"]
    lines += [f"{label:<{width}}{value}" for label, value in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- run


async def warm_up(base_url: str, target: Target, count: int, timeout_s: float,
                  headers: dict[str, str]) -> Check:
    """Send ``count`` well-formed requests one by one (stream and not); all must complete."""
    rng = random.Random("warm-up")
    async with httpx.AsyncClient(base_url=base_url, headers=headers,
                                 timeout=httpx.Timeout(timeout_s)) as client:
        attempts = [await send(client, generation_plan("warmup", rng, target, stream=i % 2 == 0),
                               timeout_s) for i in range(count)]
    done = sum(a.outcome == "complete" for a in attempts)
    return Check("warm-up", "PASS" if done == count else "FAIL", f"{done}/{count} complete")


async def end_checks(args: argparse.Namespace, server: Server, base: Baseline,
                     sampler: RssSampler, stopped: str | None) -> list[Check]:
    """The checks after the load; they share one deadline of ``--settle-timeout`` s."""
    deadline = time.monotonic() + args.settle_timeout
    checks = [Check("load", "FAIL" if stopped else "PASS", stopped or "ran to its bound"),
              await check_health(server, deadline),
              await check_gauges(server, base, deadline),
              await check_fds(server, base, args.fd_tolerance, deadline)]
    await sampler.stop()
    return [*checks, check_rss(base, sampler.peak, args.max_rss_growth_mib)]


async def soak(args: argparse.Namespace, base_url: str, pid: int | None) -> dict:
    """Warm up, measure the baseline, run the load, check; the result dict."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers,
                                 timeout=httpx.Timeout(30.0)) as probe_client:
        server = Server(probe_client, pid)
        target = await server.target(args.max_tokens, args.burst_size)
        warm = await warm_up(base_url, target, args.warmup, args.request_timeout, headers)
        base = await measure_baseline(server, time.monotonic() + args.settle_timeout)
        sampler = RssSampler(pid)
        sampler.start()
        _log(f"load for {args.duration:g} s"
             + (f" or {args.max_requests} requests" if args.max_requests else "")
             + f" at concurrency {args.concurrency}")
        load = await run_load(
            base_url, target, concurrency=args.concurrency, mix=parse_mix(args.mix),
            seed=args.seed, duration_s=args.duration, max_requests=args.max_requests,
            timeout_s=args.request_timeout, headers=headers)
        checks = [warm, *await end_checks(args, server, base, sampler, load.stopped),
                  check_outcomes(Counter(a.outcome for a in load.attempts)),
                  check_accounted(load.granted, load.attempts)]
        result = summarize(load.attempts, load.duration_s, base, sampler.samples,
                           await server.fds(), checks, load.granted)
    result["server"] = {"url": base_url, "pid": pid, "model": target.model,
                        "max_model_len": target.max_model_len}
    return result


def _log(message: str) -> None:
    print(f"soak: {message}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The soak's flags."""
    p.add_argument("--url", default=None,
                   help="attach to this server (loopback only) instead of starting one")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --url: the server's pid, for the fd and RSS checks")
    p.add_argument("--model", default=None,
                   help="model to serve when starting the server (default: the default model)")
    p.add_argument("--serve-args", default="",
                   help="extra 'kvserve serve' flags, one string (e.g. '--max-model-len 512'; "
                        "a single flag as --serve-args=--FLAG)")
    p.add_argument("--server-log", default=None, help="started server's log file")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--max-requests", type=int, default=None,
                   help="stop after this many requests (probe included) if sooner")
    p.add_argument("--concurrency", type=int, default=16, help="workers (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic mix")
    p.add_argument("--mix", default=None,
                   help="KIND=WEIGHT,... of " + ", ".join(f"{k} ({v:g})"
                                                         for k, v in DEFAULT_MIX.items()))
    p.add_argument("--max-tokens", type=int, default=32,
                   help="largest max_tokens of a request (1..this); the probe's (default 32)")
    p.add_argument("--burst-size", type=int, default=8, help="requests of one burst")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests before the baseline")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds one request may take in all (default 120)")
    p.add_argument("--settle-timeout", type=float, default=60.0,
                   help="seconds the end checks wait for their conditions (default 60)")
    p.add_argument("--max-rss-growth-mib", type=float, default=200.0,
                   help="largest peak RSS minus post-warm-up RSS, MiB (default 200); it "
                        "includes KV-cache pages written for the first time (tools/README.md)")
    p.add_argument("--fd-tolerance", type=int, default=4,
                   help="open fds allowed above the baseline at the end (default 4)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default $OPENAI_API_KEY)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result JSON here")


def usage_error(args: argparse.Namespace) -> str | None:
    """The one-line reason ``args`` cannot run (exit 2), or None."""
    if args.url is not None:
        if args.model is not None or args.serve_args:
            return "--url attaches to a running server: --model and --serve-args do not apply"
        if (error := loopback_error(args.url)) is not None:
            return error
    elif args.server_pid is not None:
        return "--server-pid needs --url"
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}").is_dir():
        return f"--server-pid {args.server_pid}: no such process"
    if args.duration <= 0 or args.concurrency < 1 or args.max_tokens < 2 or args.burst_size < 1:
        return "--duration must be > 0, --concurrency and --burst-size >= 1, --max-tokens >= 2"
    try:
        parse_mix(args.mix)
    except ValueError as exc:
        return str(exc)
    return None


def start_server(args: argparse.Namespace):
    """``kvserve serve`` on a free loopback port (``kvserve.bench.server.ServerProcess``)."""
    from kvserve.bench.server import ServerProcess

    model = args.model
    if model is None:
        from kvserve.model.default_model import ensure_default_model
        model = str(ensure_default_model())
    log = args.server_log or Path(tempfile.gettempdir()) / f"kvserve-soak-{os.getpid()}.log"
    _log(f"starting kvserve serve --model {model} {args.serve_args} (log {log})")
    return ServerProcess(["--model", model, *shlex.split(args.serve_args)], log_path=log)


def run_cli(args: argparse.Namespace) -> int:
    """Run parsed ``args``: 0 when everything passed, 1 otherwise, 2 for bad usage."""
    if (error := usage_error(args)) is not None:
        print(f"soak: error: {error}", file=sys.stderr)
        return 2
    server = None
    try:
        if args.url is None:
            from kvserve.bench.server import exit_on_sigterm
            exit_on_sigterm()
            server = start_server(args)
        url = args.url or server.base_url
        pid = args.server_pid if server is None else server.proc.pid
        result = asyncio.run(soak(args, url.rstrip("/"), pid))
    except (RuntimeError, httpx.HTTPError) as exc:  # no server, or none answering
        print(f"soak: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    result["tool"] = {"name": "kvserve.testing.soak", "version": BENCH_VERSION}
    result["config"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0 if result["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
