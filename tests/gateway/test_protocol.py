"""Connections: header/body timeouts, the connection bound, 413 at once, and protocol errors
answered as OpenAI error objects (gateway/http/connections.py, gateway/http/body_limits.py)."""

from __future__ import annotations

import json
import resource
import socket
import time

import pytest
from prefixgate.gateway.http.connections import fd_budget, raise_nofile_limit
from prefixgate.gateway.settings import GatewaySettings


def _chat_head(content_length: int) -> bytes:
    """A chat POST declaring ``content_length`` body bytes, of which it sends only ``{``."""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: %d\r\n\r\n{" % content_length
    )


def _raw(port: int, data: bytes, wait_s: float = 5.0) -> tuple[bytes, float]:
    """Send ``data`` on a fresh connection; read until the server closes (or ``wait_s``);
    return (what came back, seconds until the first byte or the close)."""
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(wait_s)
    first = None
    out = b""
    try:
        if data:
            s.sendall(data)
        while True:
            chunk = s.recv(65536)
            if first is None:
                first = time.monotonic() - t0
            if not chunk:
                break
            out += chunk
    except TimeoutError:
        out += b"<still open>"
    finally:
        s.close()
    return out, first if first is not None else time.monotonic() - t0


def _error(raw: bytes) -> tuple[int, dict]:
    """(status, error object) of a raw HTTP response; asserts the body is an OpenAI error."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head, head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return status, err


@pytest.fixture
def limited(serve_fake):
    settings = GatewaySettings(
        model_name="fake",
        header_timeout_s=1.0,
        body_timeout_s=1.0,
        max_connections=8,
        max_body_bytes=4096,
    )
    srv, _ = serve_fake(settings)
    return srv


@pytest.mark.parametrize(
    "data,status,code",
    [
        # a TLS ClientHello on the HTTP port
        (
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,
            400,
            "invalid_http_request",
        ),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 10000 + b"\r\n\r\n", 431, None),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-%d: a\r\n" % i for i in range(200))
            + b"\r\n",
            431,
            "request_headers_too_large",
        ),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"zz\r\nabc\r\n0\r\n\r\n",
            400,
            "invalid_http_request",
        ),
        (b"NOT HTTP AT ALL\r\n\r\n", 400, "invalid_http_request"),
    ],
    ids=["tls-hello", "long-header", "too-many-headers", "broken-chunked", "garbage"],
)
def test_protocol_errors_are_openai_error_objects(limited, data, status, code):
    raw, _ = _raw(limited.server.port, data)
    got, err = _error(raw)
    assert got == status
    assert code is None or err["code"] == code
    assert b"Connection: close" in raw or raw.startswith(b"HTTP/1.0")
    assert b"\r\nx-request-id: " in raw.partition(b"\r\n\r\n")[0].lower()  # every answer


def test_declared_content_length_over_the_limit_is_413_at_once(limited):
    # 100 GB declared, one byte sent: answered before any body is waited for.
    raw, first = _raw(limited.server.port, _chat_head(100_000_000_000))
    status, err = _error(raw)
    assert status == 413 and err["code"] == "request_too_large"
    assert first < 0.9  # before the 1 s body timeout could have fired


def test_slow_body_gets_408_and_the_connection_closes(limited):
    raw, _ = _raw(limited.server.port, _chat_head(100))
    status, err = _error(raw)
    assert status == 408 and err["code"] == "request_timeout"
    assert not raw.endswith(b"<still open>")


def test_slow_headers_are_closed_at_the_header_timeout(limited):
    # One header line, then nothing: closed after header_timeout_s (1 s), not 75 s.
    t0 = time.monotonic()
    raw, _ = _raw(limited.server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n", wait_s=5.0)
    assert raw == b"" and time.monotonic() - t0 < 4.0


def test_connections_beyond_the_bound_get_503_and_health_answers_after(limited, gw):
    port = limited.server.port
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        time.sleep(0.3)
        raw, _ = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, err = _error(raw)
        assert status == 503 and err["code"] == "too_many_connections"
        assert b"Retry-After" in raw
        assert b"\r\nx-request-id: " in raw.partition(b"\r\n\r\n")[0].lower()
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    with gw.client(limited) as c:
        assert c.get("/health").status_code == 200


def test_nofile_limit_raised_and_connection_budget_below_it():
    soft = raise_nofile_limit()
    assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert 1 <= fd_budget() < soft
    assert fd_budget(2) <= fd_budget() // 2 + 1


_LATE_BAD_BODIES = {
    "deflate": (b"Content-Encoding: deflate\r\nContent-Length: 2\r\n", b"{}"),
    "gzip": (b"Content-Encoding: gzip\r\nContent-Length: 2\r\n", b"{}"),
    "broken-chunked": (b"Transfer-Encoding: chunked\r\n", b"zz\r\nabc\r\n0\r\n\r\n"),
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/nowhere"])
@pytest.mark.parametrize("kind", sorted(_LATE_BAD_BODIES))
def test_undecodable_body_after_its_headers_is_400_at_once(serve_fake, path, kind):
    """Headers first, then a body the parser cannot read (bad compressed data, broken chunked
    framing): the request already handed to a handler reading its body gets a 400 at once
    (the parser's error used to be queued behind it as a next request, and the handler
    waited for the body timeout)."""
    headers, body = _LATE_BAD_BODIES[kind]
    srv, _ = serve_fake(GatewaySettings(model_name="fake", body_timeout_s=30.0))
    s = socket.create_connection(("127.0.0.1", srv.server.port))
    s.settimeout(20)  # well before the 30 s body timeout: a wait for it fails the test
    try:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + headers
            + b"\r\n"
        )
        time.sleep(0.3)  # the handler is reading the body by now
        s.sendall(body)
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    finally:
        s.close()
    status, err = _error(raw)
    assert status == 400 and err["code"] in ("invalid_body", "invalid_http_request"), err
