"""Representative workloads: four request classes, length distributions,
a mix ratio and arrival processes -- or arrivals recorded from kvserve's logs.

Classes (default lengths in tokens; each length is drawn from a log-normal
with the given mean and coefficient of variation, clipped to [min, max]):

=========  ==============================================  ===============  ===============
class      shape                                           prompt mean/cv   output mean/cv
=========  ==============================================  ===============  ===============
short_qa   short question, short answer                    48 / 0.5         64 / 0.5
rag        long retrieved context + question, short answer 1536 / 0.3       96 / 0.5
code       medium instructions + code, long output         384 / 0.5        512 / 0.4
agent      long fixed instruction prefix (1024, shared per  prefix 1024 +    80 / 0.5
           agent) + changing state, repeated               state 160 / 0.5
=========  ==============================================  ===============  ===============

Default mix: short_qa 0.4, rag 0.2, code 0.2, agent 0.2. ``scale`` multiplies
every length (0.1 gives a trace a 2-core CPU can serve).

Arrival processes:

- ``poisson``: exponential inter-arrival gaps with mean ``1/rate``;
- ``gamma``: gamma gaps with shape ``burstiness`` and mean ``1/rate`` (vLLM's
  ``--burstiness``: 1 is Poisson, < 1 burstier, > 1 more regular);
- ``concurrency``: every arrival at 0; the trace's meta carries the
  concurrency, which the replay uses as ``--max-concurrency`` (closed loop);
- ``log``: the arrival times of ``request_finished`` events in kvserve's JSON
  logs (record, then replay), see :func:`requests_from_logs`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvserve.bench.trace import CLASSES, TraceRequest


@dataclass(frozen=True)
class LengthDist:
    """A log-normal length with ``mean`` and coefficient of variation ``cv``, clipped."""

    mean: float
    cv: float = 0.5
    min: int = 1
    max: int = 1 << 20

    def sample(self, rng: np.random.Generator, scale: float = 1.0) -> int:
        mean = max(self.mean * scale, 1.0)
        if self.cv <= 0:
            value = mean
        else:
            sigma2 = math.log1p(self.cv ** 2)
            value = rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
        lo = max(1, int(round(self.min * scale)))
        return int(min(max(round(value), lo), self.max))


#: Default length distributions per class: field -> LengthDist.
DEFAULT_LENGTHS: dict[str, dict[str, LengthDist]] = {
    "short_qa": {"prompt": LengthDist(48, 0.5, 8, 512), "output": LengthDist(64, 0.5, 4, 512)},
    "rag": {"prompt": LengthDist(1536, 0.3, 256, 8192), "output": LengthDist(96, 0.5, 8, 512)},
    "code": {"prompt": LengthDist(384, 0.5, 32, 4096), "output": LengthDist(512, 0.4, 32, 4096)},
    "agent": {"prefix": LengthDist(1024, 0.0, 1, 8192), "state": LengthDist(160, 0.5, 8, 2048),
              "output": LengthDist(80, 0.5, 4, 1024)},
}
DEFAULT_MIX = {"short_qa": 0.4, "rag": 0.2, "code": 0.2, "agent": 0.2}

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will more can its about other into time only new some could these two may first "
    "then do any like my now over such our man me even most made after also did many before "
    "must through years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three house use during without again place "
    "around however home small found thought went say part once general high upon school every "
    "does got united left number course war until always away something fact though water less "
    "public put think almost hand enough far took head yet government system better set told "
    "nothing night end why called didn eyes find going look asked later knew point next city"
).split()


def synth_text(num_tokens: int, rng: np.random.Generator) -> str:
    """Filler text of about ``num_tokens`` tokens (common English words are one
    BPE token each with their leading space, for Llama-family tokenizers)."""
    idx = rng.integers(0, len(_WORDS), size=max(num_tokens, 1))
    return " ".join(_WORDS[i] for i in idx)


def arrival_offsets(n: int, process: str, rate: float | None = None, burstiness: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """``n`` arrival offsets in seconds, starting at 0, for ``process``
    (``poisson``, ``gamma`` or ``concurrency``; see the module doc)."""
    if n <= 0:
        return np.zeros(0)
    if process == "concurrency":
        return np.zeros(n)
    if rate is None or rate <= 0:
        raise ValueError(f"{process} arrivals need a positive rate, got {rate}")
    rng = np.random.default_rng(seed)
    if process == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    elif process == "gamma":
        if burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    else:
        raise ValueError(f"unknown arrival process {process!r}")
    return np.concatenate([[0.0], np.cumsum(gaps)])


def make_requests(n: int, mix: dict[str, float] | None = None, seed: int = 0, scale: float = 1.0,
                  lengths: dict[str, dict[str, LengthDist]] | None = None,
                  num_agents: int = 2, num_rag_docs: int = 8) -> list[TraceRequest]:
    """``n`` requests (arrival 0) drawn from the class ``mix`` with text prompts."""
    mix = dict(mix or DEFAULT_MIX)
    for name in mix:
        if name not in CLASSES:
            raise ValueError(f"unknown class {name!r}; classes are {', '.join(CLASSES)}")
    total = sum(mix.values())
    if total <= 0:
        raise ValueError("the mix ratios must add up to more than 0")
    names = list(mix)
    probs = np.array([mix[k] / total for k in names])
    dists = {k: dict(v) for k, v in DEFAULT_LENGTHS.items()}
    for cls, fields in (lengths or {}).items():
        dists.setdefault(cls, {}).update(fields)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(names), size=n, p=probs)
    # fixed per-agent instruction prefixes and per-document RAG contexts
    agent_prefix = {a: "You are agent %d. Follow these instructions exactly. " % a
                    + synth_text(dists["agent"]["prefix"].sample(np.random.default_rng(seed + 1000 + a),
                                                                 scale), np.random.default_rng(seed + 2000 + a))
                    for a in range(num_agents)}
    agent_step = dict.fromkeys(range(num_agents), 0)
    out = []
    for i, k in enumerate(picks):
        cls = names[k]
        d = dists[cls]
        req_id = f"r{i:05d}"
        group = None
        if cls == "short_qa":
            n_prompt = d["prompt"].sample(rng, scale)
            prompt = "Question: " + synth_text(n_prompt, rng) + "?"
        elif cls == "rag":
            n_prompt = d["prompt"].sample(rng, scale)
            doc = int(rng.integers(0, num_rag_docs))
            group = f"rag-doc{doc}"
            context = synth_text(n_prompt, np.random.default_rng(seed + 5000 + doc))
            prompt = ("Answer from the context.\nContext: " + context + "\nQuestion: "
                      + synth_text(max(8, n_prompt // 50), rng) + "?")
        elif cls == "code":
            n_prompt = d["prompt"].sample(rng, scale)
            prompt = "Write a Python function that " + synth_text(n_prompt, rng)
        else:  # agent
            agent = int(rng.integers(0, num_agents))
            group = f"agent{agent}"
            n_state = d["state"].sample(rng, scale)
            agent_step[agent] += 1
            prompt = (agent_prefix[agent] + f"\nStep {agent_step[agent]}. State: "
                      + synth_text(n_state, rng) + "\nNext action:")
            n_prompt = len(agent_prefix[agent].split()) + n_state + 4
        out.append(TraceRequest(id=req_id, arrival_s=0.0, cls=cls, prompt=prompt,
                                prompt_tokens=int(n_prompt), output_tokens=d["output"].sample(rng, scale),
                                prefix_group=group))
    return out


def with_arrivals(requests: list[TraceRequest], offsets: Iterable[float]) -> list[TraceRequest]:
    """Copies of ``requests`` with the given arrival offsets (rounded to microseconds)."""
    return [replace(r, arrival_s=round(float(t), 6)) for r, t in zip(requests, offsets, strict=True)]


# ------------------------------------------------------------------- record then replay

#: Field names that may carry a request's wall-clock arrival (first found wins).
ARRIVAL_FIELDS = ("arrival_wall_time", "arrival_unix_time", "arrival_unix", "arrival_time_unix",
                  "arrival_timestamp", "arrival_ts", "wall_arrival_time", "arrival_wall",
                  "arrival_time")
#: Field names of a request's end-to-end latency in seconds (to step back from the
#: event's finish ``timestamp`` when no arrival field is present).
E2E_FIELDS = ("e2e_s", "e2e_latency_s", "e2e_seconds", "latency_s", "duration_s", "e2e")


def _to_seconds(value) -> float | None:
    """A number (seconds; milliseconds if it looks like epoch ms) or an ISO-8601 string."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        v = float(value)
        return v / 1000.0 if v > 1e11 else v  # epoch milliseconds
    if isinstance(value, str):
        try:
            return _to_seconds(float(value))
        except ValueError:
            pass
        try:
            text = value.replace("Z", "+00:00")
            stamp = _dt.datetime.fromisoformat(text)
            if stamp.tzinfo is None:
                stamp = stamp.replace(tzinfo=_dt.timezone.utc)
            return stamp.timestamp()
        except ValueError:
            return None
    return None


