"""Heavy and hostile request bodies, and a neighbour stream to watch them by.

For the constraint benchmark (``tools/bench_constraints.py``), the soak and
the acceptance tests of issue 25:

- ``constraint_bodies(max_bytes, over=False)``: for each way a request can
  carry an output constraint (``guided_json``, ``response_format``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``, ``tools``), the
  request fields of the largest constraint of that kind whose size (as the
  server counts it: ``StructuredOutputsParams.size_bytes``) is at most
  ``max_bytes``, or with ``over`` the smallest one above it. A ``salt``
  makes each one new to the server's compile cache.
- ``Neighbour``: a greedy streaming chat request (EOS ignored) whose token
  arrival times are recorded, to count what it received while something
  else happened.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve.api.tool_calls import tool_grammar
from kvserve.core.structured_outputs import StructuredOutputsParams

#: The request fields that carry a constraint, in the order they are sent.
CONSTRAINT_FIELDS = ("guided_json", "response_format", "guided_regex", "guided_choice",
                     "guided_grammar", "tools")


def _properties(count: int, salt: str) -> dict[str, Any]:
    """A JSON object schema of ``count`` optional string properties (the
    shape whose compile cost grows fastest with its size)."""
    return {"type": "object", "properties": {f"{salt}{i}": {"type": "string"}
                                             for i in range(count)}}


def _tools(count: int, salt: str) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "lookup",
                                              "parameters": _properties(count, salt)}}]


def _builders(salt: str) -> dict[str, tuple[Callable[[int], dict], Callable[[dict], int]]]:
    """Per field: (request fields of ``n`` items, their constraint's size in bytes)."""
    def schema_size(fields: dict) -> int:
        schema = fields.get("guided_json") or fields["response_format"]["json_schema"]["schema"]
        return StructuredOutputsParams.from_schema(schema).size_bytes

    lark = lambda n: ("start: r0\n" + "".join(f'r{i}: r{i + 1} "{salt}"\n' for i in range(n))
                      + f'r{n}: "."\n')
    return {
        "guided_json": (lambda n: {"guided_json": _properties(n, salt)}, schema_size),
        "response_format": (lambda n: {"response_format": {"type": "json_schema", "json_schema": {
            "name": "big", "schema": _properties(n, salt)}}}, schema_size),
        "guided_regex": (
            lambda n: {"guided_regex": "(" + "|".join(f"{salt}{i}" for i in range(n)) + ")"},
            lambda f: StructuredOutputsParams(regex=f["guided_regex"]).size_bytes),
        "guided_choice": (
            lambda n: {"guided_choice": [f"{salt} {i}" for i in range(n)]},
            lambda f: StructuredOutputsParams(choice=tuple(f["guided_choice"])).size_bytes),
        "guided_grammar": (lambda n: {"guided_grammar": lark(n)},
                           lambda f: StructuredOutputsParams(grammar=f["guided_grammar"]).size_bytes),
        "tools": (lambda n: {"tools": _tools(n, salt), "tool_choice": "required"},
                  lambda f: tool_grammar(f["tools"], None, True).size_bytes),
    }


def _largest(build: Callable[[int], dict], size: Callable[[dict], int], limit: int) -> int:
    """The largest n >= 1 with ``size(build(n)) <= limit`` (sizes grow with n)."""
    low, high = 1, 2
    while size(build(high)) <= limit:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if size(build(mid)) <= limit else (low, mid)
    return low


def constraint_bodies(max_bytes: int, over: bool = False, salt: str = "k",
                      tools_bytes: int | None = None) -> dict[str, dict[str, Any]]:
    """``{field: request fields}``: per constraint field, the largest
    constraint of at most ``max_bytes`` bytes, or (``over``) the smallest of
    more. ``salt`` (letters) goes into every name, so a new salt is a new
    constraint for the server's compile cache.

    Tools' schemas are also described in the prompt, so the largest tool
    constraint a server accepts is bounded by its context rather than by
    ``max_bytes``: ``tools_bytes`` (when given, and not ``over``) sizes it
    instead (about 3 bytes a token; e.g. the context length in bytes)."""
    bodies = {}
    for name, (build, size) in _builders(salt).items():
        limit = tools_bytes if name == "tools" and tools_bytes and not over else max_bytes
        n = _largest(build, size, limit)
        bodies[name] = build(n + 1 if over else n)
    return bodies


@dataclass
class Neighbour:
    """A streaming greedy chat request whose token arrivals are recorded
    (``time.monotonic()`` seconds, one per content chunk)."""

    max_tokens: int = 200
    prompt: str = "Count slowly from one to one hundred, one number per line."
    arrivals: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None

    def body(self) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": self.prompt}], "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}

    async def run(self, client: httpx.AsyncClient) -> None:
        """Send the request and read its stream to the end."""
        async with client.stream("POST", "/v1/chat/completions", json=self.body()) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    self.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", ()):
                    if choice.get("delta", {}).get("content"):
                        self.arrivals.append(time.monotonic())
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def tokens_between(self, start: float, end: float) -> int:
        """Content chunks that arrived in ``[start, end)``."""
        return sum(start <= t < end for t in self.arrivals)

    def gaps(self) -> list[float]:
        """Seconds between consecutive content chunks (inter-token latency)."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


@dataclass(frozen=True)
class Shot:
    """One constrained request: when it was sent and accepted (its first
    stream event, or its error answer), its status and the error's ``param``."""

    field: str
    over: bool
    start: float
    accepted: float
    status: int
    param: str | None = None

    @property
    def seconds(self) -> float:
        """Send to acceptance (the compile, for a new constraint), seconds."""
        return self.accepted - self.start


