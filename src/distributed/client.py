"""DataParallelClient: the API's engine, made of N engine replicas on Ray.

``kvserve serve --data-parallel-size N`` (vLLM's flag) starts N
``EngineReplica`` actors, one process each with its own KV cache and worker,
on a local Ray instance (``ray.init()`` with no set-up) or on the cluster at
``--ray-address``. Each replica declares its CPU threads to Ray. The API
process keeps HTTP, a tokenizer (to hash prompts for routing, and for
``/tokenize``) and the router (``kvserve.core.router``): every
``POLL_INTERVAL`` seconds it reads each replica's load and KV events, and it
sends each request to the replica with the longest cached prefix unless that
one is overloaded. Each routing decision is a ``request_routed`` log event.

Disaggregated prefill/decode (``--prefill-replicas P --decode-replicas D``):
the first P replicas only prefill. A request first runs there with
``max_tokens`` 1 and ``export_kv``; the replica returns its full prompt
blocks' hashes, and their K/V stay in Ray's object store (shared memory on
one node; pulled over the network by a decode replica on another node).
The request then runs on a decode replica, which adopts the blocks, finds
them as prefix-cache hits and computes only the prompt's last partial
block before decoding. A prefill that fails for want of a replica falls
back to a decode replica computing everything; a refusal (a 4xx) ends the
request. Requests with ``n > 1`` or ``prompt_logprobs``, and prompts of
at most one capped prefill chunk (``long_prefill_token_threshold``, else
half the step budget), go straight to a decode replica.

The KV offload tier (``--kv-offloading-size``): this process creates it in
shared memory (``kvserve.kv_offload.host_tier``) and every replica of the
node attaches to it, so a prefix one replica evicted is loaded by any.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from kvserve.actors.messages import (GenerateRequest, RequestAccepted, RequestFailed,
                                     RequestOutput, shutdown_failure)
from kvserve.actors.stream import RequestStream
from kvserve.config import EngineConfig
from kvserve.core.router import PrefixAwareRouter, ReplicaLoad
from kvserve.kv_offload.host_tier import SharedHostTier
from kvserve.distributed.ray_start import start_ray
from kvserve.distributed.replica import EngineReplica
from kvserve.model.tokenizer import Tokenizer

log = structlog.get_logger("kvserve.router")

#: Seconds between two reads of the replicas' loads and KV events.
POLL_INTERVAL = 0.05
#: Seconds the replicas together have to load their engines (the default
#: model's first start: fetch, convert, compile) before the start fails.
REPLICA_START_SECONDS = 900.0
#: Starts of one replica whose process dies during start-up (Ray restarts
#: it: ``max_restarts=-1``) before the server's start fails.
REPLICA_START_TRIES = 3


async def start_replica(replica, index: int, died: type[BaseException],
                        tries: int = REPLICA_START_TRIES) -> dict:
    """Start one replica's engine (``EngineReplica.start``); its info.

    A replica whose process dies meanwhile (``died``: Ray's
    ``RayActorError``; the out-of-memory killer, a ``kill``) is started
    again in the process Ray restarts, up to ``tries`` starts in all,
    logging ``replica_restarted`` each time. Raises ``RuntimeError`` (one
    line naming the replica and the last error) when every start died."""
    for attempt in range(1, tries + 1):
        try:
            return await replica.start.remote()
        except died as exc:
            error = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            if attempt == tries:
                raise RuntimeError(f"replica {index} died during start-up {tries} times "
                                   f"(last: {error}); is the machine out of memory?") from None
            log.warning("replica_restarted", replica=index, attempt=attempt, error=error,
                        message=f"Replica {index} died during start-up ({error}); starting it "
                                f"again ({attempt + 1} of {tries})")
    raise AssertionError("unreachable")
#: ``--data-parallel-routing``: ``prefix`` (``kvserve.core.router``) or
#: ``round_robin`` (the baseline it is measured against).
ROUTING_POLICIES = ("prefix", "round_robin")


class DataParallelClient:
    """``EngineClient`` over ``num_replicas`` Ray actors (see the module docstring).

    Build it with ``await DataParallelClient.start(...)``; ``shutdown``
    stops the replicas. Attributes the API reads: ``tokenizer``,
    ``model_name``, ``max_model_len``.
    """

    def __init__(self, replicas: list, infos: list[dict], tokenizer: Tokenizer,
                 routing: str = "prefix", prefill_replicas: int = 0,
                 short_prompt_tokens: int = 0) -> None:
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {routing!r}")
        if not 0 <= prefill_replicas < len(replicas):
            raise ValueError(f"prefill_replicas must leave a decode replica: {prefill_replicas} "
                             f"of {len(replicas)}")
        self.routing = routing
        #: Replica i only prefills when ``i < num_prefill`` (0: no disaggregation).
        self.num_prefill = prefill_replicas
        #: Prompts of at most this many tokens skip the prefill replicas.
        self.short_prompt_tokens = short_prompt_tokens
        self.tier: SharedHostTier | None = None  # the offload tier this process made
        self._next = 0  # round robin's next replica
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.model_name = infos[0]["model_name"]
        self.max_model_len = min(info["max_model_len"] for info in infos)
        self.router = PrefixAwareRouter(len(replicas), infos[0]["block_size"])
        self.loads = [ReplicaLoad() for _ in replicas]
        self._in_flight = [0] * len(replicas)  # requests routed and not finished
        self._placement: dict[str, tuple[int, asyncio.Task]] = {}  # id -> (replica, relay)
        self._streams: dict[str, RequestStream] = {}
        self._poller: asyncio.Task | None = None
        self._ready = False
        self.up = [True] * len(replicas)  # False while a replica is dead or restarting
        self._restarting: set[int] = set()

    @classmethod
    async def start(cls, config: EngineConfig, num_replicas: int, *,
                    ray_address: str | None = None, model_name: str | None = None,
                    request_timeout: float | None = None, stats_interval: float = 10.0,
                    routing: str = "prefix", prefill_replicas: int = 0) -> DataParallelClient:
        """Start Ray (locally unless ``ray_address``), then the replicas, in
        parallel; returns when every replica has loaded its model (and
        attached the offload tier, when ``config.cache`` asks for one). The
        first ``prefill_replicas`` replicas only prefill."""
        ray = start_ray(ray_address)
        threads = config.num_threads or max(1, int(ray.available_resources().get("CPU", 1))
                                            // num_replicas)
        tier_bytes = int(config.cache.kv_offloading_size * 2**30)
        if config.cache.kv_offloading_backend == "disk":
            log.warning("kv_offload_disk_not_shared", path=config.cache.kv_offloading_path,
                        message="--kv-offloading-backend disk is not used with "
                                "--data-parallel-size yet: the replicas share the memory tier "
                                "only")
        config = replace(config, num_threads=threads,
                         cache=replace(config.cache, kv_offloading_size=0.0,
                                       kv_offloading_backend="native", kv_offloading_path=None))
        # Ray restarts a dead replica's process; the poll loop then starts its engine again
        actor = ray.remote(num_cpus=threads, max_restarts=-1, max_task_retries=0)(EngineReplica)
        replicas = [actor.remote(i, config, model_name, request_timeout, stats_interval)
                    for i in range(num_replicas)]
        t0 = time.monotonic()
        try:
            infos = await asyncio.wait_for(asyncio.gather(*(
                start_replica(r, i, ray.exceptions.RayActorError)
                for i, r in enumerate(replicas))), REPLICA_START_SECONDS)
        except asyncio.TimeoutError:
            raise RuntimeError(f"{num_replicas} engine replicas did not start within "
                               f"{REPLICA_START_SECONDS:g} s (see the replicas' log lines)"
                               ) from None
        started_s = round(time.monotonic() - t0, 2)
        for i, info in enumerate(infos):
            role = ("prefill" if i < prefill_replicas else "decode") if prefill_replicas else "both"
            log.info("replica_started", replica=i, num_threads=threads, role=role, **info,
                     seconds=started_s,
                     message=f"Replica {i}: {info['num_kv_tokens']:,} KV tokens, "
                             f"{threads} CPU thread(s), role {role} (the replicas started in "
                             f"{started_s:.1f} s)")
        sched = config.scheduler
        short = sched.long_prefill_token_threshold or sched.max_num_batched_tokens // 2
        client = cls(replicas, infos, Tokenizer(Path(config.model), config.chat_template),
                     routing, prefill_replicas,
                     short_prompt_tokens=short)
        if tier_bytes:
            await client._share_offload_tier(tier_bytes)
        client._poller = asyncio.create_task(client._poll_loop(), name="replica-poller")
        client._ready = True
        return client

    async def _share_offload_tier(self, size_bytes: int) -> None:
        """Create the node's offload tier for the replicas' block layout and
        attach every replica to it. A replica that cannot (another node:
        the file is not there) runs without one."""
        layout = await self.replicas[0].kv_layout.remote()
        self.tier = SharedHostTier.create(size_bytes, layout["block_shape"], layout["dtype"],
                                          layout["fingerprint"])
        results = await asyncio.gather(*(r.attach_offload_tier.remote(str(self.tier.path))
                                         for r in self.replicas), return_exceptions=True)
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                log.warning("offload_tier_unreachable", replica=i, error=repr(result))

    def is_ready(self) -> bool:
        """True while accepting requests and at least one replica is up."""
        return self._ready and any(self.up)

    def generate(self, request: GenerateRequest) -> RequestStream:
        """Route ``request`` to a replica and relay its events."""
        rid = request.request_id
        stream = RequestStream(rid, request.sampling_params.n)
        if not self._ready:
            stream.put(RequestFailed(rid, 503, "The server is not accepting requests.",
                                     type="service_unavailable"))
            return stream
        if rid in self._placement:
            stream.put(RequestFailed(rid, 400, f"Request id {rid!r} is already in use.",
                                     param="X-Request-Id"))
            return stream
        task = asyncio.create_task(self._relay(request, stream))
        self._placement[request.request_id] = (-1, task)
        self._streams[request.request_id] = stream
        return stream

    async def _relay(self, request: GenerateRequest, stream: RequestStream) -> None:
        """Route and relay; a replica that dies before the request streamed a
        token is retried on another one, after that the stream ends with a
        500 error event."""
        rid, tried, progress = request.request_id, set(), _Progress()
        try:
            tokens = (await asyncio.to_thread(self._prompt_tokens, request)
                      if self.routing == "prefix" or self.num_prefill else [])
            kv = None
            if self._disaggregated(request, tokens):
                kv = await self._prefill(request, tokens)
            if isinstance(kv, RequestFailed):
                stream.put(kv)
                return
            while True:
                replica = await self._route(request, tokens, exclude=tried, role="decode")
                if replica is None:
                    stream.put(RequestFailed(rid, 503, "No replica is available.",
                                             type="service_unavailable"))
                    return
                if await self._relay_from(replica, request, stream, progress, kv):
                    return
                tried.add(replica)
                if progress.streamed:
                    stream.put(RequestFailed(rid, 500, f"Replica {replica} died while this "
                                             "request was streaming.", type="server_error"))
                    return
                log.warning("request_retried", request_id=rid, failed_replica=replica)
        finally:
            self._forget(rid)

    def _disaggregated(self, request: GenerateRequest, tokens: list[int]) -> bool:
        """Whether ``request`` goes through a prefill replica first: not
        with ``n > 1`` or ``prompt_logprobs``, nor for a prompt of at most
        ``short_prompt_tokens`` (one capped prefill chunk of a decode
        replica's step: queueing behind long prompts on the prefill replica
        would cost it more than it saves the decodes)."""
        params = request.sampling_params
        return (self.num_prefill > 0 and params.n == 1 and params.prompt_logprobs is None
                and len(tokens) > self.short_prompt_tokens)

    async def _prefill(self, request: GenerateRequest, tokens: list[int]
                       ) -> list | RequestFailed | None:
        """Run the prefill half on a prefill replica: ``[block_hashes, ref
        of their K/V]`` for the decode replica, the replica's refusal (a
        4xx ``RequestFailed``), or None when no prefill replica could do it
        (the decode replica then computes the prompt itself)."""
        from ray.exceptions import RayActorError

        rid = request.request_id
        replica = await self._route(request, tokens, exclude=set(), role="prefill")
        if replica is None:
            return None
        params = replace(request.sampling_params, max_tokens=1, min_tokens=0, logprobs=None,
                         stop=(), stop_token_ids=(), structured_outputs=None, export_kv=True)
        self._placement[rid] = (replica, self._placement[rid][1])
        self._in_flight[replica] += 1
        try:
            info_ref, data_ref = self.replicas[replica].prefill.options(num_returns=2).remote(
                replace(request, sampling_params=params, stream=None))
            info = await info_ref
        except RayActorError as exc:
            self._mark_down(replica, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - the decode replica computes it instead
            log.error("prefill_failed", replica=replica, request_id=rid, error=repr(exc))
            return None
        finally:
            self._in_flight[replica] -= 1
        failure = info.get("failure")
        if failure is not None and 400 <= failure.status < 500:
            return failure
        if "block_hashes" not in info:
            log.warning("prefill_failed", replica=replica, request_id=rid, error=info.get("error"))
            return None
        log.info("request_prefilled", request_id=rid, replica=replica,
                 num_blocks=len(info["block_hashes"]), kv_bytes=info["bytes"],
                 seconds=round(info["seconds"], 6))
        return [info["block_hashes"], data_ref] if info["block_hashes"] else None

    async def _relay_from(self, replica: int, request: GenerateRequest, stream: RequestStream,
                          progress: _Progress, kv: list | None = None) -> bool:
        """Relay one replica's events; False when the replica died. A
        non-streaming request's events are held until the replica is done
        with it, so that a retry after a death starts from a clean slate
        (its client has seen nothing)."""
        from ray.exceptions import RayActorError

        rid = request.request_id
        self._placement[rid] = (replica, self._placement[rid][1])
        self._in_flight[replica] += 1
        held: list = []
        try:
            async for ref in self.replicas[replica].generate.options(
                    num_returns="streaming").remote(request, kv):
                event = await ref
                if request.stream is False:
                    held.append(event)
                elif progress.relay(event):
                    stream.put(event)
            for event in held:
                if progress.relay(event):
                    stream.put(event)
            return True
        except RayActorError as exc:
            self._mark_down(replica, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - anything else fails this request alone
            log.error("replica_request_failed", replica=replica, request_id=rid, error=repr(exc))
            stream.put(RequestFailed(rid, 500, f"Replica {replica} failed: "
                                     f"{type(exc).__name__}", type="server_error"))
            return True
        finally:
            self._in_flight[replica] -= 1

    def _forget(self, request_id: str) -> None:
        self._placement.pop(request_id, None)
        self._streams.pop(request_id, None)

    async def _route(self, request: GenerateRequest, tokens: list[int], exclude: set[int],
                     role: str = "decode") -> int | None:
        """The replica for ``request`` (its prompt ``tokens``) among those
        up, not in ``exclude`` and of ``role`` (``prefill`` or ``decode``;
        without disaggregation every replica decodes). None when there is
        none."""
        available = [up and i not in exclude and (i < self.num_prefill) == (role == "prefill")
                     for i, up in enumerate(self.up)]
        if not any(available):
            return None
        if self.routing == "round_robin":
            return self._round_robin(request.request_id, available)
        loads = [replace(load, running=max(load.running, n))
                 for load, n in zip(self.loads, self._in_flight)]
        decision = self.router.route(tokens, loads, available)
        log.info("request_routed", request_id=request.request_id, replica=decision.replica,
                 role=role if self.num_prefill else "both",
                 reason=decision.reason, cached_blocks=decision.cached_blocks,
                 prefix_replica=decision.prefix_replica, prefix_blocks=decision.prefix_blocks)
        return decision.replica

    def _round_robin(self, request_id: str, available: list[bool]) -> int:
        """The next available replica in turn (the baseline prefix routing is measured against)."""
        n = len(available)
        replica = next(i % n for i in range(self._next, self._next + n) if available[i % n])
        self._next = replica + 1
        log.info("request_routed", request_id=request_id, replica=replica, reason="round_robin")
        return replica

    def _prompt_tokens(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids as the replica will see them (empty when the
        prompt cannot be tokenized here: the replica reports the error)."""
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        limit = self.max_model_len * self.tokenizer.max_token_bytes
        try:
            if request.messages is not None:
                if sum(len(str(m.get("content") or "")) for m in request.messages) > limit:
                    return []
                return self.tokenizer.encode_chat(list(request.messages))
            if len(request.prompt or "") > limit:
                return []
            return self.tokenizer.encode(request.prompt or "", add_special_tokens=True,
                                         parse_special=request.parse_special)
        except ValueError:
            return []

    async def abort(self, request_id: str, failure: RequestFailed | None = None) -> None:
        """Stop a request wherever it runs (its relay cancels the replica's
        stream); ``failure`` is put on its stream first, if given."""
        placed = self._placement.get(request_id)
        if placed is None:
            return
        replica, task = placed
        if failure is not None:
            self._streams[request_id].put(failure)
        if replica >= 0:
            await self.replicas[replica].abort.remote(request_id)
        task.cancel()

    async def _poll_loop(self) -> None:
        while True:
            polls = await asyncio.gather(*(r.poll.remote() for r in self.replicas),
                                         return_exceptions=True)
            for i, result in enumerate(polls):
                if isinstance(result, BaseException):
                    self._mark_down(i, result)
                    continue
                load, events, started = result
                if not started:  # Ray restarted the process: start its engine again
                    self._mark_down(i, None)
                    if i not in self._restarting:
                        self._restarting.add(i)
                        asyncio.create_task(self._restart(i))
                    continue
                self.loads[i] = load
                self.router.apply_events(i, events)
            await asyncio.sleep(POLL_INTERVAL)

    def _mark_down(self, replica: int, exc: BaseException | None) -> None:
        if self.up[replica]:
            self.up[replica] = False
            self.router.forget(replica)  # a restarted replica's cache is empty
            cause = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if exc else None
            log.error("replica_down", replica=replica, error=cause,
                      message=f"Replica {replica} is down; Ray restarts it")

    async def _restart(self, replica: int) -> None:
        try:
            info = await self.replicas[replica].start.remote()
            if self.tier is not None:
                await self.replicas[replica].attach_offload_tier.remote(str(self.tier.path))
            self.up[replica] = True
            log.info("replica_restarted", replica=replica, pid=info["pid"],
                     message=f"Replica {replica} is serving again")
        except Exception as exc:  # noqa: BLE001 - the next poll tries again
            log.error("replica_restart_failed", replica=replica, error=repr(exc))
        finally:
            self._restarting.discard(replica)

    def health(self) -> dict:
        """``{"status": "ok"}``, ``"degraded"`` (with the replicas down) while
        some replica is down, or ``"unavailable"`` when none is up."""
        down = [i for i, up in enumerate(self.up) if not up]
        if not down:
            return {"status": "ok"}
        status = "unavailable" if len(down) == len(self.up) else "degraded"
        return {"status": status, "replicas_down": down}

    async def metrics_text(self) -> str:
        """Every replica's metrics, each sample labelled ``replica="i"``, and
        ``kvserve:replica_up{replica="i"}`` (1 or 0): a replica that is down,
        fails or does not answer within ``METRICS_TIMEOUT_S`` adds only its
        0, so ``/metrics`` answers while one is down (it was a 500)."""
        async def one(replica: Any) -> str:
            return await asyncio.wait_for(_awaited(replica.metrics_text.remote()),
                                          METRICS_TIMEOUT_S)

        texts = await asyncio.gather(*(one(r) for r in self.replicas), return_exceptions=True)
        up = [isinstance(t, str) for t in texts]
        merged = label_replicas([t if ok else "" for t, ok in zip(texts, up)])
        return merged + replica_up_text(up)

    async def drain(self, timeout: float) -> int:
        """Refuse new requests (503), let routed ones finish for up to
        ``timeout`` seconds, then abort the rest (their streams end with a
        503 error event). Returns how many had to be failed."""
        self._ready = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._placement and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._placement)
        for request_id in left:
            await self.abort(request_id, shutdown_failure(request_id, timeout))
        log.info("drain_finished", failed_requests=len(left))
        return len(left)

    async def shutdown(self) -> None:
        """Stop polling and every replica."""
        self._ready = False
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*(r.shutdown.remote() for r in self.replicas),
                             return_exceptions=True)
        if self.tier is not None:
            self.tier.unlink()


