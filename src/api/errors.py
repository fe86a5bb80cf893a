"""OpenAI-style error objects and the app's exception handlers.

Every error the API answers has the shape of OpenAI's error object
(https://platform.openai.com/docs/guides/error-codes)::

    {"error": {"message": "...", "type": "...", "param": "...", "code": "..."}}

Bad input is a 4xx, never a 500 (DESIGN.md section 7).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.actors.messages import RequestFailed

log = structlog.get_logger("kvserve.api")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error answered to the client as an OpenAI error object.

    Raise it anywhere below a route; the app's handler turns it into a
    ``JSONResponse`` with ``status`` and ``headers``.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {message, type, param, code}}``."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        """This error as a JSON response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = INVALID_REQUEST,  # noqa: A002
               param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """Build OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def retry_after_header(seconds: float | None) -> dict[str, str]:
    """``Retry-After`` in whole seconds (at least 1), or no header."""
    if seconds is None:
        return {}
    return {"Retry-After": str(max(1, int(-(-seconds // 1))))}


def from_failed(event: RequestFailed, status: int | None = None,
                headers: dict[str, str] | None = None) -> APIError:
    """Turn an engine ``RequestFailed`` into an ``APIError`` with ``headers``
    (e.g. the request's ``X-Request-Id``).

    A 429 always carries ``Retry-After`` (1 second when the engine gave none).
    """
    status = event.status if status is None else status
    retry = retry_after_header(event.retry_after)
    if status == 429 and not retry:
        retry = retry_after_header(1.0)
    return APIError(status, event.message, type=event.type, param=event.param,
                    code=event.code, headers={**(headers or {}), **retry})


async def handle_api_error(request: Request, exc: Exception) -> Response:
    """Exception handler for ``APIError``."""
    assert isinstance(exc, APIError)
    return exc.response()


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's 404/405 (and other ``HTTPException``) as OpenAI errors.

    The 404 message mirrors OpenAI's ``Invalid URL (POST /v1/foo)``.
    """
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method {request.method} not allowed for {request.url.path}"
    else:
        message = str(exc.detail)
    kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
    return JSONResponse(error_body(message, kind), status_code=exc.status_code,
                        headers=dict(exc.headers or {}))


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    """Last resort: a bug in the server is a 500 with an OpenAI error body."""
    log.exception("api_unhandled_exception", path=request.url.path)
    return JSONResponse(error_body("Internal server error", SERVER_ERROR), status_code=500)


EXCEPTION_HANDLERS = {
    APIError: handle_api_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
