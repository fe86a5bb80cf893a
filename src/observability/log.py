"""structlog set-up: one JSON object per line (or a console renderer), and start-up progress.

Named ``log.py``, not ``logging.py``, so it never shadows the standard
library. Every module gets its logger with ``structlog.get_logger(__name__)``
and binds ``request_id`` on request events. Lines of standard-library
loggers (uvicorn's "Uvicorn running on ...", asyncio's, Python warnings) get
the same level, time stamp and renderer, plus a ``logger`` key, through
structlog's ``ProcessorFormatter`` (structlog's recipe "Rendering Using
structlog-based Formatters Within logging"), so a JSON log is JSON on every
line. ``--log-format auto`` (the default) is ``console`` when standard
error is a terminal and ``json`` otherwise (``resolve_log_format``).

``LoadProgress`` keeps a long start-up talking: a line when each step ends,
with its seconds, and a ``startup_progress`` line whenever a step has been
silent for ``PROGRESS_INTERVAL`` seconds.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

#: ``--log-format`` values; ``auto`` picks by whether stderr is a terminal.
LOG_FORMATS = ("auto", "json", "console")
#: ``--log-level`` values (the standard library's levels, lower case).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: Most seconds a start-up step runs without a log line (``LoadProgress``).
PROGRESS_INTERVAL = 5.0


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write (so a
    logger configured once keeps working when stderr is swapped, e.g. by
    pytest's capture)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def resolve_log_format(fmt: str, isatty: bool | None = None) -> str:
    """``json`` or ``console`` for ``--log-format fmt``: ``auto`` is
    ``console`` when ``isatty`` (default: whether standard error is a
    terminal now), else ``json``; the other two as given. Raises
    ``ValueError`` for another value."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    if isatty is None:
        isatty = _stderr_isatty()
    return "console" if isatty else "json"


def _stderr_isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


#: uvicorn's loggers: a ``uvicorn.Config`` built with its default
#: ``log_config`` gives them handlers of their own and ``propagate=False``
#: (``uvicorn.config.LOGGING_CONFIG``), so their lines would bypass ours.
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def configure_logging(fmt: str = "json", level: str = "info", stream=None) -> None:
    """Configure structlog, and the stdlib root logger to render uvicorn's and
    other libraries' lines the same way (its one handler of ours is replaced
    on a repeated call, never stacked; uvicorn's loggers lose any handler of
    their own and propagate to it); ``warnings`` go to logging too.

    Args:
        fmt: ``json`` (one JSON object per line), ``console`` (for people)
            or ``auto`` (``resolve_log_format``: console on a terminal).
        level: one of ``LOG_LEVELS`` (any case).
        stream: where to write; standard error by default.

    Raises:
        ValueError: unknown format or level.
    """
    fmt = resolve_log_format(fmt)
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    numeric = logging.getLevelName(level.upper())
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else _ConsoleLine(structlog.dev.ConsoleRenderer(colors=False)))
    stream = stream or _CurrentStderr()
    stamp = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
             structlog.processors.TimeStamper(fmt="iso", utc=True)]
    structlog.configure(
        processors=[*stamp, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # one write per line (PrintLogger's print writes the newline apart,
        # so another thread's line -- Ray forwarding a replica's -- could
        # land between a line and its newline)
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    _set_root_handler(stream, numeric, structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*stamp, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger
    for name in UVICORN_LOGGERS:  # undo a uvicorn.Config whose log_config set its own
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
        uvicorn_logger.setLevel(logging.NOTSET)
    # httpx logs every request at INFO; in the tools that is noise between the results.
    logging.getLogger("httpx").setLevel(max(numeric, logging.WARNING))


#: Keys a console line keeps besides its message (the rest are for machines:
#: ``--log-format json`` has them all).
_CONSOLE_KEYS = frozenset({"timestamp", "level", "logger", "exception", "exc_info", "stack",
                           "request_id"})


class _ConsoleLine:
    """The console renderer for people: an event with a ``message`` shows
    that sentence in the event name's place, with only ``_CONSOLE_KEYS``
    beside it (``kvserve 0.1.0`` rather than ``version message='kvserve
    0.1.0' version=0.1.0``); an event without one is shown as structlog
    shows it."""

    def __init__(self, renderer) -> None:
        self.renderer = renderer

    def __call__(self, logger, name: str, event_dict: dict) -> str:
        message = event_dict.get("message")
        if isinstance(message, str):
            event_dict = {key: value for key, value in event_dict.items()
                          if key in _CONSOLE_KEYS}
            event_dict["event"] = message
        return self.renderer(logger, name, event_dict)


class _RootHandler(logging.StreamHandler):
    """The root logger's handler that ``configure_logging`` owns (and replaces)."""


def _set_root_handler(stream, level: int, formatter: logging.Formatter) -> None:
    """Give the root logger one ``_RootHandler`` on ``stream`` with
    ``formatter``, replacing the one an earlier call added (handlers others
    added, such as pytest's, stay)."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _RootHandler)]:
        root.removeHandler(old)
    handler = _RootHandler(stream)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(level)


class LoadProgress:
    """Progress lines of a long start-up (fetch, convert, load, warm-up).

    Each ``step`` logs ``startup_step`` when it ends, with its seconds; while
    steps run, a daemon thread logs ``startup_progress`` (the step, its
    seconds so far) whenever no line of this object came for ``interval``
    seconds, so the start is never silent for longer. Use as a context
    manager around the steps (the thread runs inside it)::

        with LoadProgress(log) as progress:
            with progress.step("weights", "loading the weights"):
                ...
    """

    def __init__(self, logger, interval: float = PROGRESS_INTERVAL,
                 clock=time.monotonic) -> None:
        self.log = logger
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()
        self._current: tuple[str, str, float] | None = None  # step, doing, started
        self._last_line = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LoadProgress:
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="startup-progress",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @contextmanager
    def step(self, name: str, doing: str) -> Iterator[None]:
        """Run one step (``name``, e.g. ``weights``; ``doing``, e.g. "loading
        the weights"); logs ``startup_step`` with its seconds when it ends
        without an error."""
        started = self.clock()
        with self._lock:
            self._current = (name, doing, started)
        try:
            yield
        finally:
            with self._lock:
                self._current = None
        seconds = round(self.clock() - started, 3)
        self._logged()
        self.log.info("startup_step", step=name, seconds=seconds,
                      message=f"Done {doing} in {seconds:.1f} s")

    def _logged(self) -> None:
        with self._lock:
            self._last_line = self.clock()

    def heartbeat(self) -> bool:
        """Log ``startup_progress`` if a step runs and nothing was logged for
        ``interval`` seconds; True when it logged (the watcher calls it)."""
        with self._lock:
            current, now = self._current, self.clock()
            if current is None or now - self._last_line < self.interval:
                return False
            self._last_line = now
        name, doing, started = current
        elapsed = round(now - started, 1)
        self.log.info("startup_progress", step=name, elapsed_s=elapsed,
                      message=f"Still {doing} ({elapsed:.0f} s so far)...")
        return True

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.interval / 4)):
            self.heartbeat()
