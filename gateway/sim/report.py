"""What a ``prefixgate sim`` run measured: the JSON report (``summarize``) and its plot.

Definitions (virtual seconds; "admitted try": the try of a request its replica admitted):

- ``ttft_s``: first token - the admitted try's arrival (what a TTFT budget covers);
  ``ttft_with_retries_s``: first token - the request's first arrival (429 waits included);
  ``tpot_s``: (last token - first token) / (output tokens - 1). Percentiles p50/p90/p99.
- ``hit_rate``: prompt tokens served from a prefix cache over prompt tokens, answered requests;
  ``one_replica_hit_rate``: the same requests, in admission order, on one replica holding
  every block ever computed (``fleet.one_replica_hit_rate``); ``hit_rate_vs_one_replica``:
  their ratio. ``gateways_hit_rate_diff``: the largest minus the smallest gateway's hit rate
  (requests by the gateway of their admitted try).
- ``max_over_mean_load``: the most answered requests a replica admitted while the arrivals
  ran (admitted try before ``duration_s``) over the mean per replica; the drain after them
  is left out: only sessions' later turns arrive then, at a fraction of the run's load, and
  they go where their history is cached. ``max_over_mean_load_with_drain``: the same of
  every answered request; ``max_over_mean_busy``: the same of modelled busy seconds, drain
  included.
- ``ra_p90_rel_error``: per 429 of a request later admitted, ``|actual - stated| / stated``
  with stated = its Retry-After and actual = admission time - refusal time; the 90th
  percentile (None without such refusals).
- ``requests.retrying_at_end``: requests refused and told to come back after the run's end
  (its drain included): never admitted, so in no other figure but ``sent``, ``tries`` and
  ``refusals``.
- ``budgets_met``: answered requests of tries admitted before the end of the arrivals whose
  TTFT was within their budget, over those requests; ``goodput``: the same over every
  admitted request of the whole run (a request admitted but never answered counts as missed).
- ``light_tenant_ttft_over_solo``: the light tenant's p50 TTFT during the heavy tenant's
  flood (the middle third of the run) over its p50 TTFT in a run with its requests alone;
  ``light_tenant_samples``: how many requests each of the two medians is of (``--light-rate``
  sets them: at the default 0.5/s a 5 s run has one or two in the flood).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from prefixgate.gateway.sim.fleet import Fleet, SimRequest, one_replica_hit_rate
from prefixgate.gateway.sim.workload import HEAVY_TENANT, LIGHT_TENANT


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """``{"p50", "p90", "p99"}`` of ``values`` (None each when empty)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    q = np.quantile(np.asarray(values, dtype=np.float64), [0.5, 0.9, 0.99])
    return {"p50": _r(q[0]), "p90": _r(q[1]), "p99": _r(q[2])}


def _r(x: float | None, digits: int = 6) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), digits)


def _hit_rate(reqs: Sequence[SimRequest]) -> float | None:
    total = sum(r.prompt_len for r in reqs)
    return sum(r.num_cached for r in reqs) / total if total else None


def _ttft(r: SimRequest) -> float:
    assert r.t_first is not None
    return r.t_first - r.t_try


