"""A serving path that imports only what it serves (issue 27, item 4).

Each check runs in a fresh interpreter, so that what earlier tests imported
does not count: importing the engine and the API loads none of the optional
libraries (Ray, llguidance, the bench extra's httpx, tqdm and matplotlib)
and ``import kvserve`` changes no environment variable; the ``kvserve``
command sets the thread pools' variables before NumPy loads; replicas
without Ray are one line naming the extra to install, before anything loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvserve.cli import DISTRIBUTED_EXTRA
from kvserve.thread_env import THREAD_POOL_ENV

ROOT = Path(__file__).resolve().parents[1]
#: Loaded on first use, never by importing the engine or the API.
OPTIONAL = ("ray", "llguidance", "matplotlib", "httpx", "tqdm")
#: Test, soak and bench tooling of the package: never on the serving path.
TOOLING = ("kvserve.testing", "kvserve.bench", "kvserve.observability.analysis")


def run_fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter whose environment lacks the thread pools'
    variables (this process's conftest set them), plus ``env``."""
    environ = {k: v for k, v in os.environ.items() if k not in THREAD_POOL_ENV}
    return subprocess.run([sys.executable, "-c", code], env={**environ, **env},
                          capture_output=True, text=True, timeout=120, check=False)


def test_importing_the_engine_and_the_api_loads_no_optional_library_nor_changes_the_env():
    result = run_fresh(
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "import kvserve\n"
        "after_kvserve = dict(os.environ)\n"
        "import kvserve.engine, kvserve.api.app\n"
        "print(json.dumps({'kvserve': after_kvserve == before,\n"
        "                  'all': dict(os.environ) == before,\n"
        f"                  'loaded': [m for m in {OPTIONAL!r} if m in sys.modules]}}))\n")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"kvserve": True, "all": True, "loaded": []}


# The environment when NumPy is first imported, seen by a finder ahead of the others.
_ENV_AT_NUMPY = """\
import json, os, sys

seen = {}

class Spy:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "numpy" and not seen:
            seen.update({k: os.environ.get(k) for k in %r})

sys.meta_path.insert(0, Spy)
from kvserve.cli import main
try:
    main(["bench", "--help"])  # the replay client loads NumPy
except SystemExit:
    pass
print(json.dumps(seen))
"""


def test_the_command_sets_the_thread_pool_env_before_numpy_loads():
    result = run_fresh(_ENV_AT_NUMPY % (list(THREAD_POOL_ENV),))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == THREAD_POOL_ENV


def test_a_thread_pool_value_already_in_the_environment_wins():
    result = run_fresh(_ENV_AT_NUMPY % (list(THREAD_POOL_ENV),), OPENBLAS_THREAD_TIMEOUT="7")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {**THREAD_POOL_ENV,
                                                          "OPENBLAS_THREAD_TIMEOUT": "7"}


# ``kvserve serve`` with Ray hidden (None in sys.modules: not found, not importable).
_SERVE_WITHOUT_RAY = """\
import json, sys

sys.modules["ray"] = None
from kvserve.cli import main
try:
    status = main(["serve", "--backend", "cpu", "--model", "/nonexistent/model", *%r])
except SystemExit as exc:
    status = exc.code
print(json.dumps({"status": status, "loaded": [m for m in ("kvserve.engine",
      "kvserve.model.backend", "kvserve.model.loader") if m in sys.modules]}))
"""


@pytest.mark.parametrize("flags", [["--data-parallel-size", "2"],
                                   ["--prefill-replicas", "1", "--decode-replicas", "1"]])
def test_replicas_without_ray_are_one_line_naming_the_extra_before_anything_loads(flags):
    result = run_fresh(_SERVE_WITHOUT_RAY % (flags,))
    assert json.loads(result.stdout) == {"status": 2, "loaded": []}
    [line] = result.stderr.splitlines()
    assert line.startswith(f"kvserve: error: {flags[0]}")
    assert line.endswith(f"Ray, which is not installed: {DISTRIBUTED_EXTRA}")


@pytest.mark.parametrize("flags", [[], ["--kv-offloading-size", "0.01"]])
def test_one_engine_needs_no_ray(flags):
    """One engine, with or without the offload tier (shared memory, no Ray),
    gets past the Ray check: to the missing model folder here."""
    result = run_fresh(_SERVE_WITHOUT_RAY % (flags,))
    assert json.loads(result.stdout)["status"] == 2
    assert "/nonexistent/model: no such folder" in result.stderr
    assert "kvserve[distributed]" not in result.stderr


def test_ray_is_the_distributed_extra_and_the_test_install_brings_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    assert not any(r.startswith("ray") for r in project["dependencies"])
    assert extras["distributed"] == ["ray>=2.40"]
    assert "kvserve[distributed]" in extras["test"]


_LOADED_BY_SERVE = """\
import json, sys
import kvserve.engine, kvserve.api.app
from kvserve.cli import build_parser
build_parser("serve").parse_args(["serve"])
print(json.dumps(sorted(m for m in sys.modules if m.startswith(%r))))
"""


def test_the_serving_path_and_the_serve_command_import_no_test_or_bench_tooling():
    result = run_fresh(_LOADED_BY_SERVE % (TOOLING,))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    # and the faults module comes in with a config that injects faults only
    engine_source = (ROOT / "src" / "engine.py").read_text()
    assert "\nfrom kvserve.testing" not in engine_source


def test_the_tool_commands_still_parse_their_own_arguments():
    from kvserve.cli import build_parser

    assert build_parser("analyze").parse_args(["analyze", "log.jsonl"]).command == "analyze"
    full = build_parser()
    assert {"analyze", "bench"} <= set(full._subparsers._group_actions[0].choices)
