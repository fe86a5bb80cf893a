"""Connection hygiene (issue 14, failure 1): idle sockets, a request head or
body that trickles in, too many connections and oversized headers are all
bounded. A real uvicorn server (``kvserve.api.server.uvicorn_config``) on a
fake engine, driven with raw sockets, since an HTTP client cannot send half a
request. Each test waits on the socket with a deadline, never on a sleep.

The deadlines catch a server that never acts (issue 33): they are hang
deadlines, generous and saying the load average when they pass; what a test
asserts is the server's answer and its order (a 408 while a head still
trickles in), or a lower bound (an idle socket is not closed before its
keep-alive timeout), which a busy machine cannot break."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from deadlines import hang_message
from fake_engine import FakeEngine

from kvserve.api import build_app
from kvserve.api.server import uvicorn_config
from kvserve.config import ServerConfig

LIMITS = ServerConfig(port=0, timeout_keep_alive=0.5, timeout_request_head=1.0,
                      timeout_request_body=1.0, max_connections=40, max_header_bytes=4096)
#: Seconds a test allows beyond a timeout for the server to act on it: a
#: hang deadline, not a bound on how fast the server acts.
SLACK = 120.0


class ServerThread:
    """uvicorn with ``limits`` on a fake engine, on its own event-loop thread."""

    def __init__(self, limits: ServerConfig) -> None:
        app = build_app(FakeEngine(), limits)
        self.server = uvicorn.Server(uvicorn_config(app, limits))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + SLACK
        while not self.server.started:
            assert time.monotonic() < deadline, hang_message("uvicorn did not start", SLACK)
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return sock

    @property
    def open_connections(self) -> int:
        return len(self.server.server_state.connections)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    handle = ServerThread(LIMITS)
    yield handle
    handle.stop()


def read_until_closed(sock: socket.socket, within: float) -> bytes:
    """Everything the server sends until it closes the connection; fails if
    it is still open after ``within`` seconds."""
    sock.settimeout(within)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        pytest.fail(hang_message("the server did not close the connection", within))
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def error_of(response: bytes) -> dict:
    return json.loads(response.partition(b"\r\n\r\n")[2])["error"]


def get(server: ServerThread, path: str = "/health", headers: str = "") -> bytes:
    with server.connect() as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{headers}\r\n"
                     .encode())
        return read_until_closed(sock, SLACK)


def test_idle_connection_is_closed_after_the_keep_alive_timeout(server: ServerThread) -> None:
    with server.connect() as sock:
        start = time.monotonic()
        assert read_until_closed(sock, LIMITS.timeout_keep_alive + SLACK) == b""
        assert time.monotonic() - start >= LIMITS.timeout_keep_alive * 0.9


def test_idle_after_a_response_is_closed_too(server: ServerThread) -> None:
    with server.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        response = read_until_closed(sock, LIMITS.timeout_keep_alive + SLACK)
        assert status_of(response) == 200


@pytest.mark.parametrize("partial", [
    b"GET /heal",                                        # a partial request line
    b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: 1",     # partial headers
])
def test_a_partial_request_head_gets_408(server: ServerThread, partial: bytes) -> None:
    with server.connect() as sock:
        sock.sendall(partial)
        response = read_until_closed(sock, LIMITS.timeout_request_head + SLACK)
    assert status_of(response) == 408
    assert "head" in error_of(response)["message"]


def test_a_head_trickling_in_byte_by_byte_still_gets_408(server: ServerThread) -> None:
    """Each byte resets the keep-alive timer; the head deadline does not move:
    the 408 comes while the head still trickles in (one byte each 0.2 s at
    most, 46 s for all of it, against a 1-s head deadline), not after the
    last byte (as it would if each byte moved the deadline)."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * 200
    sent = 0
    with server.connect() as sock:
        sock.settimeout(0.2)
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break  # closed on us: what we expect
            sent += 1
            try:
                if sock.recv(65536, socket.MSG_PEEK):
                    break
            except TimeoutError:
                pass
        response = read_until_closed(sock, SLACK)
    assert status_of(response) == 408
    assert sent < len(head), "the 408 came only after the whole head was sent"


def test_a_partial_body_gets_408_and_the_server_goes_on(server: ServerThread) -> None:
    """The issue's example: Content-Length 100, 2 bytes sent."""
    with server.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: 100\r\n\r\n{\"")
        response = read_until_closed(sock, LIMITS.timeout_request_body + SLACK)
    assert status_of(response) == 408
    assert "body" in error_of(response)["message"]
    assert status_of(get(server)) == 200


