"""A start-up that speaks and fails fast (issue 29, items 4 and 6): the
version and non-default-arguments lines first; a busy port, a
``--max-model-len`` the model or the KV cache cannot hold and a KV cache
that holds no block refused in one line before any weight loads; ``/health``
503 ``{"status": "loading"}`` while the engine loads; progress lines during
a long load; ``--log-format auto`` by whether stderr is a terminal.

A tiny checkpoint (config.json, zero weights, a placeholder tokenizer.json)
is enough: every refusal here comes before the weights or the tokenizer are
read. No test here bounds a duration; the timeouts are hang deadlines.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import structlog
from safetensors.numpy import save_file
from structlog.testing import capture_logs

from kvserve import cli
from kvserve.api.app import LoadingGate
from kvserve.api.server import DrainingServer, PortUnavailable, bind_socket
from kvserve.cli import generate as generate_command
from kvserve.cli import serve as serve_command
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.observability.log import LoadProgress, configure_logging, resolve_log_format
from kvserve.startup import check_before_load

#: 2 layers x 1 KV head x head_dim 4 x float32: 64 bytes of K and V per token,
#: 1,024 bytes per 16-token block; a context of 64 tokens.
TINY = {"model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 4, "max_position_embeddings": 64, "tie_word_embeddings": True,
        "eos_token_id": 2}
HANG_DEADLINE = 180


@pytest.fixture()
def tiny_model(tmp_path: Path) -> Path:
    """A checkpoint folder of the layout ``--model`` takes."""
    from kvserve.model.loader import expected_tensor_shapes, load_model_config

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    shapes = expected_tensor_shapes(load_model_config(tmp_path))
    save_file({name: np.zeros(shape, np.float32) for name, shape in shapes.items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "tokenizer.json").write_text("{}")  # never read by what these tests reach
    return tmp_path


def serve(model: Path, *flags: str, stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    """``kvserve serve --model model FLAGS`` (JSON logs: stderr is no terminal)."""
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model),
                           *flags], stdout=subprocess.PIPE, stderr=stderr, text=True,
                          timeout=HANG_DEADLINE)


def split_stderr(done: subprocess.CompletedProcess) -> tuple[list[dict], list[str]]:
    """(the JSON log events, the other lines) of ``done``'s stderr; asserts
    exit status 2 and no traceback."""
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    return ([json.loads(line) for line in lines if line.startswith("{")],
            [line for line in lines if not line.startswith("{")])


@pytest.fixture()
def busy_port() -> Iterator[int]:
    """A port another socket listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- refused at once


def test_a_busy_port_is_one_line_before_anything_loads(tiny_model: Path, busy_port: int) -> None:
    events, errors = split_stderr(serve(tiny_model, "--port", str(busy_port)))
    assert errors == [f"kvserve: error: port {busy_port} is already in use on 127.0.0.1 "
                      "(another server, or an earlier kvserve, listens there): stop it or give "
                      "another --port"]
    names = [e["event"] for e in events]
    assert names[:2] == ["version", "non_default_args"]  # first, as vLLM's start-up
    assert "engine_loading" not in names and "startup_step" not in names
    assert events[0]["message"] == f"kvserve {cli.kvserve_version()}"
    assert events[1]["args"] == {"model": str(tiny_model), "port": busy_port}
    assert events[1]["message"] == f"non-default args: {events[1]['args']}"


@pytest.mark.parametrize("flags, expected", [
    (["--max-model-len", "100"],
     "--max-model-len 100 is larger than the model's context length, 64 tokens "
     "(max_position_embeddings in {model}/config.json); give at most 64"),
    (["--max-model-len", "64", "--kv-cache-memory", "2KiB"],
     "--max-model-len 64 needs 4,096 bytes of KV cache for one request (64 bytes per token), "
     "more than --kv-cache-memory 2,048 bytes holds (32 tokens); give --max-model-len 32 or "
     "less, or --kv-cache-memory 1MiB or more"),
    (["--kv-cache-memory", "1000"],
     "--kv-cache-memory 1000 bytes holds no KV block (one block of 16 tokens needs 1024 "
     "bytes)"),
])
def test_what_plan_can_judge_is_refused_before_loading(tiny_model: Path, flags: list[str],
                                                       expected: str) -> None:
    events, errors = split_stderr(serve(tiny_model, "--port", "0", *flags))
    assert errors == ["kvserve: error: " + expected.format(model=tiny_model)]
    names = [e["event"] for e in events]
    assert "engine_loading" not in names and "server_listening" not in names


