"""Start and stop a server subprocess for a benchmark (``kvserve serve`` by
default, or any command with a ``{port}`` placeholder), waiting for health."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` in the main thread, so ``finally``
    blocks stop the servers this process launched."""
    import signal

    def _exit(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on a free port; its output goes to ``log_path``.

    Args:
        server_args: extra ``kvserve serve`` flags (ignored with ``command``).
        command: a full command line with ``{port}`` (e.g. a vLLM or llama.cpp
            server); default ``python -m kvserve.cli serve --port {port} ...``.
        log_path: file for the server's stdout and stderr (its JSON logs); default
            ``kvserve-bench-server-PORT.log`` in the temp folder.
        health_paths: paths polled until one answers 200.
        env: variables added to this process's environment for the server.
    """

    def __init__(self, server_args: Sequence[str] = (), command: str | None = None,
                 log_path: str | Path | None = None, start_timeout: float = 600.0,
                 health_paths: Sequence[str] = ("/health", "/v1/models"),
                 env: Mapping[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        if command:
            self.args = shlex.split(command.format(port=self.port))
        else:
            self.args = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1",
                         "--port", str(self.port), "--log-format", "json", *server_args]
        self.log_path = (Path(log_path) if log_path else  # default: not in the working tree
                         Path(tempfile.gettempdir()) / f"kvserve-bench-server-{self.port}.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL,
                                     env={**os.environ, **env} if env else None)
        self.health_paths = tuple(health_paths)
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.stop()
            raise
        #: Seconds from the process's start to its first healthy answer.
        self.ready_seconds = round(time.monotonic() - started, 2)

    def memory(self) -> dict[str, int] | None:
        """``{"peak_rss_bytes": VmHWM, "rss_bytes": VmRSS}`` of the server
        process from ``/proc/PID/status`` (peak: the high-water mark since it
        started, mapped file pages it touched included), or None where there
        is no such file (not Linux, or the process is gone)."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text(encoding="ascii")
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            return {"peak_rss_bytes": int(fields["VmHWM"].split()[0]) * 1024,
                    "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024}
        except (KeyError, ValueError, IndexError):
            return None

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was "
                                   f"healthy; log tail:\n{self.log_tail()}")
            for path in self.health_paths:
                try:
                    if httpx.get(self.base_url + path, timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    break
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {timeout} s; log tail:\n{self.log_tail()}")

    def log_tail(self, max_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-max_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
