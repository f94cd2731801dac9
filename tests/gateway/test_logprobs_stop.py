"""Logprobs past a stop string (aidreams-260k, greedy): as vLLM does, the text ends before the
stop string while the logprobs keep every sampled token, up to and including the one that
completed the stop — so they join to more text than ``content`` / ``text`` (docs/serving.md,
"Logprobs and stop strings"). Pinned for chat and completions, whole and streamed."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.gateway import module_server

MODEL = "aidreams-260k"
server = module_server(MODEL)
PROMPT = "Once upon a time"
STOP = "unf"  # inside the token " unfolding" of the greedy answer


def _post(base: str, route: str, stream: bool, **kw: object) -> tuple[str, list[str], str]:
    """``(text, logprob tokens, finish_reason)`` of one greedy choice."""
    body: dict = {"model": MODEL, "max_tokens": 24, "temperature": 0, "stream": stream, **kw}
    if route == "chat":
        body |= {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True}
    else:
        body |= {"prompt": PROMPT, "logprobs": 0}
    url = base + ("/v1/chat/completions" if route == "chat" else "/v1/completions")
    if stream:
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: {")]
        choices = [c for ln in lines for c in json.loads(ln)["choices"]]
    else:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
    text, tokens, finish = "", [], ""
    for c in choices:
        part = c.get("delta") or c.get("message")
        text += (part.get("content") or "") if part is not None else c.get("text", "")
        lp = c.get("logprobs") or {}
        tokens += [t["token"] for t in lp.get("content") or []] + list(lp.get("tokens") or [])
        finish = c.get("finish_reason") or finish
    return text, tokens, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_logprobs_keep_the_token_that_completed_the_stop(server, route, stream):
    whole, tokens, _ = _post(server.url, route, stream=False)
    assert "".join(tokens) == whole and STOP in whole  # the unstopped answer, token by token
    at = whole.index(STOP)
    ends = [len("".join(tokens[: k + 1])) for k in range(len(tokens))]
    held = next(k for k, end in enumerate(ends) if end >= at + len(STOP)) + 1
    text, stopped, finish = _post(server.url, route, stream, stop=[STOP])
    assert finish == "stop"
    assert text == whole[:at]  # the text ends before the stop string
    assert stopped == tokens[:held]  # the logprobs through the token holding it
    assert "".join(stopped).startswith(text + STOP)
