"""HTTP assertions and waits shared by the gateway tests."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import httpx


def assert_openai_error(
    r: Any, status: int, code: str | None = None, param: str | None = None
) -> dict:
    """Assert ``r`` (an httpx response) is an OpenAI error object with ``status`` (and
    ``code`` / ``param`` when given), JSON, no traceback anywhere in it; returns the error."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def wait_ready(
    url: str,
    timeout_s: float = 60.0,
    proc: subprocess.Popen | None = None,
    poll_s: float = 0.1,
    request_timeout_s: float = 5.0,
) -> None:
    """Poll ``GET {url}/ready`` every ``poll_s`` seconds until it answers 200; a transport
    error counts as not yet. Fails the test (AssertionError) when ``proc`` (the server's
    process, if any) exits first or past ``timeout_s`` seconds (a failure guard, not a
    timed assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/ready", timeout=request_timeout_s).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc is None or proc.poll() is None, f"{url}: the server exited ({proc.returncode})"
        assert time.monotonic() < deadline, f"{url} not ready within {timeout_s:g} s"
        time.sleep(poll_s)


def counts_both_modes(
    local: str,
    proxy: str,
    path: str,
    bodies: dict[str, Any],
    field: str,
    wrap_in: str | None = None,
) -> dict[tuple[str, str], int]:
    """The token count (the answer's ``field``) of each of ``bodies`` (name: the JSON body
    POSTed to ``path``; with ``wrap_in``, POSTed as ``{wrap_in: body}``) in local mode (base
    URL ``local``) and through the proxy (``proxy``), by ``(mode, name)``; every answer a
    200."""
    counts: dict[tuple[str, str], int] = {}
    for mode, base in (("local", local), ("proxy", proxy)):
        for name, body in bodies.items():
            sent = body if wrap_in is None else {wrap_in: body}
            r = httpx.post(base + path, json=sent, timeout=120)
            assert r.status_code == 200, (mode, name, r.text)
            counts[mode, name] = r.json()[field]
    return counts