class _Progress:
    """What a request's stream has relayed so far, across retries: one
    ``RequestAccepted`` only, and whether any output (a token) went out."""

    def __init__(self) -> None:
        self.accepted = False
        self.streamed = False

    def relay(self, event) -> bool:
        """Whether to pass ``event`` on (a retry's second acceptance is not)."""
        if isinstance(event, RequestAccepted):
            if self.accepted:
                return False
            self.accepted = True
        elif isinstance(event, RequestOutput):
            self.streamed = True
        return True


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?(\s.*)$")


#: Seconds a replica may take to answer a ``/metrics`` scrape.
METRICS_TIMEOUT_S = 5.0


async def _awaited(ref: Any) -> Any:
    return await ref


def replica_up_text(up: list[bool]) -> str:
    """The ``kvserve:replica_up`` gauge of each replica, Prometheus text."""
    lines = ["# HELP kvserve:replica_up 1 when the replica answered this scrape, else 0.",
             "# TYPE kvserve:replica_up gauge"]
    lines += [f'kvserve:replica_up{{replica="{i}"}} {int(ok)}' for i, ok in enumerate(up)]
    return "\n".join(lines) + "\n"


def label_replicas(texts: list[str]) -> str:
    """Merge Prometheus texts, one per replica, adding ``replica="i"`` to
    each sample. A metric's samples stay one group under its ``# HELP`` and
    ``# TYPE`` lines, as the text format requires."""
    families: dict[str, list[str]] = {}  # family -> its HELP/TYPE lines, then samples
    for index, text in enumerate(texts):
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                head = families.setdefault(family, [])
                if line not in head:
                    head.insert(sum(1 for h in head if h.startswith("#")), line)
                continue
            match = _SAMPLE.match(line)
            if match is None or family is None:
                continue
            name, _, labels, rest = match.groups()
            label = f'replica="{index}"' + (f",{labels}" if labels else "")
            families[family].append(f"{name}{{{label}}}{rest}")
    return "\n".join(line for lines in families.values() for line in lines) + "\n"
