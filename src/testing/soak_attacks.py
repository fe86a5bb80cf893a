"""The soak's hostile request kinds: structured-output constraints over the
size limit, large or invalid (``constraint``); chats of more messages than
the context holds (``flood``); request smuggling on a raw TCP connection
(``smuggle``). Each builds a ``Plan`` (``kvserve.testing.soak_plans``) and
says what a right answer is.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from kvserve.testing.soak_plans import Plan, Target, text_body


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
    body = {**text_body(True, "Fill in the fields.", target.model), "max_tokens": tokens,
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
    body = {**text_body(True, "Say hi.", target.model), "max_tokens": 4,
            "stream": rng.random() < 0.5}
    body["messages"] = [*messages, *body["messages"]]
    if len(json.dumps(body).encode()) > FLOOD_MAX_BYTES:
        return None
    return Plan("flood", f"flood/{'large' if large else 'over_context'}", "/v1/chat/completions",
                body, stream=body["stream"], expect="400")


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
