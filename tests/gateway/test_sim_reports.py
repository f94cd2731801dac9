"""``prefixgate sim`` gives, byte for byte, the JSON reports it gave before: five small runs
(each routing policy, the fair and fcfs orders, budgets on and off, overload with 429s, a
bursty arrival process, step by step, the capacity measured) against reports kept in
``tests/fixtures/sim_reports``. A speed-up of the simulator or of the engine code it runs
must leave them unchanged; a change meant to move the figures rewrites them with
``PREFIXGATE_WRITE_SIM_REPORTS=1`` and says why in its commit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prefixgate.gateway.cli import main

REPORTS = Path(__file__).resolve().parents[1] / "fixtures" / "sim_reports"

_SMALL = (
    "--replicas 2 --gateways 2 --tenants 8 --duration-s 6 --kv-blocks 300 --capacity-rps 4 "
    "--system-prompt-tokens 256 --output-tokens 16 --think-s 0.5"
)
RUNS = {
    "precise_fair": f"{_SMALL} --seed 0",
    "cache_aware_fcfs_bursty_overload": f"{_SMALL} --routing cache_aware "
    "--scheduling-policy fcfs --arrivals bursty --load 3 --ttft-budget-s 0.5 --seed 1",
    "round_robin_step_by_step_no_budget": f"{_SMALL} --routing round_robin --step-by-step "
    "--ttft-budget-s 0 --load 1.5 --seed 2",
    "least_loaded_capacity_measured": "--replicas 2 --gateways 1 --tenants 6 --duration-s 4 "
    "--kv-blocks 200 --max-num-seqs 4 --system-prompt-tokens 128 --output-tokens 8 "
    "--routing least_loaded --flood-factor 3 --seed 3",
    "rendezvous_queue_bound": f"{_SMALL} --replicas 3 --gateways 3 --routing rendezvous "
    "--max-queued-requests 4 --load 4 --seed 4",
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_sim_report_is_the_kept_one_byte_for_byte(name, tmp_path, capsys):
    out = tmp_path / f"{name}.json"
    assert main(["sim", *RUNS[name].split(), "--json", str(out)]) == 0
    capsys.readouterr()
    kept = REPORTS / f"{name}.json"
    if os.environ.get("PREFIXGATE_WRITE_SIM_REPORTS") == "1":
        kept.write_text(out.read_text())
    assert out.read_text() == kept.read_text()