def test_the_cache_check_counts_a_draft_models_kv(tiny_model: Path) -> None:
    from kvserve.config import SpeculativeConfig

    spec = SpeculativeConfig(method="draft_model", model=str(tiny_model),
                             num_speculative_tokens=2)
    config = EngineConfig(model=str(tiny_model), cache=CacheConfig(kv_cache_memory=4096),
                          scheduler=SchedulerConfig(speculative=spec))
    check_before_load(config, 32)  # 64 bytes per token x 2 models: 32 tokens fit
    with pytest.raises(ValueError, match=r"holds \(32 tokens\); give --max-model-len 32 or less"):
        check_before_load(config, 48)
    check_before_load(EngineConfig(model=str(tiny_model), cache=CacheConfig(kv_cache_memory=4096)),
                      64)  # without the draft: 64 tokens fit


def test_on_cuda_only_the_context_is_judged_before_loading(tiny_model: Path) -> None:
    config = EngineConfig(model=str(tiny_model), backend="cuda",
                          cache=CacheConfig(kv_cache_memory=1))  # not the cuda KV memory
    check_before_load(config, 64)
    with pytest.raises(ValueError, match="larger than the model's context length, 64 tokens"):
        check_before_load(config, 65)


def test_a_loaded_engine_shorter_than_asked_is_refused_with_the_numbers() -> None:
    class Engine:
        max_model_len = 48
        stopped = False

        async def shutdown(self) -> None:
            self.stopped = True

    engine = Engine()
    args = cli.build_parser().parse_args(["serve", "--max-model-len", "64"])
    with pytest.raises(cli._StartupError) as refused:
        asyncio.run(cli._refuse_unfit_max_model_len(args, engine))
    assert str(refused.value) == ("--max-model-len 64 does not fit: the KV cache holds 48 "
                                  "tokens; give --max-model-len 48 or less, or more memory "
                                  "(--gpu-memory-utilization, --kv-cache-memory)")
    assert engine.stopped
    asyncio.run(cli._refuse_unfit_max_model_len(
        cli.build_parser().parse_args(["serve"]), Engine()))  # not asked: the cache's length


def test_bind_socket_names_the_problem(busy_port: int) -> None:
    with pytest.raises(PortUnavailable) as busy:
        bind_socket("127.0.0.1", busy_port)
    assert "already in use" in busy.value.strerror and "--port" in busy.value.strerror
    with pytest.raises(PortUnavailable, match="not an address of this machine"):
        bind_socket("192.0.2.1", 0)  # TEST-NET-1: never local
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


# --------------------------------------------------------------------------- /health loading


