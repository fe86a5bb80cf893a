"""structlog set-up: one JSON object per line (or a console renderer).

Named ``log.py``, not ``logging.py``, so it never shadows the standard
library. Every module gets its logger with ``structlog.get_logger(__name__)``
and binds ``request_id`` on request events.
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
    """Configure structlog (and the stdlib root logger, for uvicorn's lines).

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
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(stream or _CurrentStderr()),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=numeric, stream=stream or _CurrentStderr(), format="%(message)s")
    # httpx logs every request at INFO; in the tools that is noise between the results.
    logging.getLogger("httpx").setLevel(max(numeric, logging.WARNING))
