"""The routing benchmark end to end at tiny sizes: 3 replicas, a gateway per policy, every
policy's row and the targets in its JSON (figures meaningless at this size)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_routing_bench_tiny(tmp_path):
    from examples.benchmarks import routing

    out = tmp_path / "routing.json"
    rc = routing.main(
        ["--requests", "4", "--hot-requests", "4", "--rounds", "2", "--json", str(out)]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"single", *routing.POLICIES}
    for row in data["results"].values():
        assert row["errors"] == 0 and row["requests"] == 4
    assert sum(data["results"]["round_robin"]["per_replica"]) == 4
