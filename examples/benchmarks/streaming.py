"""When the text of a streamed ``/v1/completions`` answer arrived, chunk by chunk (the peer
benchmarks' TTFT and decode-rate measures)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx


def text_chunk_times(client: httpx.Client, body: dict[str, Any]) -> list[float]:
    """``time.perf_counter()`` seconds at each server-sent event of ``POST /v1/completions``
    (``body`` with ``"stream": true``) whose first choice carries text, in order (events
    without choices or text, and ``[DONE]``, are skipped).

    Raises:
        httpx.HTTPStatusError: a non-2xx answer.
    """
    times = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.perf_counter())
    return times
