"""The JSONL trace format: one request per line (see ``tools/README.md``).

A line is a JSON object::

    {"id": "r0001", "arrival_s": 0.734, "class": "short_qa",
     "prompt": "...", "prompt_tokens": 62, "output_tokens": 48,
     "priority": null, "prefix_group": null, "stream": true}

- ``arrival_s``: offset in seconds from the start of the replay (>= 0).
- ``prompt`` (text) or ``prompt_tokens`` (a count; the replay then synthesizes
  a prompt of about that many tokens) -- at least one of them. When both are
  given, ``prompt`` is sent and ``prompt_tokens`` is the intended length.
- ``output_tokens``: sent as ``max_tokens`` (with ``ignore_eos`` unless the
  replay is told otherwise).
- ``priority``: int or null (sent as ``X-Priority``; lower is served first).
- ``prefix_group``: str or null; requests of one group share a prompt prefix.
- ``stream``: bool (default true).
- ``messages`` (optional): a chat message list sent as is instead of ``prompt``.

An optional first line ``{"trace_meta": {...}}`` describes how the trace was
made (generator, seed, arrival process); readers skip it for the requests.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CLASSES = ("short_qa", "rag", "code", "agent")


@dataclass
class TraceRequest:
    """One request of a trace."""

    id: str
    arrival_s: float
    cls: str = "default"
    prompt: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 64
    priority: int | None = None
    prefix_group: str | None = None
    stream: bool = True
    messages: list[dict] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise ValueError(f"request {self.id}: arrival_s must be >= 0, got {self.arrival_s}")
        if self.prompt is None and self.prompt_tokens is None and self.messages is None:
            raise ValueError(f"request {self.id}: needs prompt, prompt_tokens or messages")
        if self.output_tokens < 1:
            raise ValueError(f"request {self.id}: output_tokens must be >= 1")

    def to_json(self) -> dict:
        """The JSONL object of this request (``cls`` is written as ``class``)."""
        data = asdict(self)
        data["class"] = data.pop("cls")
        extra = data.pop("extra")
        if data["messages"] is None:
            data.pop("messages")
        data.update(extra)
        return data

    @classmethod
    def from_json(cls, data: dict, line_no: int = 0) -> TraceRequest:
        """Parse one JSONL object; unknown keys are kept in ``extra``."""
        known = {"id", "arrival_s", "class", "prompt", "prompt_tokens", "output_tokens",
                 "priority", "prefix_group", "stream", "messages"}
        if "arrival_s" not in data:
            raise ValueError(f"trace line {line_no}: missing arrival_s")
        return cls(
            id=str(data.get("id", f"r{line_no:05d}")), arrival_s=float(data["arrival_s"]),
            cls=str(data.get("class") or "default"), prompt=data.get("prompt"),
            prompt_tokens=None if data.get("prompt_tokens") is None else int(data["prompt_tokens"]),
            output_tokens=int(data.get("output_tokens", 64)),
            priority=None if data.get("priority") is None else int(data["priority"]),
            prefix_group=data.get("prefix_group"), stream=bool(data.get("stream", True)),
            messages=data.get("messages"),
            extra={k: v for k, v in data.items() if k not in known})


def write_trace(path: str | Path, requests: list[TraceRequest], meta: dict | None = None) -> None:
    """Write ``requests`` (sorted by arrival) as JSONL, with an optional meta line."""
    with open(path, "w", encoding="utf-8") as f:
        if meta is not None:
            f.write(json.dumps({"trace_meta": meta}) + "\n")
        for req in sorted(requests, key=lambda r: r.arrival_s):
            f.write(json.dumps(req.to_json(), ensure_ascii=False) + "\n")


def read_trace(path: str | Path) -> tuple[list[TraceRequest], dict]:
    """The requests of a JSONL trace (sorted by arrival) and its meta (or {})."""
    requests: list[TraceRequest] = []
    meta: dict = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            data = json.loads(line)
            if "trace_meta" in data and len(data) == 1:
                meta = dict(data["trace_meta"])
                continue
            requests.append(TraceRequest.from_json(data, line_no))
    requests.sort(key=lambda r: r.arrival_s)
    return requests, meta


def trace_sha256(path: str | Path) -> str:
    """sha256 of the trace file's bytes (the result's provenance names it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