def arrival_from_record(record: dict) -> tuple[float | None, str]:
    """The arrival time (s) of one ``request_finished`` record and how it was found:
    an arrival field, else the finish ``timestamp`` minus an E2E field, else the
    finish ``timestamp`` itself (then offsets are finish times, not arrivals)."""
    for key in ARRIVAL_FIELDS:
        if key in record:
            t = _to_seconds(record[key])
            if t is not None:
                return t, key
    finish = _to_seconds(record.get("timestamp") or record.get("time") or record.get("ts"))
    if finish is not None:
        for key in E2E_FIELDS:
            e2e = record.get(key)
            if isinstance(e2e, (int, float)):
                return finish - float(e2e), f"timestamp-{key}"
        return finish, "timestamp"
    return None, "none"


def read_finished_records(paths: Iterable[str | Path]) -> list[dict]:
    """The ``request_finished`` JSON objects of kvserve log files (other lines,
    JSON or not, are skipped; a line may have text before its ``{``)."""
    records = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                start = line.find("{")
                if start < 0 or "request_finished" not in line:
                    continue
                try:
                    record = json.loads(line[start:])
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and record.get("event") == "request_finished":
                    records.append(record)
    return records


def requests_from_logs(paths: Iterable[str | Path], seed: int = 0,
                       default_output_tokens: int = 64) -> tuple[list[TraceRequest], dict]:
    """A trace whose arrival offsets are those recorded in kvserve's logs.

    Each ``request_finished`` event gives one request: its arrival (see
    :func:`arrival_from_record`), ``prompt_tokens`` and ``output_tokens``,
    ``request_class`` and ``priority`` when logged. Prompts are not logged, so
    they are synthesized at the logged length. Returns the requests and a meta
    dict saying which field the arrivals came from.
    """
    records = read_finished_records(paths)
    rows = []
    sources: dict[str, int] = {}
    for rec in records:
        t, how = arrival_from_record(rec)
        if t is None:
            continue
        sources[how] = sources.get(how, 0) + 1
        rows.append((t, rec))
    if not rows:
        raise ValueError("no request_finished events with a usable time in the given logs")
    rows.sort(key=lambda row: row[0])
    t0 = rows[0][0]
    rng = np.random.default_rng(seed)
    out = []
    for i, (t, rec) in enumerate(rows):
        n_prompt = int(rec.get("prompt_tokens") or 16)
        cls = rec.get("request_class") or rec.get("class") or "default"
        prio = rec.get("priority")
        out.append(TraceRequest(
            id=str(rec.get("request_id") or f"r{i:05d}"), arrival_s=round(t - t0, 6), cls=str(cls),
            prompt=synth_text(n_prompt, rng), prompt_tokens=n_prompt,
            output_tokens=max(1, int(rec.get("output_tokens") or default_output_tokens)),
            priority=None if prio is None else int(prio)))
    return out, {"arrival_source": sources, "num_records": len(records)}
