"""HTTP assertions shared by the gateway tests."""

from __future__ import annotations

from typing import Any


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
