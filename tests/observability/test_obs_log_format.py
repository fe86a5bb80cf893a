"""One log format (issue 25): under ``--log-format json`` every line is a JSON
object, the standard library's loggers (uvicorn's start-up and shutdown
lines, asyncio's errors, Python warnings) included."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator

import pytest
import structlog

from kvserve.observability.log import configure_logging


@pytest.fixture
def sink() -> Iterator[io.StringIO]:
    """A stream ``configure_logging`` writes to; the logging set-up before the
    test is restored after it."""
    root = logging.getLogger()
    handlers, level, config = list(root.handlers), root.level, structlog.get_config()
    # An earlier test's configure_logging may have left warnings captured into
    # a pytest recorder that is gone now; start from "not captured".
    logging.captureWarnings(False)
    yield io.StringIO()
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.configure(**config)


def test_json_format_renders_stdlib_loggers_as_json(sink: io.StringIO) -> None:
    configure_logging("json", "info", stream=io.StringIO())
    configure_logging("json", "info", stream=sink)  # replaces the first handler: no copies
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 123)
    structlog.get_logger("kvserve.server").info("server_ready", port=8000)
    try:
        raise ZeroDivisionError("division by zero")
    except ZeroDivisionError:
        logging.getLogger("asyncio").exception("Task exception was never retrieved")
    logging.getLogger("uvicorn.error").debug("below the level: not written")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        logging.captureWarnings(True)  # catch_warnings restored showwarning on entry
        warnings.warn("a deprecated thing", DeprecationWarning, stacklevel=1)

    events = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [(e["level"], e.get("logger")) for e in events] == [
        ("info", "uvicorn.error"), ("info", None), ("error", "asyncio"),
        ("warning", "py.warnings")]
    assert events[0]["event"] == "Started server process [123]"
    assert events[1]["event"] == "server_ready" and events[1]["port"] == 8000
    assert events[2]["event"] == "Task exception was never retrieved"
    assert "DeprecationWarning: a deprecated thing" in events[3]["event"]
    assert events[2]["exception"].endswith("ZeroDivisionError: division by zero")
    assert all(e["timestamp"].endswith("Z") and "T" in e["timestamp"] for e in events)


def test_console_format_renders_stdlib_loggers_like_structlog(sink: io.StringIO) -> None:
    configure_logging("console", "info", stream=sink)
    logging.getLogger("uvicorn.error").info("Uvicorn running on %s", "http://127.0.0.1:8000")
    structlog.get_logger().info("server_ready")
    lines = sink.getvalue().splitlines()
    assert len(lines) == 2
    assert "[info     ] Uvicorn running on http://127.0.0.1:8000" in lines[0]
    assert lines[0].rstrip().endswith("[uvicorn.error]")
    assert "[info     ] server_ready" in lines[1]


def test_uvicorn_lines_reach_our_handler_after_uvicorn_configured_its_own(sink: io.StringIO
                                                                         ) -> None:
    """A ``uvicorn.Config`` with uvicorn's default ``log_config`` gives
    ``uvicorn`` (``uvicorn.error``'s parent) a handler of its own and
    ``propagate=False``; configuring
    kvserve's logging afterwards brings its lines back to our one handler (the
    suite saw them vanish when such a test ran first)."""
    import uvicorn

    uvicorn.Config(lambda scope, receive, send: None)  # applies uvicorn.config.LOGGING_CONFIG
    assert logging.getLogger("uvicorn").propagate is False
    configure_logging("json", "info", stream=sink)
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 7)
    events = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [(e["logger"], e["event"]) for e in events] == [
        ("uvicorn.error", "Started server process [7]")]
