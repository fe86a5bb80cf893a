"""Bounded constraint compilation, off the event loop and the step thread.

A request's constraint is compiled before it is queued (the tokenizer actor
awaits ``ConstraintCompiler.compile``), so the worker only copies a ready
matcher and a request never waits inside a step. Compiling costs from
microseconds to minutes (llguidance's matcher for a JSON object with 4,000
optional properties takes ~3 s, with 10,000 ~6 minutes; a grammar of 3,000
chained rules overflows an 8 MiB stack), so each new constraint goes:

1. **size**: more than ``max_bytes`` (``--structured-outputs-max-bytes``)
   of schema, regex, grammar or choices is a 400 at once;
2. **trial in a child process** (``kvserve.constraints.compile_worker``, on
   a 256 MiB stack, at normal priority for its first
   ``NORMAL_PRIORITY_CPU_SECONDS`` of CPU and on idle CPU only after, so that
   a hostile compile takes only what the step threads leave): it compiles the grammar and
   builds the whole matcher under llguidance's limits
   (``grammar.parser_limits``). Over ``timeout`` seconds of CPU
   (``--structured-outputs-timeout``; CPU time, so that what compiles does
   not depend on the load) the child ends itself and the request gets a
   400; a crash ends only the child (400 too); past ``WALL_FACTOR`` times
   the budget in wall time (a machine too busy to give the child its CPU)
   the child is killed and the request gets a 503 (not cached: retrying
   later may work). The next constraint starts a new child, spawned
   without ``fork`` (``spawn_child``: a fork would run OpenBLAS's
   ``pthread_atfork`` handler, which deadlocks against a step's matrix
   product in the worker thread and wedged the whole server);
3. **build in this process**, on a thread of its own with the same stack
   and the same demotion (llguidance drops the GIL while it builds), of what the trial
   just built within its deadline: the template matcher the worker copies
   (``LLMatcher.deep_copy``, ~20 us) for each request.

Templates and refusals are cached by constraint (equal constraints share
them), so a popular schema compiles once and a repeated hostile one costs
nothing after its first refusal. One constraint compiles at a time; beyond
``max_pending`` waiting compiles a request gets a 429.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from kvserve.config import StructuredOutputsConfig
from kvserve.constraints.compile_worker import (CPU_EXCEEDED, NORMAL_PRIORITY_CPU_SECONDS,
                                                WATCH_INTERVAL, CompileThread)
from kvserve.core.structured_outputs import StructuredOutputsParams

log = structlog.get_logger("kvserve.structured")

#: Compiled templates kept (least recently used dropped first), by count and
#: by the bytes of their constraints: a template of the largest JSON schema
#: accepted holds ~8 MiB of lexer, so 1 MiB of constraints bounds the cache
#: near 130 MiB.
CACHE_TEMPLATES, CACHE_TEMPLATE_BYTES = 64, 1 << 20
#: Refusals kept (their reasons are short; their keys hold the constraint).
CACHE_REFUSALS = 256
#: Seconds the compiler child may take to start (import llguidance, load the tokenizer).
CHILD_START_TIMEOUT = 60.0
#: Longest answer line from the child (a grammar's JSON form).
MAX_ANSWER_BYTES = 64 * 2**20
#: Wall-clock deadline of a trial compile, in multiples of its CPU budget
#: (the child runs on idle CPU only: on a busy machine it gets a
#: fraction of a core).
WALL_FACTOR = 10.0


class ConstraintError(Exception):
    """A constraint the engine refuses: ``message`` for the client, ``param``
    the request field at fault, ``status`` 400 (the constraint's fault),
    429 (too many compiling) or 503 (the compiler cannot start)."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint's template matcher (never advanced: only copied) and
    the seconds its trial compile took."""

    template: Any
    seconds: float

    def new_matcher(self) -> Any:
        """A fresh ``llguidance.LLMatcher`` at the start of the constraint."""
        return self.template.deep_copy()


class ConstraintCompiler:
    """Compiles constraints for one engine, bounded (see the module docstring).

    Args:
        tokenizer_json: the checkpoint's ``tokenizer.json``.
        vocab_size: rows of the LM head (the logits' width), >= the tokenizer's.
        eos_token_ids: the tokens that end a sequence.
        config: the limits (``StructuredOutputsConfig``).
        tokenizer: llguidance's tokenizer of this checkpoint, or None: the
            first compile loads it on a thread of normal priority
            (``grammar.load_tokenizer``, which holds the GIL for ~0.5 s once,
            a pause the other requests' streams see; the engine accepts it
            so that a server that never sees a constraint never loads
            llguidance, as vLLM does).
        normal_cpu_seconds: CPU seconds each compile (the trial, then the
            build) runs at normal priority before it is demoted to idle CPU
            (``compile_worker.NORMAL_PRIORITY_CPU_SECONDS``); a test that
            needs a whole budget's compile to get its CPU on a busy machine
            gives the budget.

    Use from one event loop. The child starts with the first constrained
    request, so a server that never sees a constraint never runs it.
    """

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: Sequence[int],
                 config: StructuredOutputsConfig, tokenizer: Any = None,
                 normal_cpu_seconds: float = NORMAL_PRIORITY_CPU_SECONDS) -> None:
        self.config = config
        self.normal_cpu_seconds = normal_cpu_seconds
        self._tokenizer_args = (str(tokenizer_json), int(vocab_size), list(eos_token_ids))
        self._child = _ChildProcess([sys.executable, "-m", "kvserve.constraints.compile_worker",
                                     str(tokenizer_json), str(vocab_size),
                                     ",".join(str(t) for t in eos_token_ids)])
        self._tokenizer = tokenizer
        self._cache = _Cache()
        self._lock = asyncio.Lock()
        self.num_pending = 0
        self.num_compiled = 0
        self.num_refused = 0

    async def compile(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """``params`` with ``compiled`` set; waits for the compile, off the loop.

        Raises ``ConstraintError`` naming ``params.field`` (or the tool
        schema at fault) when the constraint is over the size limit, does
        not compile, crashes the compiler or uses more than ``config.timeout``
        seconds of CPU; 429 when ``config.max_pending`` compiles already
        wait; 503 when the compiler cannot start, or the machine is too busy
        to give it ``config.timeout`` seconds of CPU within ``WALL_FACTOR``
        times that.
        """
        what = _What(params)
        self.check_size(params)
        cached = self._cached(params)
        if cached is not None:
            return cached.apply(params, what)
        if self.num_pending >= self.config.max_pending:
            raise ConstraintError(
                f"{what.field}: {self.num_pending} constraints are compiling already; "
                "retry later", what.field, status=429)
        self.num_pending += 1
        try:
            async with self._lock:
                entry = self._cached(params) or await self._compile(params, what)
        finally:
            self.num_pending -= 1
        return entry.apply(params, what)

    def check_size(self, params: StructuredOutputsParams) -> None:
        """``ConstraintError`` (400) when ``params`` is over ``config.max_bytes``."""
        size = params.size_bytes
        if size > self.config.max_bytes:
            what = _What(params)
            raise ConstraintError(
                f"{what.field}: the {what.kind} constraint is {size:,} bytes, more than the "
                f"{self.config.max_bytes:,} bytes the server accepts "
                "(--structured-outputs-max-bytes)", what.field)

    def _cached(self, params: StructuredOutputsParams) -> _Entry | None:
        entry = self._cache.get(params)
        return entry if entry is None else _Entry(entry)

    async def _compile(self, params: StructuredOutputsParams, what: _What) -> _Entry:
        """Trial in the child, then the build here; caches the outcome."""
        start = time.monotonic()
        budget = self.config.timeout
        try:
            answer = await self._child.ask(_request(params, budget, self.normal_cpu_seconds),
                                          budget * WALL_FACTOR)
        except _ChildStartFailed as exc:
            raise ConstraintError(f"{what.field}: the grammar compiler could not start: {exc}",
                                  what.field, status=503) from exc
        except _ChildTimedOut:  # load-dependent: refused now, not cached
            log.warning("constraint_compile_wall_timeout", kind=what.kind, field=what.field,
                        seconds=budget * WALL_FACTOR)
            raise ConstraintError(
                f"{what.field}: the server is too busy to compile the {what.kind} constraint "
                f"(no result within {budget * WALL_FACTOR:g} s); retry later", what.field,
                status=503) from None
        except _ChildCrashed as exc:
            answer = ({"timeout": budget} if exc.args[0] == f"exit status {CPU_EXCEEDED}"
                      else {"crash": str(exc)})
        entry: CompiledConstraint | _Refusal = _Refusal.of(answer)
        if "grammar" in answer:
            from kvserve.constraints.grammar import GrammarError

            try:
                if self._tokenizer is None:  # at normal priority: it holds the GIL
                    self._tokenizer = await asyncio.to_thread(self._load_tokenizer)
                template = await self._build_watched(answer["grammar"])
                entry = CompiledConstraint(template, float(answer["seconds"]))
            except GrammarError as exc:  # the trial passed: not expected, but refused alike
                entry = _Refusal(str(exc))
        if isinstance(entry, CompiledConstraint):
            self.num_compiled += 1
        else:
            self.num_refused += 1
        log.info("constraint_compiled" if isinstance(entry, CompiledConstraint)
                 else "constraint_refused", kind=what.kind, field=what.field,
                 bytes=params.size_bytes, seconds=round(time.monotonic() - start, 4),
                 # the refusal's reason quotes the request's constraint: its
                 # length only (the client's 400 has it)
                 **({} if isinstance(entry, CompiledConstraint)
                    else {"reason_chars": len(entry.reason)}))
        self._cache.put(params, entry)
        return _Entry(entry)

    async def _build_watched(self, grammar: str) -> Any:
        """The template matcher of ``grammar``, built on a ``CompileThread``
        that the loop looks at every ``WATCH_INTERVAL`` (to demote it when due)."""
        build = CompileThread(self._build, grammar, normal_cpu_seconds=self.normal_cpu_seconds)
        while not build.join(0):
            build.demote_if_due()
            await asyncio.sleep(WATCH_INTERVAL)
        return build.result()

    def _load_tokenizer(self) -> Any:
        """llguidance's tokenizer (``grammar.load_tokenizer``), on a thread of
        normal priority: it holds the GIL for ~0.5 s, and on a thread at idle
        priority a machine whose cores other processes keep busy would leave
        it unscheduled that long while holding the GIL, and the event loop
        with it."""
        from kvserve.constraints.grammar import load_tokenizer

        return load_tokenizer(*self._tokenizer_args)

    def _build(self, grammar: str) -> Any:
        """On a build thread: the template matcher of ``grammar``
        (llguidance drops the GIL while it builds)."""
        from kvserve.constraints.grammar import build_matcher

        return build_matcher(self._tokenizer, grammar)

    async def close(self) -> None:
        """Kill the child (a build still running here ends with the
        process: its thread is a daemon)."""
        await self._child.close()


class _Cache:
    """Templates and refusals by constraint, least recently used dropped
    first (bounds: ``CACHE_TEMPLATES``, ``CACHE_TEMPLATE_BYTES``,
    ``CACHE_REFUSALS``)."""

    def __init__(self) -> None:
        self._templates: OrderedDict[StructuredOutputsParams, CompiledConstraint] = OrderedDict()
        self._refusals: OrderedDict[StructuredOutputsParams, _Refusal] = OrderedDict()
        self.template_bytes = 0

    def get(self, params: StructuredOutputsParams) -> CompiledConstraint | _Refusal | None:
        for entries in (self._templates, self._refusals):
            if params in entries:
                entries.move_to_end(params)
                return entries[params]
        return None

    def put(self, params: StructuredOutputsParams, entry: CompiledConstraint | _Refusal) -> None:
        if isinstance(entry, _Refusal):
            self._refusals[params] = entry
            while len(self._refusals) > CACHE_REFUSALS:
                self._refusals.popitem(last=False)
            return
        self._templates[params] = entry
        self.template_bytes += params.size_bytes
        while len(self._templates) > 1 and (len(self._templates) > CACHE_TEMPLATES
                                            or self.template_bytes > CACHE_TEMPLATE_BYTES):
            old, _ = self._templates.popitem(last=False)
            self.template_bytes -= old.size_bytes


class _What:
    """How errors name a constraint: its request field and kind."""

    def __init__(self, params: StructuredOutputsParams) -> None:
        self.kind = params.kind
        self.field = params.field or params.kind


@dataclass(frozen=True)
class _Refusal:
    """A cached refusal: why, and the narrower param at fault (a tool's schema)."""

    reason: str
    part: str | None = None
    timeout: float | None = None
    crash: str | None = None

    @classmethod
    def of(cls, answer: dict[str, Any]) -> _Refusal:
        """The refusal of a child's answer (an ``error``, ``timeout`` or ``crash``)."""
        if "timeout" in answer:
            return cls("timeout", timeout=answer["timeout"])
        if "crash" in answer:
            return cls("crash", crash=answer["crash"])
        return cls(answer.get("error", "no grammar"), answer.get("param"))

    def error(self, what: _What) -> ConstraintError:
        if self.timeout is not None:
            return ConstraintError(
                f"{what.field}: the {what.kind} constraint did not compile within "
                f"{self.timeout:g} s of CPU (--structured-outputs-timeout); make it smaller "
                "or simpler", what.field)
        if self.crash is not None:
            return ConstraintError(
                f"{what.field}: the {what.kind} constraint crashed the grammar compiler "
                f"({self.crash}): it is too large or too deeply nested", what.field)
        if self.part is not None:
            return ConstraintError(f"{self.part}: {self.reason}", self.part)
        return ConstraintError(f"{what.field}: the {what.kind} constraint cannot be compiled: "
                               f"{self.reason}", what.field)


class _Entry:
    """A cache entry applied to a request's params."""

    def __init__(self, entry: CompiledConstraint | _Refusal) -> None:
        self.entry = entry

    def apply(self, params: StructuredOutputsParams, what: _What) -> StructuredOutputsParams:
        if isinstance(self.entry, _Refusal):
            raise self.entry.error(what)
        return replace(params, compiled=self.entry)


def _request(params: StructuredOutputsParams, cpu_seconds: float,
             normal_cpu_seconds: float) -> dict[str, Any]:
    """The child's request for ``params`` (its constraint fields and parts)
    with a budget of ``cpu_seconds``, the first ``normal_cpu_seconds`` at
    normal priority."""
    return {"params": {"json": params.json, "json_object": params.json_object,
                       "regex": params.regex, "grammar": params.grammar,
                       "choice": None if params.choice is None else list(params.choice),
                       "parts": [list(part) for part in params.parts]},
            "cpu_seconds": cpu_seconds, "normal_cpu_seconds": normal_cpu_seconds}


# --------------------------------------------------------------------------- the child


class _ChildStartFailed(Exception):
    """The compiler child did not start (or did not say ready)."""


class _ChildTimedOut(Exception):
    """The child did not answer within the deadline (it was killed)."""


class _ChildCrashed(Exception):
    """The child died while compiling; the message says how."""


class SpawnedChild:
    """A child process started by ``spawn_child``, its pipes as asyncio streams.

    Attributes:
        popen: the ``subprocess.Popen``.
        stdin: an ``asyncio.StreamWriter`` on the child's standard input.
        stdout, stderr: ``asyncio.StreamReader``s (``stdout``'s line limit
            is the ``limit`` given to ``spawn_child``).
    """

    def __init__(self, popen: subprocess.Popen, stdin: asyncio.StreamWriter,
                 stdout: asyncio.StreamReader, stderr: asyncio.StreamReader) -> None:
        self.popen, self.stdin, self.stdout, self.stderr = popen, stdin, stdout, stderr

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: the signal), None while it runs."""
        return self.popen.poll()

    def kill(self) -> None:
        self.popen.kill()

    async def wait(self) -> int:
        """Wait for the exit (off the loop) and close the pipes."""
        code = await asyncio.to_thread(self.popen.wait)
        self.stdin.close()
        return code


async def spawn_child(argv: Sequence[str], limit: int) -> SpawnedChild:
    """Start ``argv`` with pipes on its standard streams, without ``fork``.

    uvloop's ``create_subprocess_exec`` forks (libuv's ``uv_spawn``), and a
    fork runs every ``pthread_atfork`` handler in the forking thread first:
    OpenBLAS's (``blas_thread_shutdown_``) waits for its worker threads,
    which a step's matrix product in the worker thread holds, so a
    constrained request that arrived during a step wedged the event loop
    for good (seen in ``tools/soak.py``: the main thread in
    ``blas_thread_shutdown_``, the worker in a ``matmul``). CPython's
    ``subprocess.Popen`` starts the child with ``vfork`` (or
    ``posix_spawn``) on Linux, which runs no atfork handler; the pipes then
    join the running loop.

    Raises:
        OSError: the program could not be started.
    """
    popen = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, bufsize=0)
    loop = asyncio.get_running_loop()
    try:
        stdout = asyncio.StreamReader(limit=limit)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), popen.stdout)
        stderr = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stderr), popen.stderr)
        transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), popen.stdin)
    except BaseException:
        popen.kill()
        await asyncio.to_thread(popen.wait)
        raise
    return SpawnedChild(popen, asyncio.StreamWriter(transport, protocol, None, loop),
                        stdout, stderr)


class _ChildProcess:
    """The compiler child (``compile_worker``): started on first use, asked
    one request at a time, killed at a deadline, started again after."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.proc: SpawnedChild | None = None
        self._stderr: _Tail | None = None

    async def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send ``request``, return the answer; raises ``_ChildTimedOut``
        (child killed) or ``_ChildCrashed`` (child gone)."""
        proc = self.proc if self.proc is not None else await self._start()
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stdout.readline(), timeout)
        except TimeoutError:
            await self._kill()
            raise _ChildTimedOut() from None
        except (BrokenPipeError, ConnectionResetError, ValueError):
            line = b""  # died (or wrote a line over the limit)
        if not line.endswith(b"\n"):
            await self._kill()
            raise _ChildCrashed(self._exit_reason(proc))
        answer = json.loads(line)
        if "timeout" in answer:  # its CPU watchdog answered, and the child is ending
            await self._kill()
        return answer

    async def _start(self) -> SpawnedChild:
        try:
            proc = await spawn_child(self.argv, MAX_ANSWER_BYTES)
        except OSError as exc:
            raise _ChildStartFailed(str(exc)) from exc
        self._stderr = _Tail(proc.stderr)
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), CHILD_START_TIMEOUT)
        except TimeoutError:
            ready = b""
        if not ready.startswith(b'{"ready"'):
            self.proc = proc
            await self._kill()
            raise _ChildStartFailed(self._exit_reason(proc))
        log.info("constraint_compiler_started", pid=proc.pid)
        self.proc = proc
        return proc

    def _exit_reason(self, proc: SpawnedChild) -> str:
        code = proc.returncode
        if code is None:
            how = "no answer"
        elif code < 0:
            how = f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        tail = self._stderr.text() if self._stderr is not None else ""
        if tail:
            log.warning("constraint_compiler_stderr", stderr=tail[-2000:])
        return how

    async def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        if self._stderr is not None:
            await self._stderr.done()

    async def close(self) -> None:
        """Kill the child, if any."""
        await self._kill()


class _Tail:
    """Reads a child's stream to its end, keeping the last 8 KiB."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self._data = bytearray()
        self._task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            self._data += chunk
            del self._data[:-8192]

    def text(self) -> str:
        return self._data.decode("utf-8", "replace").strip()

    async def done(self) -> None:
        try:
            await asyncio.wait_for(self._task, 5.0)
        except (TimeoutError, asyncio.CancelledError):
            self._task.cancel()
