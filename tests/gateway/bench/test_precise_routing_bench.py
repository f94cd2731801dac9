"""The precise routing benchmark end to end at tiny sizes: 2 aidreams replicas with KV events,
a gateway per policy, every policy's row in its JSON and precise's predictions counted
(figures meaningless at this size)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_precise_routing_bench_tiny(tmp_path, aidreams_path):
    from prefixgate.gateway.bench import precise_routing

    out = tmp_path / "precise.json"
    rc = precise_routing.main(
        [
            "--model",
            aidreams_path,
            "--replicas",
            "2",
            "--tenants",
            "3",
            "--requests",
            "6",
            "--rate",
            "20",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(precise_routing.POLICIES)
    for row in rows.values():
        assert row["errors"] == 0 and row["requests"] == 6
    assert sum(rows["round_robin"]["per_replica"]) == 6
    assert sum(rows["precise"]["predictions"].values()) == 6
