"""The precise routing benchmark end to end at tiny sizes: 2 aidreams replicas with KV events,
a gateway per policy, every policy's row in its JSON and precise's predictions counted
(figures meaningless at this size)."""

from __future__ import annotations

import json

import pytest


def _tiny(model: str, *more: str) -> list[str]:
    """The benchmark's arguments at tiny sizes (2 replicas, 3 tenants, 6 requests at 20/s)."""
    tiny = ["--replicas", "2", "--tenants", "3", "--requests", "6", "--rate", "20"]
    return ["--model", model, *tiny, *more]


@pytest.mark.slow
def test_precise_routing_bench_tiny(tmp_path, aidreams_path):
    from examples.benchmarks import precise_routing

    out = tmp_path / "precise.json"
    rc = precise_routing.main(_tiny(aidreams_path, "--json", str(out)))
    assert rc == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(precise_routing.POLICIES)
    for row in rows.values():
        assert row["errors"] == 0 and row["requests"] == 6
    assert sum(rows["round_robin"]["per_replica"]) == 6
    assert sum(rows["precise"]["predictions"].values()) == 6


@pytest.mark.slow
def test_precise_routing_bench_two_gateways_warmup_and_plot(tmp_path, aidreams_path):
    """Two gateways per policy behind the round-robin client, a warm-up (not counted), the
    plot written as a PNG."""
    from examples.benchmarks import precise_routing

    out, png = tmp_path / "precise.json", tmp_path / "precise.png"
    rc = precise_routing.main(
        _tiny(
            aidreams_path,
            "--gateways",
            "2",
            "--warmup",
            "--policies",
            "precise,round_robin,single",
            "--json",
            str(out),
            "--plot",
            str(png),
        )
    )
    assert rc == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    for row in rows.values():
        assert row["errors"] == 0 and row["requests"] == 6 and len(row["ttfts"]) == 6
    assert sum(rows["round_robin"]["per_replica"]) == 6  # the warm-up's 3 are not counted
    assert sum(rows["precise"]["predictions"].values()) == 6
    assert sum(rows["precise"]["warmup_decisions"].values()) == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