async def send_constraint(client: httpx.AsyncClient, name: str, fields: dict[str, Any],
                          over: bool, max_tokens: int = 2) -> Shot:
    """Send one streamed chat request carrying ``fields``; read it to its end."""
    body = {"messages": [{"role": "user", "content": "Answer in the required form."}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True, **fields}
    start = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raw = await response.aread()
            try:
                param = json.loads(raw)["error"]["param"]
            except (ValueError, KeyError, TypeError):
                param = None
            return Shot(name, over, start, time.monotonic(), response.status_code, param)
        accepted = None
        async for line in response.aiter_lines():
            if accepted is None and line.startswith("data: "):
                accepted = time.monotonic()
        return Shot(name, over, start, accepted or time.monotonic(), 200)


def constraint_round(max_bytes: int, salt: str, tools_bytes: int
                     ) -> list[tuple[str, bool, dict[str, Any]]]:
    """``(field, over, request fields)`` for each constraint field in turn:
    its largest accepted constraint, then one just over ``max_bytes`` (see
    ``constraint_bodies``; the accepted tools' sized to ``tools_bytes``, at
    most the context length in bytes so that their description fits it)."""
    largest = constraint_bodies(max_bytes, over=False, salt=salt, tools_bytes=tools_bytes)
    oversized = constraint_bodies(max_bytes, over=True, salt=salt + "z")
    return [(name, over, (oversized if over else largest)[name])
            for name in CONSTRAINT_FIELDS for over in (False, True)]


def without_constraint(fields: dict[str, Any]) -> dict[str, Any]:
    """The same request fields with no output constraint: the constraint
    field dropped, tools kept (their description is prompt work) with
    ``tool_choice: "auto"`` (no grammar)."""
    if "tools" in fields:
        return {**fields, "tool_choice": "auto"}
    return {key: value for key, value in fields.items() if key not in CONSTRAINT_FIELDS}


async def fire_constraints(client: httpx.AsyncClient, max_bytes: int, salt: str,
                           tools_bytes: int) -> list[Shot]:
    """Send ``constraint_round(...)``'s requests one after the other."""
    return [await send_constraint(client, name, fields, over)
            for name, over, fields in constraint_round(max_bytes, salt, tools_bytes)]
