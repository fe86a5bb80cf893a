"""Benchmark tooling: workload traces, trace replay, sweeps and a regression gate.

``kvserve.bench`` is the importable core of the scripts in ``tools/``
(``make_trace.py``, ``replay.py``, ``sweep.py``, ``compare.py``), so that
``kvserve bench`` and the tests use the same code. Nothing here imports the
engine: the replay client talks to any OpenAI-compatible server over HTTP.

Modules:
    trace     the JSONL trace format (one request per line), read/write, hash
    workload  workload classes, length distributions, arrival processes,
              and traces recorded from kvserve's ``request_finished`` logs
    replay    the asyncio httpx client, per-request metrics, summaries,
              goodput, provenance, result JSON
    compare   two result JSONs metric by metric, with thresholds
    sweep     replay over the values of one variable, plots, saturation point
    server    start/stop a ``kvserve serve`` subprocess (sweeps, ``make bench``)

Soak and hostile traffic live in ``kvserve.testing`` (``tools/soak.py``).
"""

#: Version of the bench tools and of their result-JSON schema.
BENCH_VERSION = "1.0"
