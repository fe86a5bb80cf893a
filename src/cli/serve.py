"""``kvserve serve``: the OpenAI-compatible HTTP API. The port is bound
first, the settings are judged next, then the server listens (``/health``
503 ``loading``) while the engine (one, or Ray replicas) loads."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import replace

import structlog

from kvserve.cli.engine_args import SERVE_GROUPS, add_serve_args
from kvserve.cli.engine_config import settled_config
from kvserve.cli.errors import StartupError, die
from kvserve.cli.launch import refuse_unfit_max_model_len, run_loop, start_engine
from kvserve.cli.model_arg import (default_model_folder, model_folder_problem,
                                   model_needs_work, require_model_folder)
from kvserve.cli.parsing import argument_groups
from kvserve.config import EngineConfig, ServerConfig
from kvserve.distributed.ray_start import RayUnreachable, ray_init_address

log = structlog.get_logger("kvserve.cli")

HELP = "serve the OpenAI-compatible HTTP API"
USAGE = "%(prog)s [options]"
#: What ``--data-parallel-size`` and disaggregated prefill/decode need, and
#: where it comes from (Ray is no serving dependency of one engine).
DISTRIBUTED_EXTRA = "pip install 'kvserve[distributed]'"


def configure(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags, in the argument groups of ``SERVE_GROUPS``."""
    add_serve_args(argument_groups(parser, SERVE_GROUPS))