def summarize(
    fleet: Fleet,
    solo: Fleet | None = None,
    capacity_rps: float | None = None,
    rate_rps: float | None = None,
    load: float | None = None,
) -> dict[str, Any]:
    """The report of a finished run (``solo``: the light tenant's run alone, if made)."""
    answered = [r for r in fleet.done if r.t_first is not None]
    admitted_all = answered + [
        r for rep in fleet.replicas for r in rep.requests.values()
    ]  # still in flight at the end: admitted, never answered
    ttft = [_ttft(r) for r in answered]
    ttft_retry = [r.t_first - r.arrival for r in answered if r.t_first is not None]
    tpot = [
        (r.t_done - r.t_first) / (r.output_len - 1)
        for r in answered
        if r.t_done is not None and r.t_first is not None and r.output_len > 1
    ]
    hit = _hit_rate(answered)
    ideal = one_replica_hit_rate(answered, fleet.config.block_size)
    by_gw: dict[int, list[SimRequest]] = {}
    for r in answered:
        by_gw.setdefault(r.gw.index if r.gw is not None else -1, []).append(r)
    gw_hits = {g: _hit_rate(rs) for g, rs in sorted(by_gw.items())}
    known = [h for h in gw_hits.values() if h is not None]
    served = [rep.served for rep in fleet.replicas]
    during = [0] * len(fleet.replicas)
    for r in answered:
        if r.t_admitted is not None and r.t_admitted < fleet.duration_s:
            during[r.replica] += 1
    busy = [rep.busy_s for rep in fleet.replicas]
    errors = []
    for r in fleet.done:
        if r.t_admitted is None:
            continue
        for t, ra in r.refusals:
            errors.append(abs((r.t_admitted - t) - ra) / ra)
    budgeted = [r for r in answered if r.budget_s is not None and r.t_try < fleet.duration_s]
    met = [r for r in budgeted if _ttft(r) <= r.budget_s]  # type: ignore[operator]
    with_budget = [r for r in admitted_all if r.budget_s is not None]
    good = [r for r in with_budget if r.t_first is not None and _ttft(r) <= r.budget_s]  # type: ignore[operator]
    third = fleet.duration_s / 3
    light_flood = [
        _ttft(r) for r in answered if r.tenant == LIGHT_TENANT and third <= r.t_try < 2 * third
    ]
    light_solo = (
        [_ttft(r) for r in solo.done if r.tenant == LIGHT_TENANT and r.t_first is not None]
        if solo is not None
        else []
    )
    ratio = None
    if light_flood and light_solo:
        ratio = float(np.median(light_flood)) / float(np.median(light_solo))
    retrying = list(fleet.retrying.values())
    sent = len(fleet.done) + len(fleet.refused) + len(admitted_all) - len(answered) + len(retrying)
    tries = sum(r.attempts for r in (*fleet.done, *fleet.refused, *retrying))
    return {
        "config": {
            "replicas": fleet.config.replicas,
            "gateways": fleet.config.gateways,
            "tenants": fleet.workload.config.tenants,
            "routing": fleet.config.routing,
            "profile": fleet.config.profile,
            "kv_blocks_per_replica": fleet.replicas[0].engine.num_kv_blocks,
            "load": load,
            "duration_s": fleet.duration_s,
            "seed": fleet.seed,
            "arrivals": fleet.workload.config.arrivals,
            "ttft_budget_s": fleet.workload.config.ttft_budget_s or None,
        },
        "capacity_rps": _r(capacity_rps),
        "rate_rps": _r(rate_rps),
        "requests": {
            "answered": len(answered),
            "given_up": len(fleet.refused),
            "unanswered_admitted": len(admitted_all) - len(answered),
            "retrying_at_end": len(retrying),
            "sent": sent,
            "tries": tries,
            "refusals": sum(len(r.refusals) for r in (*fleet.done, *fleet.refused, *retrying)),
            "heavy_answered": sum(1 for r in answered if r.tenant == HEAVY_TENANT),
            "light_answered": sum(1 for r in answered if r.tenant == LIGHT_TENANT),
        },
        "hit_rate": _r(hit),
        "one_replica_hit_rate": _r(ideal),
        "hit_rate_vs_one_replica": _r(hit / ideal) if hit is not None and ideal else None,
        "gateway_hit_rates": {str(g): _r(h) for g, h in gw_hits.items()},
        "gateways_hit_rate_diff": _r(max(known) - min(known)) if len(known) > 1 else None,
        "max_over_mean_load": _r(max(during) / float(np.mean(during))) if sum(during) else None,
        "max_over_mean_load_with_drain": (
            _r(max(served) / float(np.mean(served))) if sum(served) else None
        ),
        "max_over_mean_busy": _r(max(busy) / float(np.mean(busy))) if sum(busy) else None,
        "ra_p90_rel_error": _r(float(np.quantile(errors, 0.9))) if errors else None,
        "budgets_met": _r(len(met) / len(budgeted)) if budgeted else None,
        "goodput": _r(len(good) / len(with_budget)) if with_budget else None,
        "light_tenant_ttft_over_solo": _r(ratio),
        "light_tenant_ttft_p50_flood_s": _r(float(np.median(light_flood))) if light_flood else None,
        "light_tenant_ttft_p50_solo_s": _r(float(np.median(light_solo))) if light_solo else None,
        "light_tenant_samples": {"flood": len(light_flood), "solo": len(light_solo)},
        "ttft_s": percentiles(ttft),
        "ttft_with_retries_s": percentiles(ttft_retry),
        "tpot_s": percentiles(tpot),
        "engine_steps": fleet.steps,
    }


def plot(fleet: Fleet, path: str) -> None:
    """TTFT over time by tenant kind (arrivals to ``duration_s``, then the drain shaded: later
    turns of sessions started before it, and retries), and requests answered per replica, as
    a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    answered = [r for r in fleet.done if r.t_first is not None]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7))
    for label, pick, color in (
        ("base tenants", lambda r: r.tenant not in (LIGHT_TENANT, HEAVY_TENANT), "tab:gray"),
        ("heavy tenant (flood)", lambda r: r.tenant == HEAVY_TENANT, "tab:red"),
        ("light tenant", lambda r: r.tenant == LIGHT_TENANT, "tab:blue"),
    ):
        rs = [r for r in answered if pick(r)]
        if rs:
            ax1.scatter(
                [r.t_try for r in rs], [_ttft(r) for r in rs], s=3, label=label, color=color
            )
    for r in fleet.done + fleet.refused:
        for t, _ in r.refusals[:1]:
            ax1.axvline(t, color="tab:orange", alpha=0.01)
    third = fleet.duration_s / 3
    ax1.axvspan(third, 2 * third, color="tab:red", alpha=0.05)
    # sessions start before duration_s; their later turns and retries arrive in the drain
    ax1.axvline(fleet.duration_s, color="black", linestyle="--", linewidth=0.8)
    ax1.axvspan(
        fleet.duration_s,
        max([fleet.duration_s, *(r.t_try for r in answered)]),
        color="tab:gray",
        alpha=0.08,
        label="drain: later turns of sessions started before --duration-s, and retries",
    )
    ax1.set_yscale("log")
    ax1.set_xlabel(
        f"arrival of the request's last try (virtual s); sessions start until "
        f"{fleet.duration_s:g} s (--duration-s)"
    )
    ax1.set_ylabel("TTFT (s)")
    ax1.set_title(
        f"{fleet.config.replicas} replicas x {fleet.config.gateways} gateways, "
        f"{fleet.workload.config.tenants} tenants, routing {fleet.config.routing}"
    )
    ax1.legend(markerscale=4, fontsize=8)
    ax2.bar(range(len(fleet.replicas)), [rep.served for rep in fleet.replicas])
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))  # replica numbers, not 0.25 steps
    ax2.set_xlabel("replica")
    ax2.set_ylabel("requests answered")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
