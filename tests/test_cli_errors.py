"""A CLI that helps itself (issue 29, item 5): every user mistake is one line
on stderr and exit status 2, never a traceback, and says what is accepted;
``kvserve --version``; ``serve --help`` in argument groups with every
default shown; ``plan`` and ``serve`` take the same ``--dtype`` values;
``tools/*.py`` run outside the venv say how to run them."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cli import (SERVE_GROUPS, _HelpFormatter, build_parser, kvserve_version,
                         non_default_args)

REPO = Path(__file__).resolve().parents[1]
ACCEPTS = "pass a Hugging Face-layout folder (config.json, *.safetensors, tokenizer.json)"


def kvserve(*argv: str) -> subprocess.CompletedProcess:
    """``python -m kvserve.cli ARGV`` (a generous hang deadline, no time bound)."""
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *argv], capture_output=True,
                          text=True, timeout=180, cwd=REPO)


def error_lines(done: subprocess.CompletedProcess) -> list[str]:
    """The stderr lines that are not JSON log lines; asserts status 2 and no traceback."""
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if not line.startswith("{")]


def command_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


# --------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--log-level", "verbose"],
     "kvserve serve: error: argument --log-level: invalid choice: 'verbose' (choose from "
     "'debug', 'info', 'warning', 'error', 'critical'); see 'kvserve serve --help' for the "
     "options"),
    (["generate", "hi", "--log-level", "loud"],
     "kvserve generate: error: argument --log-level: invalid choice: 'loud' (choose from "
     "'debug', 'info', 'warning', 'error', 'critical'); see 'kvserve generate --help' for the "
     "options"),
    (["serve", "--max-len", "5"],
     "kvserve serve: error: unrecognized arguments: --max-len 5 (did you mean "
     "--max-model-len?); see 'kvserve serve --help' for the options"),
    (["serve", "--kv-cache-memory", "lots"],
     "kvserve serve: error: argument --kv-cache-memory: cannot parse size 'lots'; use e.g. "
     "512MiB, 1GiB, 2G; see 'kvserve serve --help' for the options"),
    (["serve", "--port", "70000"],
     "kvserve serve: error: argument --port: must be 0-65535, got 70000; see 'kvserve serve "
     "--help' for the options"),
    (["diagnose", "--url", "http://127.0.0.1:1", "--tpot-target", "-1"],
     "kvserve diagnose: error: argument --tpot-target: must be a positive number of seconds, "
     "got '-1'; see 'kvserve diagnose --help' for the options"),
    (["analyze", "server.log", "--ttft-target", "nan"],
     "kvserve analyze: error: argument --ttft-target: must be a positive number of seconds, "
     "got 'nan'; see 'kvserve analyze --help' for the options"),
])
def test_a_usage_mistake_is_one_line_naming_what_is_accepted(argv, expected) -> None:
    assert error_lines(kvserve(*argv)) == [expected]


@pytest.mark.parametrize("command", ["serve", "plan"])
def test_plan_and_serve_refuse_the_same_dtypes(command: str) -> None:
    assert error_lines(kvserve(command, "--dtype", "bfloat16")) == [
        f"kvserve {command}: error: argument --dtype: invalid choice: 'bfloat16' (choose from "
        f"'auto', 'float32', 'float16'); see 'kvserve {command} --help' for the options"]
    assert ([a.choices for a in command_parser("plan")._actions if a.dest == "dtype"]
            == [a.choices for a in command_parser("serve")._actions if a.dest == "dtype"])


def test_an_unknown_flag_is_reported_by_its_command_with_the_nearest_flags() -> None:
    (line,) = error_lines(kvserve("plan", "--kv-cache-memroy", "1GiB", "--jsn"))
    assert line == ("kvserve plan: error: unrecognized arguments: --kv-cache-memroy 1GiB --jsn "
                    "(--kv-cache-memroy: did you mean --kv-cache-memory?) (--jsn: did you mean "
                    "--json?); see 'kvserve plan --help' for the options")


# --------------------------------------------------------------------------- --model


def make_gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic is enough: nothing reads it
    return path


def test_an_unreadable_gguf_file_says_so_in_one_line(tmp_path: Path) -> None:
    gguf = make_gguf(tmp_path / "model-q4_0.gguf")
    (line,) = error_lines(kvserve("serve", "--model", str(gguf), "--port", "0"))
    assert line.startswith(f"kvserve: error: --model {gguf}: cannot convert it: {gguf}: not a "
                           "readable GGUF file")


def test_a_hub_id_says_kvserve_serves_local_folders_and_how_to_get_the_default(
        tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "hi", "--model",
                           "HuggingFaceTB/SmolLM2-135M-Instruct"], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path)  # no such folder under cwd
    assert error_lines(done) == [
        "kvserve: error: --model HuggingFaceTB/SmolLM2-135M-Instruct: no such folder; kvserve "
        "serves local folders and does not fetch model ids from a hub: download the checkpoint "
        "(config.json, *.safetensors, tokenizer.json) and pass its folder, or leave --model out "
        "to serve the default model (SmolLM2-135M-Instruct) (`kvserve fetch-model` fetches it)"]
    assert done.stdout == ""


def test_a_missing_folder_says_what_is_accepted(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    assert error_lines(kvserve("serve", "--model", str(missing), "--port", "0")) == [
        f"kvserve: error: --model {missing}: no such folder; {ACCEPTS} of a llama, mistral, "
        "qwen2, qwen3, phi3 or gemma3 model, or a .gguf file, or leave --model out for the default model "
        "(SmolLM2-135M-Instruct)"]


# --------------------------------------------------------------------------- help, version


def test_version_flag_prints_the_package_version() -> None:
    done = kvserve("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"kvserve {kvserve_version()}\n",
                                                           "")


def test_serve_help_lists_its_flags_in_groups() -> None:
    done = kvserve("serve", "--help")
    assert done.returncode == 0
    headings = [line[:-1] for line in done.stdout.splitlines()
                if line.endswith(":") and not line.startswith(" ")]
    assert headings == ["options", *(name for name, _ in SERVE_GROUPS)]
    assert done.stdout.startswith("usage: kvserve serve [options]\n")
    groups = {group.title: [a.dest for a in group._group_actions]
              for group in command_parser("serve")._action_groups}
    assert {"model", "max_model_len", "dtype"} <= set(groups["model"])
    assert {"kv_cache_memory", "block_size"} <= set(groups["cache"])
    assert {"host", "port", "api_key"} <= set(groups["server"])
    assert {"log_format", "log_level", "log_prompts"} <= set(groups["observability"])
    assert {"data_parallel_size", "ray_address"} <= set(groups["distributed"])


@pytest.mark.parametrize("command", ["serve", "generate", "plan"])
def test_every_flag_has_help_that_shows_its_default(command: str) -> None:
    parser = command_parser(command)
    formatter = _HelpFormatter(prog=parser.prog)
    undocumented = [a.dest for a in parser._actions if a.option_strings and not a.help]
    assert command == "generate" or not undocumented, undocumented
    no_default = [a.dest for a in parser._actions if a.option_strings and a.dest != "help"
                  and "default" not in formatter._get_help_string(a).lower()]
    assert not no_default, no_default


def test_help_shows_the_values_of_defaults() -> None:
    text = command_parser("serve").format_help()
    for shown in ("tokens per KV block (default: 16)", "(default: 8000)", "(default: 1GiB)",
                  "turn automatic prefix caching off (default: on)",
                  "on purpose (kvserve.testing.faults); never in production (default: none)"):
        assert shown in " ".join(text.split()), shown


def test_non_default_args_are_the_flags_given_with_the_api_key_hidden() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--port", "9000", "--api-key", "secret",
                              "--kv-cache-memory", "2GiB", "--block-size", "16"])
    assert non_default_args(command_parser("serve"), args) == {
        "port": 9000, "api_key": "<hidden>", "kv_cache_memory": "2GiB"}
    gen = parser.parse_args(["generate", "a private prompt", "-v"])
    assert non_default_args(command_parser("generate"), gen) == {"log_level": "info"}


# --------------------------------------------------------------------------- tools/


#: The tools/ scripts that import kvserve (a script that needs only the
#: standard library and its own optional imports runs anywhere).
TOOL_SCRIPTS = sorted(p.name for p in (REPO / "tools").glob("*.py")
                      if re.search(r"^\s*(from|import) kvserve\b", p.read_text(encoding="utf-8"),
                                   re.MULTILINE))


def test_the_tools_that_need_kvserve_are_found() -> None:
    assert {"sweep.py", "soak.py", "bench_kernels.py", "gpu_check.py"} <= set(TOOL_SCRIPTS)


@pytest.mark.parametrize("script", TOOL_SCRIPTS)
def test_a_tool_run_outside_the_venv_says_how_to_run_it(script: str) -> None:
    # -S: no site-packages, so no kvserve (as with a system Python); the stdlib stays
    done = subprocess.run([sys.executable, "-S", f"tools/{script}", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr == (f"tools/{script}: needs the kvserve package, which {sys.executable} "
                           f"does not have: run .venv/bin/python tools/{script} (`make "
                           "install` creates the venv)\n")
