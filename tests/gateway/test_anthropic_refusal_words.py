"""A Messages refusal's advice is JSON, the client's own language: extended thinking refused
says to send ``{"type": "disabled"}`` (it said ``{'type': 'disabled'}``, a Python dict)."""

from __future__ import annotations

import httpx


def test_thinking_refusal_advises_json(serve_fake):
    srv, _ = serve_fake()
    body = {
        "model": "fake",
        "max_tokens": 2000,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "hi"}],
    }
    r = httpx.post(srv.url + "/v1/messages", json=body, timeout=10)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert '{"type": "disabled"}' in message and "'type'" not in message, message
    body["thinking"] = {"type": "disabled"}
    body["max_tokens"] = 2
    assert httpx.post(srv.url + "/v1/messages", json=body, timeout=10).status_code == 200