def asgi_get(app, path: str) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of ``GET path`` on the ASGI ``app``."""
    import httpx

    async def get():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path)

    response = asyncio.run(get())
    return response.status_code, dict(response.headers), response.json()


def test_the_gate_answers_503_loading_until_opened() -> None:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    gate = LoadingGate()
    status, headers, body = asgi_get(gate, "/health")
    assert (status, body, headers["retry-after"]) == (503, {"status": "loading"}, "1")
    status, _, body = asgi_get(gate, "/v1/models")
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    assert "loading" in body["error"]["message"]

    async def health(request):
        return JSONResponse({"status": "ok"})

    gate.open(Starlette(routes=[Route("/health", health)]))
    assert asgi_get(gate, "/health")[::2] == (200, {"status": "ok"})
    assert not gate.loading


class HeldEngine:
    """What ``_start_engine`` returns in the held-load test: ready, no stalls."""

    model_name = "tiny"
    max_model_len = 64
    metrics = None

    def __init__(self) -> None:
        self.stopped = False

    def is_ready(self) -> bool:
        return True

    async def shutdown(self) -> None:
        self.stopped = True


@pytest.fixture()
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level, config = list(root.handlers), root.level, structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.configure(**config)


def http_get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_health_is_503_loading_while_the_engine_loads(tiny_model: Path, monkeypatch,
                                                      capsys, restore_logging) -> None:
    release, servers = threading.Event(), []
    engine = HeldEngine()

    async def held_start(config, *args, **kwargs):
        await asyncio.to_thread(release.wait, HANG_DEADLINE)
        return engine

    class RecordedServer(DrainingServer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            servers.append(self)

    monkeypatch.setattr(serve_command, "start_engine", held_start)
    monkeypatch.setattr("kvserve.api.server.DrainingServer", RecordedServer)
    port = free_port()
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(cli.main(
        ["serve", "--model", str(tiny_model), "--port", str(port), "--log-format", "json"])))
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        while True:  # until the server listens (a refused connection before)
            try:
                answer = http_get(url + "/health")
                break
            except OSError:
                assert thread.is_alive()
                release.wait(0.05)
        assert answer == (503, {"status": "loading"})
        assert http_get(url + "/v1/models")[0] == 503
        assert servers and servers[0].engine is None  # a signal now exits at once
    finally:
        release.set()
    while http_get(url + "/health") != (200, {"status": "ok"}):
        assert thread.is_alive()
        release.wait(0.05)
    assert servers[0].engine is engine
    servers[0].should_exit = True
    thread.join(HANG_DEADLINE)
    assert status == [0] and engine.stopped
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line JSON, uvicorn's included
    names = [e["event"] for e in events]
    assert names[:2] == ["version", "non_default_args"]
    assert "Started server process [%d]" % os.getpid() in names
    assert names.index("server_listening") < names.index("server_ready")


def test_a_signal_while_loading_exits_at_once_with_status_0() -> None:
    import uvicorn

    exits: list[int] = []
    server = DrainingServer(uvicorn.Config(LoadingGate()), None, drain_timeout=30,
                            exit_process=exits.append)
    with capture_logs() as logs:
        server.handle_exit(signal.SIGTERM, None)
    assert exits == [0]
    assert [e["event"] for e in logs] == ["shutdown_while_loading"]


# --------------------------------------------------------------------------- progress


def test_progress_speaks_at_least_every_interval_while_a_step_runs() -> None:
    now = [100.0]
    progress = LoadProgress(structlog.get_logger("test"), interval=5.0, clock=lambda: now[0])
    with capture_logs() as logs:
        with progress.step("weights", "loading the weights"):
            beats = []
            for t in (103.0, 105.0, 107.0, 110.0, 112.5):
                now[0] = t
                beats.append(progress.heartbeat())
            now[0] = 113.0
        now[0] = 120.0
        assert not progress.heartbeat()  # no step runs: nothing to say
    assert beats == [False, True, False, True, False]
    assert [(e["event"], e.get("elapsed_s", e.get("seconds"))) for e in logs] == [
        ("startup_progress", 5.0), ("startup_progress", 10.0), ("startup_step", 13.0)]
    assert logs[0]["message"] == "Still loading the weights (5 s so far)..."
    assert logs[2]["message"] == "Done loading the weights in 13.0 s"


def test_progress_thread_logs_while_a_step_blocks() -> None:
    release = threading.Event()
    with capture_logs() as logs:
        with LoadProgress(structlog.get_logger("test"), interval=0.05) as progress:
            with progress.step("warm_up", "warming up"):
                while not any(e["event"] == "startup_progress" for e in list(logs)):
                    release.wait(0.01)
    assert logs[0]["step"] == "warm_up" and logs[-1]["event"] == "startup_step"


# --------------------------------------------------------------------------- log format


def test_auto_log_format_is_console_on_a_terminal_and_json_elsewhere() -> None:
    assert resolve_log_format("auto", isatty=True) == "console"
    assert resolve_log_format("auto", isatty=False) == "json"
    assert resolve_log_format("json", isatty=True) == "json"
    assert resolve_log_format("console", isatty=False) == "console"
    with pytest.raises(ValueError, match="log format must be one of auto, json, console"):
        resolve_log_format("xml")
    assert cli.build_parser().parse_args(["serve"]).log_format == "auto"


def test_console_lines_show_the_message(restore_logging) -> None:
    sink = io.StringIO()
    configure_logging("console", "info", stream=sink)
    log = structlog.get_logger("test")
    log.info("version", version="1.2", message="kvserve 1.2")
    log.info("server_ready")
    first, second = sink.getvalue().splitlines()
    assert first.endswith("[info     ] kvserve 1.2")
    assert "[info     ] server_ready" in second


def test_a_start_on_a_terminal_logs_for_people(tiny_model: Path, busy_port: int) -> None:
    import pty

    main, child = pty.openpty()
    try:
        done = serve(tiny_model, "--port", str(busy_port), stderr=child)
        os.close(child)
        child = -1
        text = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # EIO: the terminal's other end is closed and read out
                break
            if not chunk:
                break
            text += chunk
    finally:
        os.close(main)
        if child >= 0:
            os.close(child)
    assert done.returncode == 2
    lines = text.decode().splitlines()
    assert not any(line.startswith("{") for line in lines), lines
    assert lines[0].endswith(f"[info     ] kvserve {cli.kvserve_version()}")
    assert "non-default args: {" in lines[1]
    assert lines[-1].startswith(f"kvserve: error: port {busy_port} is already in use")


def test_a_drained_signal_is_not_raised_again_after_the_server_stops():
    """uvicorn re-raises the signal that stopped it once it has shut down;
    under asyncio that cancels the CLI's main task and an idle server's
    Ctrl-C ended in a KeyboardInterrupt traceback. DrainingServer's drain
    handled it already: leaving ``capture_signals`` raises nothing."""
    import uvicorn

    from kvserve.api.server import DrainingServer

    async def app(scope, receive, send):  # pragma: no cover - never called
        pass

    server = DrainingServer(uvicorn.Config(app), engine=None, drain_timeout=0.0)
    with server.capture_signals():
        server._captured_signals.append(signal.SIGINT)  # what handle_exit records
    # reaching this line is the test: no KeyboardInterrupt was raised
    assert server._captured_signals == []


# --------------------------------------------------------------------------- compile ahead


@pytest.mark.model
def test_warmup_starts_the_engine_of_its_flags_then_exits(default_model_path: Path) -> None:
    """Issue 48 item 6: ``kvserve warmup FLAGS`` loads and compiles what those
    flags use (the ``warm_up`` step), stops, and says so on stdout."""
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "warmup", "--model",
                           str(default_model_path), "--kv-cache-memory", "64MiB"],
                          capture_output=True, text=True, timeout=HANG_DEADLINE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("kvserve warmup: the engine of these flags started in ")
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    steps = [e["step"] for e in events if e["event"] == "startup_step"]
    assert steps[-1] == "warm_up" and "weights" in steps
    assert "Traceback" not in done.stderr


@pytest.mark.model
def test_a_quiet_generate_says_why_it_waits_once(default_model_path: Path, monkeypatch,
                                                 capsys, restore_logging) -> None:
    """Issue 48 item 6: ``kvserve generate`` (no log lines by default) was
    silent for the whole start; past ``GENERATE_NOTICE_S`` it prints one line
    saying what it does and how to do it ahead, then only the answer."""
    monkeypatch.setattr(generate_command, "GENERATE_NOTICE_S", 0.0)
    assert cli.main(["generate", "--model", str(default_model_path), "--kv-cache-memory",
                     "64MiB", "--max-tokens", "2", "Hi"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [cli.GENERATE_NOTICE]
    assert out.strip()  # the answer
