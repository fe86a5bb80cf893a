"""Acceptance (issue 15, item 3): NVIDIA's ``aiperf`` benchmark client runs
unmodified against kvserve, offline, with zero errors.

Not in ``make test`` (marker ``clients``): aiperf brings ~150 packages, so it
lives in a venv of its own, ``.venv-clients`` (``make bench-clients``), and
``make test-clients`` runs this. Without that venv the test fails and says
how to make it. aiperf finds the tokenizer because the server is started
with ``--served-model-name`` = the checkpoint folder (the recipe in docs/benchmarks/README.md).
Offline: this machine reaches no model hub. ``HF_HUB_OFFLINE`` is left unset
because aiperf 0.13 then looks a tokenizer up only among cached hub
snapshots, never in a local folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_support import LiveServer  # noqa: E402

pytestmark = [pytest.mark.clients, pytest.mark.model, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
AIPERF = REPO / ".venv-clients" / "bin" / "aiperf"
REQUESTS = 8


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    live = LiveServer(default_model_path, tmp_path_factory.mktemp("aiperf"),
                      extra_args=["--max-model-len", "1024",
                                  "--served-model-name", str(default_model_path)])
    yield live
    live.stop()


def test_aiperf_profile_runs_offline_with_zero_errors(server, default_model_path, tmp_path):
    assert AIPERF.exists(), f"{AIPERF} is missing: run `make bench-clients` first"
    command = [str(AIPERF), "profile", "--model", str(default_model_path),
               "--url", server.base_url, "--endpoint-type", "chat", "--streaming",
               "--tokenizer", str(default_model_path), "--request-count", str(REQUESTS),
               "--concurrency", "2", "--isl", "64", "--osl", "16", "--ui", "none",
               "--artifact-dir", str(tmp_path)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    exports = list(tmp_path.rglob("profile_export_aiperf.json"))
    assert exports, f"no profile export under {tmp_path}: {done.stdout[-2000:]}"
    summary = json.loads(exports[0].read_text())
    assert summary["request_count"]["avg"] == REQUESTS, summary.get("request_count")
    errors = summary.get("error_request_count", {}).get("avg", 0) or 0
    assert errors == 0, summary.get("error_summary")
