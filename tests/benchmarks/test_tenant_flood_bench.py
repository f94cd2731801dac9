"""The tenant-flood benchmark's reading of the server log: light's first-token walks."""

from __future__ import annotations

from examples.benchmarks.tenant_flood import (
    light_walks,
    round_sizes,
    split_walks,
    walk_summary,
)

LOG = """\
2026-12-02 03:00:00,000 INFO prefixgate.access: 127.0.0.1 "POST /v1/chat/completions" 200 \
key=light prompt=10 completion=8 cached=0 walk=admit:0.1,wait:2.0,steps:0,step:17tok/4.0,\
chunk:10,to_token:4.0 0.050s
2026-12-02 03:00:00,001 INFO prefixgate.access: 127.0.0.1 "POST /v1/chat/completions" 200 \
key=heavy prompt=40 completion=256 cached=0 walk=admit:0.1,wait:9.0 2.000s
2026-12-02 03:00:00,002 INFO prefixgate.engine.stats: engine: prompt 1.0 tokens/s
2026-12-02 03:00:00,003 INFO prefixgate.access: 127.0.0.1 "POST /v1/chat/completions" 200 \
key=light prompt=10 completion=8 cached=0 walk=admit:0.3,wait:6.0 0.060s
"""


def test_light_walks_read_only_light_access_lines_in_order():
    walks = light_walks(LOG)
    assert [w["wait"] for w in walks] == [2.0, 6.0]
    assert walks[0]["step_tokens"] == 17 and walks[0]["step_ms"] == 4.0
    summary = walk_summary(walks)
    assert summary["wait"] == (2.0, 6.0)  # (p50, p99) of two: the nearest ranks
    assert summary["chunk"] == (10.0, 10.0) and "deliver" not in summary


def test_rounds_split_light_requests_and_their_walks():
    assert round_sizes(10, 4) == [3, 3, 2, 2]
    assert round_sizes(3, 4) == [1, 1, 1]  # never an empty round
    assert round_sizes(0, 4) == [0]
    # warm-up 2, then rounds of 2 and 1: solo, flooded, solo, flooded
    walks = [{"i": float(i)} for i in range(2 + 2 * 2 + 2 * 1)]
    solo, flood = split_walks(walks, 2, [2, 1])
    assert [w["i"] for w in solo] == [2.0, 3.0, 6.0]
    assert [w["i"] for w in flood] == [4.0, 5.0, 7.0]
