"""Upstream mode has one attempt loop (``proxy.attempts.each_upstream``) and one rewording of
upstream errors (``proxy.redact.upstream_error``): checked on the source (AST), so a route
that grows its own retry loop or error wording again fails here."""

from __future__ import annotations

import ast
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "gateway" / "proxy"


def _calls(name: str) -> dict[str, int]:
    """File (under gateway/proxy/) -> how many calls of a function or method ``name``."""
    out: dict[str, int] = {}
    for path in sorted(PROXY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called == name:
                    rel = path.relative_to(PROXY).as_posix()
                    out[rel] = out.get(rel, 0) + 1
    return out


def test_only_the_attempt_loop_takes_an_upstream_slot_and_settles_an_attempt():
    assert _calls("take") == {"attempts.py": 1}  # up.slots.take()
    assert set(_calls("end_attempt")) == {"attempts.py"}


def test_upstream_errors_are_reworded_in_one_place():
    assert set(_calls("reworded_error")) == {"redact.py"}
    assert "attempts.py" in set(_calls("upstream_error"))


def test_what_an_upstreams_refusal_does_is_judged_in_one_place():
    """Was: the chat route, the chat route's Anthropic deployments and both translating
    relays each judged an upstream's non-2xx answer themselves, and differed (529 sent on by
    the relays only; a down upstream's 503 answered as "every upstream failed" on chat and
    as its own reworded body on the relays; a 500's last error noted by some): every
    dialect now calls ``attempts.refusal``, the only reader of Retry-After here."""
    assert {"routes.py", "messages_relay.py", "gemini_relay.py"} <= set(_calls("refusal"))
    assert set(_calls("retry_after_seconds")) == {"attempts.py"}


def test_an_attempt_ending_in_the_upstreams_error_is_counted_by_its_status():
    """An upstream's 400 (reworded for the client) is counted as ``status="400"`` in
    ``prefixgate_upstream_requests_total``, on chat as on the Messages relay."""
    from aiohttp import web
    from support.chat_upstream import proxy_over_chat

    async def chat(request: web.Request) -> web.Response:
        err = {"error": {"message": "temperature: too hot", "type": "invalid_request_error"}}
        return web.json_response(err, status=400)

    with proxy_over_chat(chat) as http:
        ask = [{"role": "user", "content": "x"}]
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": ask})
        assert r.status_code == 400 and r.json()["error"]["message"] == "temperature: too hot"
        r = http.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": ask})
        assert r.status_code == 400 and r.json()["error"]["message"] == "temperature: too hot"
        metrics = http.get("/metrics").text
    counted = [
        line
        for line in metrics.splitlines()
        if line.startswith("prefixgate_upstream_requests_total{") and 'status="400"' in line
    ]
    assert counted and counted[0].endswith(" 2.0"), metrics
