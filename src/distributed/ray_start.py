"""Which Ray to start or join, decided before ``ray.init`` can hang on it.

``ray.init()`` with no address joins the cluster that the last ``ray start``
on this machine recorded in ``<ray temp dir>/ray_current_cluster``, and when
that cluster is gone without a ``ray stop`` it retries "Failed to connect to
GCS at address ..." for minutes: a server that never becomes healthy.
kvserve therefore looks first:

- ``--ray-address`` (or ``RAY_ADDRESS``) names a cluster: it must answer a
  TCP connect within ``PROBE_SECONDS``, else ``RayUnreachable`` (one line,
  exit status 2): the user asked for that cluster, starting another would
  hide the mistake. ``local`` is passed through (always a new local Ray).
- Nothing named, a recorded cluster that answers: join it (Ray's own rule).
- Nothing named, a recorded cluster that does not answer: one warning
  (``ray_recorded_cluster_gone``) and ``address="local"``: a new local Ray.
- Nothing named or recorded: ``None``, and ``ray.init`` starts a local Ray.

The record's path follows Ray's: ``$RAY_TMPDIR/ray``, else on Linux
``$TMPDIR/ray``, else ``/tmp/ray`` (``ray._common.utils``; read here
without importing Ray). A TCP connect to the GCS port is what a dead
cluster fails at once (connection refused) and what a live one accepts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

import structlog

log = structlog.get_logger("kvserve.distributed")

#: How Ray forwards the actors' log lines to this process's stderr: each
#: line as the actor wrote it (a JSON object carrying ``replica`` or
#: ``stage``), with no "(EngineReplica pid=...)" prefix or colour codes, and
#: none folded into "[repeated Nx]" (every request's events must reach the log).
RAY_LOG_ENV = {"RAY_DISABLE_WORKER_LOG_PREFIX": "1", "RAY_COLOR_PREFIX": "0",
               "RAY_DEDUP_LOGS": "0"}
#: Ray starts its worker processes at nice 15 (its ``worker_niceness``), made
#: for batch jobs; kvserve's replicas and pipeline stages are the server's
#: compute, so they run at the server's own priority (Ray's job manager sets
#: 0 for its jobs too). A value in the environment is kept.
#: Ray's memory monitor kills the newest retriable worker whenever the node
#: passes its memory threshold (``memory_usage_threshold``, 0.95 by
#: default), whoever used it: on a busy host that was a replica or a
#: pipeline stage, i.e. the server itself (issue 47, item 11). kvserve sizes
#: its KV cache from free memory at start-up; the kernel's out-of-memory
#: killer still guards the machine. A value in the environment is kept.
RAY_WORKER_ENV = {"RAY_worker_niceness": "0", "RAY_memory_monitor_refresh_ms": "0"}
#: Seconds a named or recorded cluster has to accept a TCP connect.
PROBE_SECONDS = 3.0
#: File name of the address ``ray start`` records in Ray's temp dir.
ADDRESS_FILE = "ray_current_cluster"


class RayUnreachable(ValueError):
    """The Ray cluster the user named (``--ray-address`` / ``RAY_ADDRESS``)
    does not answer."""


def recorded_address_file(env: Mapping[str, str] = os.environ) -> Path:
    """Where ``ray start`` records its cluster's address (Ray's rule: see the
    module docstring)."""
    if env.get("RAY_TMPDIR"):
        base = env["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and env.get("TMPDIR"):
        base = env["TMPDIR"]
    else:
        base = "/tmp"
    return Path(base) / "ray" / ADDRESS_FILE


def answers(address: str, timeout: float = PROBE_SECONDS) -> bool:
    """Whether ``host:port`` (a ``ray://`` prefix allowed) accepts a TCP
    connect within ``timeout`` seconds; False for an address without a port."""
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return False
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def ray_init_address(explicit: str | None, env: Mapping[str, str] = os.environ,
                     timeout: float = PROBE_SECONDS) -> str | None:
    """The ``address`` to pass to ``ray.init`` (see the module docstring).

    Args:
        explicit: ``--ray-address`` (None when not given).
        env: the environment (``RAY_ADDRESS``, ``RAY_TMPDIR``, ``TMPDIR``).
        timeout: seconds each probe waits.

    Raises:
        RayUnreachable: a named cluster does not answer.
    """
    named, source = explicit, "--ray-address"
    if not named and env.get("RAY_ADDRESS"):
        named, source = env["RAY_ADDRESS"], "RAY_ADDRESS"
    if named and named not in ("auto",):
        if named == "local" or answers(named, timeout):
            return named
        raise RayUnreachable(
            f"{source} {named}: no Ray cluster answers there (a TCP connect failed within "
            f"{timeout:g} s); start it (`ray start --head`) or leave {source} out to start "
            "a local Ray")
    path = recorded_address_file(env)
    try:
        recorded = path.read_text().strip()
    except OSError:
        recorded = ""
    if not recorded:
        if named == "auto":
            raise RayUnreachable(f"{source} auto: no Ray cluster is recorded in {path}")
        return None
    if answers(recorded, timeout):
        log.info("ray_recorded_cluster", address=recorded, path=str(path),
                 message=f"Joining the Ray cluster recorded at {recorded} ({path})")
        return recorded
    if named == "auto":
        raise RayUnreachable(f"{source} auto: the Ray cluster recorded at {recorded} ({path}) "
                             "does not answer")
    log.warning("ray_recorded_cluster_gone", address=recorded, path=str(path),
                message=f"The Ray cluster recorded at {recorded} ({path}) does not answer "
                        "(stopped without `ray stop`?): starting a local Ray instead")
    return "local"


@contextlib.contextmanager
def kept_signal_handlers():
    """Restore this process's SIGTERM and SIGINT handlers after the block:
    ``ray.init`` installs its own, which replaced the server's drain, so a
    SIGTERM killed a data-parallel or disaggregated server at once instead
    of draining it (issue 47, item 7). Off the main thread (where handlers
    cannot be set) nothing is restored."""
    import signal

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                try:
                    signal.signal(sig, handler)
                except ValueError:  # not the main thread
                    pass


def start_ray(explicit: str | None):
    """Start a local Ray or join the cluster (``ray_init_address``'s rule)
    unless this process already runs one; logs ``ray_started`` with its
    seconds. Returns the ``ray`` module. Raises ``RayUnreachable`` for an
    explicit address that does not answer."""
    import time

    for name, value in {**RAY_LOG_ENV, **RAY_WORKER_ENV}.items():  # read when Ray starts
        os.environ.setdefault(name, value)
    import ray

    if not ray.is_initialized():
        address = ray_init_address(explicit)  # never a stale recorded cluster
        t0 = time.monotonic()
        with kept_signal_handlers():
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        seconds = time.monotonic() - t0
        joined = address not in (None, "local")
        log.info("ray_started", address=address or "local", seconds=round(seconds, 2),
                 message=f"Ray {'joined at ' + address if joined else 'started locally'} "
                         f"in {seconds:.1f} s")
    return ray