def run(args: argparse.Namespace) -> int:
    """Run ``kvserve serve`` until the server stops; returns the exit status."""
    return run_loop(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    """``kvserve serve``: the port is bound first (a busy one is one line
    at once), the settings ``kvserve plan`` can judge are judged next, then
    the server listens (``/health`` 503 ``loading``) while the engine loads;
    returns the exit status once the server stops."""
    # lazy: the HTTP stack (Starlette, uvicorn) loads for serve alone
    from kvserve.api.app import LoadingGate
    from kvserve.api.server import DrainingServer, PortUnavailable, bind_socket, uvicorn_config
    # lazy: the model modules load NumPy (after the thread pools' environment)
    from kvserve.model.gguf_model import served_name

    server_config = _server_config(args)
    if args.model is not None:
        require_model_folder(args.model)
    try:
        sock = bind_socket(args.host, args.port)
    except PortUnavailable as exc:
        die(exc.strerror)
    config = None
    if ((args.model is not None and not model_needs_work(args.model))
            or (args.model is None and model_folder_problem(str(default_model_folder())) is None)):
        try:  # nothing to fetch: judged before the server listens
            config = settled_config(args)
        except StartupError as exc:
            die(str(exc))
    gate = LoadingGate()
    server = DrainingServer(uvicorn_config(gate, server_config), None, args.drain_timeout)
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
    while not server.started and not serving.done():  # uvicorn's start-up lines first
        await asyncio.sleep(0.01)
    url = _url(args.host, sock.getsockname()[1])
    log.info("server_listening", url=url, message=f"Listening on {url}: /health answers 503 "
             "until the model is loaded")
    try:
        if config is None:
            config = await asyncio.to_thread(settled_config, args)
        server_config = replace(server_config,
                                generation_defaults=_generation_defaults(config))
        engine, engine_metrics = await _load(args, config)
    except BaseException as exc:
        server.should_exit = True
        await serving
        if isinstance(exc, StartupError):
            die(str(exc))
        raise
    gate.open(_real_app(engine, engine_metrics, server_config))
    server.engine = engine
    name = getattr(engine, "model_name", None) or served_name(config.model)
    log.info("server_ready", url=url, message=f"Serving {name} on {url} (Press CTRL+C to quit)")
    try:
        await serving
    finally:
        await engine.shutdown()
    return 0


def _generation_defaults(config: EngineConfig):
    """The ``GenerationDefaults`` of ``--generation-config`` for the model
    (``kvserve.model.generation_config``), logged as ``generation_defaults``;
    a bad file is a ``StartupError`` (one line)."""
    # lazy: it brings the core's sampling params, which the other commands skip
    from kvserve.model.generation_config import (GenerationConfigError,
                                                 log_generation_defaults,
                                                 resolve_generation_defaults)

    try:
        defaults = resolve_generation_defaults(config.model, config.generation_config)
    except GenerationConfigError as exc:
        raise StartupError(str(exc)) from None
    log_generation_defaults(defaults, config.generation_config)
    return defaults


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """The HTTP server's settings: the API key resolved (``resolve_api_key``:
    an empty one is refused before minutes of loading) and the connection
    bound fitted to the open-file limit (``fit_file_limit``)."""
    # lazy: the HTTP stack (Starlette, uvicorn) loads for serve alone
    from kvserve.api.server import fit_file_limit

    return ServerConfig(
        host=args.host, port=args.port, api_key=resolve_api_key(args, os.environ),
        served_model_name=args.served_model_name, max_request_bytes=args.max_request_bytes,
        log_prompts=args.log_prompts, timeout_keep_alive=args.timeout_keep_alive,
        timeout_request_head=args.timeout_request_head,
        timeout_request_body=args.timeout_request_body,
        max_connections=fit_file_limit(args.max_connections),
        max_header_bytes=args.max_header_bytes, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser, metric_names=args.metric_names)


def _url(host: str, port: int) -> str:
    """``http://host:port`` (IPv6 hosts in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _load(args: argparse.Namespace, config: EngineConfig):
    """The engine (one, or ``--data-parallel-size`` replicas) and its
    metrics' source; ``StartupError`` when a ``--max-model-len`` the
    checks before loading could not judge (cuda: the KV cache is sized
    after the weights load) does not fit the cache (vLLM refuses it too)."""
    if args.data_parallel_size > 1:
        engine = await _start_replicas(args, config)
        metrics = engine.metrics_text  # every replica's, labelled replica="i"
    else:
        engine = await start_engine(config, args.served_model_name,
                                    request_timeout=args.request_timeout,
                                    stats_interval=args.stats_interval,
                                    log_prompts=getattr(args, "log_prompts", False))
        metrics = engine.metrics
    await refuse_unfit_max_model_len(args, engine)
    return engine, metrics


async def _start_replicas(args: argparse.Namespace, config: EngineConfig):
    """``--data-parallel-size`` replicas on Ray (a ``DataParallelClient``)."""
    # lazy: Ray, an optional dependency, only when replicas are asked for
    from kvserve.distributed.client import DataParallelClient

    return await DataParallelClient.start(
        config, args.data_parallel_size, ray_address=args.ray_address,
        model_name=args.served_model_name, request_timeout=args.request_timeout,
        stats_interval=args.stats_interval, routing=args.data_parallel_routing,
        prefill_replicas=args.prefill_replicas)


def _real_app(engine, engine_metrics, server_config: ServerConfig):
    """The OpenAI app around the loaded ``engine``, with ``/metrics`` and
    the HTTP metrics middleware."""
    # lazy: the HTTP stack (Starlette, uvicorn) loads for serve alone
    from kvserve.api.app import build_app
    from kvserve.api.http_metrics import instrument
    from kvserve.observability.metrics import ServerMetrics, metrics_route

    server_metrics = ServerMetrics()  # this process's HTTP requests, CPU and memory
    return instrument(build_app(engine, server_config, extra_routes=[
        metrics_route(server_metrics, engine_metrics, server_config.metric_names)]),
        server_metrics)


def resolve_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The API key from ``--api-key``, ``--api-key-file`` or ``KVSERVE_API_KEY``
    (first found), or None for a server without one.

    Raises ``SystemExit`` (a one-line error) for an empty key: an empty
    ``--api-key ''`` used to turn authentication off without a word.
    """
    sources = [("--api-key", args.api_key)]
    if getattr(args, "api_key_file", None):
        try:
            with open(args.api_key_file, encoding="utf-8") as handle:
                sources.append(("--api-key-file", handle.readline().strip()))
        except OSError as exc:
            die(f"--api-key-file: {exc}")
    sources.append(("KVSERVE_API_KEY", environ.get("KVSERVE_API_KEY")))
    for name, key in sources:
        if key is not None:
            if not key.strip():
                die(f"{name} is empty; give a key, or none of --api-key, --api-key-file "
                    "and KVSERVE_API_KEY to serve without one")
            return key
    return None


def _resolve_replica_roles(args: argparse.Namespace) -> None:
    """``--prefill-replicas P --decode-replicas D`` means P + D replicas;
    one without the other, or a ``--data-parallel-size`` that is not P + D,
    is an error."""
    prefill, decode = args.prefill_replicas, args.decode_replicas
    if prefill is None and decode is None:
        args.prefill_replicas = 0
        return
    if prefill is None or decode is None:
        die("--prefill-replicas and --decode-replicas go together")
    if args.data_parallel_size not in (1, prefill + decode):
        die(f"--data-parallel-size {args.data_parallel_size} is not --prefill-replicas "
            f"{prefill} + --decode-replicas {decode}")
    args.data_parallel_size = prefill + decode
    spec = args.speculative_config
    if spec is not None and spec.uses_draft_model:
        die("a draft model keeps its own KV cache, which a prefill replica does not hand "
            "over: use --prefill-replicas or a draft model, not both")


def check_replica_flags(args: argparse.Namespace) -> None:
    """Before anything loads: settle the replica roles (``_resolve_replica_roles``)
    and, when they ask for more than one engine, ``die`` with the command
    that installs Ray if it is not installed (found without importing it)."""
    _resolve_replica_roles(args)
    pipelined = args.pipeline_parallel_size > 1 or args.tensor_parallel_size > 1
    if pipelined and args.data_parallel_size > 1:
        die("--data-parallel-size with --pipeline-parallel-size/--tensor-parallel-size does "
            "not run yet: use one or the other")
    if args.data_parallel_size > 1 and importlib.util.find_spec("ray") is None:
        flags = ("--prefill-replicas/--decode-replicas" if args.prefill_replicas
                 else f"--data-parallel-size {args.data_parallel_size}")
        die(f"{flags} runs engine replicas on Ray, which is not installed: "
            f"{DISTRIBUTED_EXTRA}")
    if pipelined and importlib.util.find_spec("ray") is None:
        die(f"--pipeline-parallel-size/--tensor-parallel-size run their workers on Ray, which "
            f"is not installed: "
            f"{DISTRIBUTED_EXTRA}")
    if (args.data_parallel_size > 1 or pipelined) and (args.ray_address
                                                       or os.environ.get("RAY_ADDRESS")):
        try:  # a named cluster that does not answer: one line, before anything loads
            ray_init_address(args.ray_address)
        except RayUnreachable as exc:
            die(str(exc))
