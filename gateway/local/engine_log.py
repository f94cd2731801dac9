"""The periodic engine line, as vLLM's ``Avg prompt throughput ...`` log (logger
``prefixgate.engine.stats``, level INFO), every ``--stats-interval-s`` seconds while there is
activity:

    engine: prompt 812.4 tokens/s, generation 96.0 tokens/s, running 8, waiting 3,
    KV cache 41.2 % used, prefix hit rate 88.0 %

With speculative decoding on, the line ends with the interval's draft acceptance: ``,
spec acceptance 62.5 % (40/64 draft tokens)`` (vLLM's "SpecDecoding metrics" line).

Throughputs are over the interval (tokens prefilled / decoded since the previous line, divided
by the seconds between them); the prefix hit rate is the share of prompt tokens looked up in
the interval that were served from the prefix cache (the cumulative rate when none were).
Nothing is printed for an interval with no token computed and no request running or waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("prefixgate.engine.stats")


def stats_line(prev: dict[str, Any], cur: dict[str, Any], seconds: float) -> str | None:
    """The line for the interval from ``prev`` to ``cur`` (``engine.stats()`` snapshots taken
    ``seconds`` apart), or ``None`` when the engine was idle throughout."""
    prefilled = cur["prompt_tokens_prefilled"] - prev["prompt_tokens_prefilled"]
    decoded = cur["tokens_decoded"] - prev["tokens_decoded"]
    running, waiting = cur["num_running"], cur["num_waiting"]
    if not (prefilled or decoded or running or waiting):
        return None
    seconds = max(seconds, 1e-9)
    queries = cur["prefix_cache_queries"] - prev["prefix_cache_queries"]
    hits = cur["prefix_cache_hits"] - prev["prefix_cache_hits"]
    hit_rate = hits / queries if queries else cur.get("prefix_cache_hit_rate") or 0.0
    total = cur["kv_blocks_total"] or 1
    line = (
        f"engine: prompt {prefilled / seconds:.1f} tokens/s, generation {decoded / seconds:.1f} "
        f"tokens/s, running {running}, waiting {waiting}, KV cache "
        f"{100.0 * cur['kv_blocks_used'] / total:.1f} % used, prefix hit rate {100.0 * hit_rate:.1f} %"
    )
    if "spec_decode_num_draft_tokens" in cur:
        drafted = cur["spec_decode_num_draft_tokens"] - prev.get("spec_decode_num_draft_tokens", 0)
        accepted = cur["spec_decode_num_accepted_tokens"] - prev.get(
            "spec_decode_num_accepted_tokens", 0
        )
        rate = 100.0 * accepted / drafted if drafted else 0.0
        line += f", spec acceptance {rate:.1f} % ({accepted}/{drafted} draft tokens)"
    return line


async def log_engine_stats(
    stats: Callable[[], dict[str, Any]],
    interval_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Log :func:`stats_line` every ``interval_s`` seconds until cancelled.

    ``stats`` is ``engine.stats`` (a snapshot; never blocks). Raises ValueError for
    ``interval_s <= 0``.
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0 seconds, got {interval_s}")
    prev, t_prev = stats(), clock()
    while True:
        await asyncio.sleep(interval_s)
        cur, now = stats(), clock()
        line = stats_line(prev, cur, now - t_prev)
        if line:
            logger.info(line)
        prev, t_prev = cur, now
