"""Analyse a kvserve JSON-lines log: per-request phase breakdown, p50/p90/p99
and mean of queue, prefill, TTFT, TPOT and E2E by workload class, prompt-length
bucket, priority and streaming, throughput over time, a bottleneck diagnosis
with its evidence, a Markdown report and PNG plots.

    python tools/analyze_logs.py server.log [--out DIR] [--json] [--no-plots]

Same as ``kvserve analyze``; the code is ``kvserve.observability.analysis`` (rules in
``kvserve.observability.diagnosis``, shared with ``kvserve diagnose --url``).
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import sys

from kvserve.observability.analysis import main

if __name__ == "__main__":
    sys.exit(main())
