"""structlog set-up: one JSON object per line (or a console renderer).

Named ``log.py``, not ``logging.py``, so it never shadows the standard
library. Every module gets its logger with ``structlog.get_logger(__name__)``
and binds ``request_id`` on request events. Lines of standard-library
loggers (uvicorn's "Uvicorn running on ...", asyncio's, Python warnings) get
the same level, time stamp and renderer, plus a ``logger`` key, through
structlog's ``ProcessorFormatter`` (structlog's recipe "Rendering Using
structlog-based Formatters Within logging"), so a JSON log is JSON on every
line.
"""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write (so a
    logger configured once keeps working when stderr is swapped, e.g. by
    pytest's capture)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(fmt: str = "json", level: str = "info", stream=None) -> None:
    """Configure structlog, and the stdlib root logger to render uvicorn's and
    other libraries' lines the same way (its one handler of ours is replaced
    on a repeated call, never stacked); ``warnings`` go to logging too.

    Args:
        fmt: ``json`` (one JSON object per line) or ``console`` (for people).
        level: ``debug``, ``info``, ``warning`` or ``error``.
        stream: where to write; standard error by default.

    Raises:
        ValueError: unknown format or level.
    """
    if fmt not in ("json", "console"):
        raise ValueError(f"log format must be json or console, got {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False))
    stream = stream or _CurrentStderr()
    stamp = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
             structlog.processors.TimeStamper(fmt="iso", utc=True)]
    structlog.configure(
        processors=[*stamp, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    _set_root_handler(stream, numeric, structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*stamp, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger
    # httpx logs every request at INFO; in the tools that is noise between the results.
    logging.getLogger("httpx").setLevel(max(numeric, logging.WARNING))


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