def test_connections_above_the_bound_get_503_before_anything_is_read(
        server: ServerThread) -> None:
    held = [server.connect() for _ in range(LIMITS.max_connections)]
    try:
        deadline = time.monotonic() + SLACK
        while server.open_connections < LIMITS.max_connections:
            assert time.monotonic() < deadline, hang_message(
                "the server did not accept the connections", SLACK)
            time.sleep(0.01)
        with server.connect() as extra:  # sends nothing: refused on accept
            response = read_until_closed(extra, SLACK)
        assert status_of(response) == 503
        assert error_of(response)["type"] == "service_unavailable"
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + SLACK
    while server.open_connections > 0:
        assert time.monotonic() < deadline, hang_message(
            "closed connections are still counted", SLACK)
        time.sleep(0.01)
    assert status_of(get(server)) == 200


def test_headers_above_the_bound_get_431(server: ServerThread) -> None:
    """A 60 KB X-Request-Class used to be accepted and copied into the log."""
    response = get(server, headers=f"x-request-class: {'a' * 60_000}\r\n")
    assert status_of(response) == 431
    assert "max-header-bytes" in error_of(response)["message"]
    many = "".join(f"x-h{i}: {'b' * 50}\r\n" for i in range(100))  # another shape: many headers
    assert status_of(get(server, headers=many)) == 431
    assert status_of(get(server, headers="x-small: 1\r\n")) == 200


def test_a_head_growing_past_the_bound_in_pieces_is_refused(server: ServerThread) -> None:
    """h11's bound on an incomplete head: the connection is answered 400 and
    closed without waiting for the rest."""
    with server.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        for _ in range(10):
            try:
                sock.sendall(b"x-pad: " + b"c" * 1000 + b"\r\n")
            except OSError:
                break
        response = read_until_closed(sock, SLACK)
    assert status_of(response) == 400


#: A complete request smuggled in the body of the one before it.
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"


def ambiguous_request(framing: list[bytes]) -> bytes:
    """A POST whose ``framing`` headers disagree on where its body ends; read
    as chunked the body is empty and ``SMUGGLED`` is the next request."""
    body = b"0\r\n\r\n" + SMUGGLED
    head = [b"POST /v1/completions HTTP/1.1", b"host: x",
            b"content-type: application/json",
            *(line.replace(b"{len}", str(len(body)).encode()) for line in framing)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


@pytest.mark.parametrize("framing", [
    [b"content-length: {len}", b"transfer-encoding: chunked"],
    [b"Transfer-Encoding: Chunked", b"Content-Length: {len}"],
    [b"CONTENT-LENGTH: {len}", b"TRANSFER-ENCODING: CHUNKED"],
    [b"content-length: {len}", b"transfer-encoding: gzip, chunked"],
    [b"transfer-encoding: chunked, gzip"],
    [b"transfer-encoding: chunked", b"transfer-encoding: chunked"],
    [b"content-length: {len}", b"content-length: 5"],
    [b"content-length: 5, {len}"],
], ids=["cl-te", "te-cl-mixed-case", "upper-case", "te-gzip-chunked", "te-chunked-not-last",
        "two-te", "two-cl", "cl-list"])
def test_ambiguous_framing_gets_400_and_the_connection_closes(
        server: ServerThread, framing: list[bytes]) -> None:
    """RFC 9112, section 6.3: a request whose framing is ambiguous is answered
    400 and the connection closed; the request hidden in its body never runs."""
    with server.connect() as sock:
        sock.sendall(ambiguous_request(framing))
        response = read_until_closed(sock, SLACK)
    assert response.count(b"HTTP/1.1 ") == 1, response  # no second response
    assert status_of(response) == 400
    assert b"connection: close" in response.lower()
    assert error_of(response)["type"] == "invalid_request_error"
    assert status_of(get(server)) == 200


def chunked_completion(version: bytes) -> bytes:
    """A valid completion request with a chunked body."""
    body = b'{"prompt": "hi", "max_tokens": 2}'
    return (b"POST /v1/completions HTTP/" + version + b"\r\nhost: x\r\nconnection: close\r\n"
            b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")


def test_a_lone_chunked_request_is_still_served(server: ServerThread) -> None:
    """Transfer-Encoding: chunked alone (HTTP/1.1) is unambiguous and allowed."""
    with server.connect() as sock:
        sock.sendall(chunked_completion(b"1.1"))
        response = read_until_closed(sock, SLACK)
    assert status_of(response) == 200


def test_transfer_encoding_in_http_1_0_gets_400(server: ServerThread) -> None:
    """RFC 9112, section 6.1: an HTTP/1.0 message with Transfer-Encoding has
    faulty framing (an HTTP/1.0 intermediary may not have understood it)."""
    with server.connect() as sock:
        sock.sendall(chunked_completion(b"1.0"))
        response = read_until_closed(sock, SLACK)
    assert status_of(response) == 400
    assert "HTTP/1.0" in error_of(response)["message"]
