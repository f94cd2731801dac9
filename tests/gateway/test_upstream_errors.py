"""Upstream mode: an upstream error without an OpenAI body (HTML, traceback, nothing, gzip
garbage) is wrapped in one; OpenAI error bodies pass as they are."""

from __future__ import annotations

from support.http import assert_openai_error as _error


def test_upstream_errors_without_an_openai_body_are_wrapped():
    # Upstream mode passed an upstream's error body through verbatim: an HTML 404 page, an
    # empty 500, even a Python traceback reached the client (the rule: OpenAI error objects,
    # never a stack trace on the wire). OpenAI error bodies still pass as they are.
    import gzip
    import json

    from aiohttp import web
    from support.chat_upstream import proxy_over_chat

    answers = {
        "traceback": (
            500,
            b"Traceback (most recent call last):\n  File \"x\"\nKeyError: 'k'",
            "text/plain",
            None,
        ),
        "html": (404, b"<h1>Not Found</h1>", "text/html", None),
        "empty": (500, b"", "application/json", None),
        "list": (400, b"[1, 2]", "application/json", None),
        "gzip-garbage": (
            500,
            gzip.compress(b"Traceback (most recent call last):"),
            "text/plain",
            "gzip",
        ),
        "openai": (
            429,
            json.dumps(
                {
                    "error": {
                        "message": "slow down",
                        "type": "rate_limit_error",
                        "param": None,
                        "code": "x",
                    }
                }
            ).encode(),
            "application/json",
            None,
        ),
        "openai-gzip": (
            400,
            gzip.compress(
                json.dumps(
                    {
                        "error": {
                            "message": "nope",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": None,
                        }
                    }
                ).encode()
            ),
            "application/json",
            "gzip",
        ),
    }

    async def chat(request: web.Request) -> web.Response:
        status, body, ctype, enc = answers[(await request.json())["model"]]
        headers = {"Content-Type": ctype, "Retry-After": "3"}
        if enc:
            headers["Content-Encoding"] = enc
        return web.Response(status=status, body=body, headers=headers)

    with proxy_over_chat(chat) as http:
        for model, (status, _, _, _) in answers.items():
            r = http.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "x"}]},
            )
            assert r.status_code == status, (model, r.text)
            err = _error(r, status)
            assert "Traceback" not in r.text and "<h1>" not in r.text
            assert r.headers.get("Retry-After") == "3", model
            if model == "openai":
                assert err["message"] == "slow down"
            elif model == "openai-gzip":
                assert err["message"] == "nope"
            else:
                assert err["code"] == "upstream_error", err
