"""A local server's heap stays flat after start-up, whatever row counts its steps reach.

oneDNN and ideep keep one compiled primitive per GEMM shape (~0.6 MB each, for good): a server
whose steps reach a row count it had not seen grew by megabytes at once, so its memory curve
rose in steps for thousands of requests (docs/benchmarks/memory-curve.md). With
``warmup_row_counts`` every count a step can reach is compiled at load, so requests of every
dialect (chat completions and Anthropic Messages, streamed and not), in concurrent rounds of
distinct prompt lengths (steps mixing prefill chunks and decode rows), leave glibc's heap in
use (``mallinfo2``, ``support.heap``: the in-process server's bytes, not RSS) within
:data:`CAP_BYTES` of where the first round left it. Without the warm-up the same requests kept
20-24 MiB (new row counts; measured 0.8-0.9 MiB with it).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prefixgate.engine.models.cpu_linear import onednn_linear_available
from support.gateway import serve_aidreams
from support.heap import heap_in_use

from examples.benchmarks.memory_curve import send_one

CAP_BYTES = 4 << 20
"""What the measured rounds may leave in use: 4 MiB (a handful of row counts' primitives)."""

ROUND = 8  # concurrent requests a round


def _request(i: int, words: int) -> tuple[str, dict, bool]:
    """Request ``i``: chat or Messages, streamed or not, in turn; a prompt of ``words`` words."""
    stream = i % 2 == 0
    messages = [{"role": "user", "content": " ".join(["story"] * words)}]
    if i % 4 < 2:
        body = {"model": "m", "messages": messages, "max_tokens": 3, "stream": stream}
        return "/v1/messages", body, stream
    body = {"model": "m", "messages": messages, "max_tokens": 3, "stream": stream}
    return "/v1/chat/completions", body, stream


async def _round(url: str, first: int, lengths: list[int]) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return list(
            await asyncio.gather(
                *(send_one(http, _request(first + j, w)) for j, w in enumerate(lengths))
            )
        )


@pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN's linear")
def test_heap_flat_over_row_counts_and_dialects(aidreams_path):
    server = serve_aidreams(
        aidreams_path,
        engine_args={"warmup_row_counts": True, "max_num_batched_tokens": 256},
        model_name="m",
    )
    srv = next(server)
    try:
        # the first round: every dialect's code path runs once, its buffers grow
        assert asyncio.run(_round(srv.url, 0, [1, 3, 9, 15, 22, 30, 36, 40])) == [200] * ROUND
        before = heap_in_use()
        served = ROUND
        for r in range(
            6
        ):  # 48 requests, prompts of 1-40 words (3 tokens each: up to ~120 of the 128)
            lengths = [1 + (11 * r + 13 * j) % 40 for j in range(ROUND)]
            assert asyncio.run(_round(srv.url, served, lengths)) == [200] * ROUND
            served += ROUND
        growth = heap_in_use() - before
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    finally:
        next(server, None)
    assert growth < CAP_BYTES, f"heap in use grew {growth / 2**20:.1f} MiB"
    # the server's heap in use, as /metrics shows it (this process's: the server is in it)
    (line,) = [x for x in metrics.splitlines() if x.startswith("prefixgate_process_heap_bytes ")]
    assert float(line.split()[1]) > 100 << 20  # the warmed primitives alone
