"""``prefixgate sim``: flags, the run (capacity, the fleet, the light tenant alone), the report.

    prefixgate sim --replicas 8 --gateways 2 --tenants 1000 --routing precise --load 0.8 \\
        --duration-s 120 --seed 0 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

SIM_HELP = "simulate a fleet of gateways and replicas on a virtual clock (docs/sim.md)"
SIM_DESCRIPTION = (
    "Runs prefixgate's own scheduler, KV cache, prefix cache, admission and routing policies "
    "for G gateways x R replicas x T tenants on a virtual clock: each engine step costs what "
    "the --profile's cost model says, no model is computed. Prints (and --json writes) the "
    "fleet's prefix hit rate against one replica holding everything, the hottest replica's "
    "load over the mean, the two gateways' hit-rate difference, Retry-After's p90 error "
    "against the actual wait, the TTFT budgets met, goodput, a light tenant's TTFT in a heavy "
    "tenant's flood over its TTFT alone, TTFT/TPOT percentiles. Every time is in virtual "
    "seconds of the profile, not this machine's (docs/sim.md)."
)


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, except ``None`` (an option unset by default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_sim_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``sim`` sub-command's parser (``prefixgate sim --help``)."""
    from prefixgate.gateway.proxy.policies import POLICIES

    p = sub.add_parser(
        "sim",
        help=SIM_HELP,
        description=SIM_DESCRIPTION,
        formatter_class=_Defaults,
    )
    p.add_argument("--replicas", type=int, default=4, help="replicas")
    p.add_argument("--gateways", type=int, default=2, help="gateways")
    p.add_argument("--tenants", type=int, default=100, help="base tenants")
    p.add_argument(
        "--routing", choices=POLICIES, default="precise", help="routing policy of every gateway"
    )
    p.add_argument(
        "--load",
        type=float,
        default=0.8,
        help="base arrival rate as a multiple of the measured capacity",
    )
    p.add_argument(
        "--duration-s", type=float, default=60.0, help="arrivals for this long, virtual seconds"
    )
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (same seed, same JSON)")
    p.add_argument("--json", dest="json_out", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (matplotlib)")
    p.add_argument(
        "--profile",
        default="h100-llama3-8b",
        help="cost profile: a name or a profile JSON file (prefixgate.engine.sim_fit)",
    )
    p.add_argument(
        "--kv-blocks", type=int, default=None, help="KV blocks per replica (default: the profile's)"
    )
    p.add_argument("--max-num-seqs", type=int, default=128, help="engine max_num_seqs per replica")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="engine max_num_batched_tokens per replica",
    )
    p.add_argument("--max-queued-requests", type=int, default=256, help="admission bound")
    p.add_argument(
        "--scheduling-policy", choices=("fcfs", "fair"), default="fair", help="engine policy"
    )
    p.add_argument(
        "--arrivals", choices=("poisson", "bursty"), default="poisson", help="arrival process"
    )
    p.add_argument(
        "--system-prompt-tokens", type=int, default=1024, help="each tenant's system prompt"
    )
    p.add_argument("--user-tokens", type=int, default=128, help="each turn's user message")
    p.add_argument("--output-tokens", type=int, default=128, help="each answer's length")
    p.add_argument("--mean-turns", type=float, default=3.0, help="turns per session (mean)")
    p.add_argument(
        "--think-s", type=float, default=5.0, help="a user's pause between turns, virtual s"
    )
    p.add_argument(
        "--ttft-budget-s",
        type=float,
        default=2.0,
        help="each request's TTFT budget, virtual s (0: none)",
    )
    p.add_argument("--light-rate", type=float, default=0.5, help="light tenant requests/s")
    p.add_argument(
        "--flood-factor",
        type=float,
        default=1.0,
        help="heavy tenant's flood in the middle third, x the base rate (0: none)",
    )
    p.add_argument(
        "--capacity-rps",
        type=float,
        default=None,
        help="one replica's capacity (requests/s) instead of measuring it",
    )
    p.add_argument("--no-solo", action="store_true", help="skip the light tenant's solo run")
    p.add_argument(
        "--step-by-step",
        action="store_true",
        help="every engine step through LLMEngine.step (no pure-decode stretches at once)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``prefixgate sim``; prints the report (and the wall time) and writes ``--json``."""
    from prefixgate.gateway.sim.fleet import Fleet, FleetConfig, saturated_rate
    from prefixgate.gateway.sim.report import plot, summarize
    from prefixgate.gateway.sim.workload import LIGHT_TENANT, WorkloadConfig

    try:
        fc = FleetConfig(
            replicas=args.replicas,
            gateways=args.gateways,
            routing=args.routing,
            profile=args.profile,
            kv_blocks=args.kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            scheduling_policy=args.scheduling_policy,
            max_queued_requests=args.max_queued_requests,
        )
        wc = WorkloadConfig(
            tenants=args.tenants,
            system_prompt_tokens=args.system_prompt_tokens,
            user_tokens=args.user_tokens,
            output_tokens=args.output_tokens,
            mean_turns=args.mean_turns,
            think_s=args.think_s,
            arrivals=args.arrivals,
            ttft_budget_s=args.ttft_budget_s,
            light_rate=args.light_rate,
            flood_factor=args.flood_factor,
        )
        if not args.load > 0 or not args.duration_s > 0:
            raise ValueError("--load and --duration-s must be > 0")
        fc.engine_config(args.seed)  # the engine's own checks, before any work
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ValueError(
                    "--plot needs matplotlib: pip install 'prefixgate[bench]'"
                ) from None
    except (ValueError, TypeError) as exc:
        message = str(exc).replace("sim_profile", "--profile")  # the engine's field, the flag
        print(f"prefixgate sim: bad option: {message}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    capacity = args.capacity_rps or saturated_rate(fc, wc, args.seed, args.step_by_step)
    t_cap = time.perf_counter() - t0
    rate = args.load * capacity * args.replicas
    fleet = Fleet(fc, wc, rate, args.duration_s, args.seed, step_by_step=args.step_by_step).run()
    t_run = time.perf_counter() - t0 - t_cap
    solo = None
    if not args.no_solo and args.light_rate > 0:
        solo = Fleet(
            fc,
            wc,
            rate,
            args.duration_s,
            args.seed,
            only_tenants={LIGHT_TENANT},
            step_by_step=args.step_by_step,
        ).run()
    report = summarize(fleet, solo, capacity, rate, args.load)
    wall = time.perf_counter() - t0
    text = json.dumps(report, indent=2, sort_keys=True)
    print(text)
    print(
        f"wall: {wall:.1f} s (capacity {t_cap:.1f} s, fleet {t_run:.1f} s, "
        f"{fleet.steps} engine steps)",
        file=sys.stderr,
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    if args.plot:
        plot(fleet, args.plot)
    return 0
