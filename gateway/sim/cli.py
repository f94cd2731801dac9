"""``prefixgate sim``: flags, the run (capacity, the fleet, the light tenant alone), the report.

    prefixgate sim --replicas 8 --gateways 2 --tenants 1000 --routing precise --load 0.8 \\
        --duration-s 120 --seed 0 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from prefixgate.gateway.sim.fleet import FleetConfig
    from prefixgate.gateway.sim.workload import WorkloadConfig

T = TypeVar("T")

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
    for flag, kind, default, text in (
        ("--replicas", int, 4, "replicas"),
        ("--gateways", int, 2, "gateways"),
        ("--tenants", int, 100, "base tenants"),
        ("--routing", POLICIES, "precise", "routing policy of every gateway"),
        ("--load", float, 0.8, "base arrival rate as a multiple of the measured capacity"),
        (
            "--duration-s",
            float,
            60.0,
            "sessions start for this long, virtual seconds; their later turns and retries "
            "go on after it (the drain, at most 120 s more)",
        ),
        ("--seed", int, 0, "the workload's seed (same seed, same JSON)"),
        ("--json", str, None, "write the report here"),
        ("--plot", str, None, "write a PNG plot here (matplotlib)"),
        (
            "--profile",
            str,
            "h100-llama3-8b",
            "cost profile: a name or a profile JSON file (prefixgate.engine.sim_fit)",
        ),
        ("--kv-blocks", int, None, "KV blocks per replica (default: the profile's)"),
        ("--max-num-seqs", int, 128, "engine max_num_seqs per replica"),
        ("--max-num-batched-tokens", int, 2048, "engine max_num_batched_tokens per replica"),
        ("--max-queued-requests", int, 256, "admission bound"),
        ("--scheduling-policy", ("fcfs", "fair"), "fair", "engine policy"),
        ("--arrivals", ("poisson", "bursty"), "poisson", "arrival process"),
        ("--system-prompt-tokens", int, 1024, "each tenant's system prompt"),
        ("--user-tokens", int, 128, "each turn's user message"),
        ("--output-tokens", int, 128, "each answer's length"),
        ("--mean-turns", float, 3.0, "turns per session (mean)"),
        ("--think-s", float, 5.0, "a user's pause between turns, virtual s"),
        ("--ttft-budget-s", float, 2.0, "each request's TTFT budget, virtual s (0: none)"),
        ("--light-rate", float, 0.5, "light tenant requests/s"),
        (
            "--flood-factor",
            float,
            1.0,
            "heavy tenant's flood in the middle third, x the base rate (0: none)",
        ),
        (
            "--capacity-rps",
            float,
            None,
            "one replica's capacity (requests/s) instead of measuring it",
        ),
    ):
        # a tuple of names: the choices; else the type the value is read as
        how: dict[str, Any] = {"choices": kind} if isinstance(kind, tuple) else {"type": kind}
        p.add_argument(flag, default=default, help=text, **how)
    p.add_argument("--no-solo", action="store_true", help="skip the light tenant's solo run")
    p.add_argument(
        "--step-by-step",
        action="store_true",
        help="every engine step through LLMEngine.step (no pure-decode stretches at once)",
    )
    p.set_defaults(func=run)
    return p


UPPER_BOUNDS: dict[str, float] = {
    "--replicas": 1024,
    "--gateways": 256,
    "--tenants": 1_000_000,
    "--load": 100.0,
    "--duration-s": 86_400.0,
    "--kv-blocks": 10_000_000,
    "--max-num-seqs": 65_536,
    "--max-num-batched-tokens": 1_048_576,
    "--max-queued-requests": 10_000_000,
    "--system-prompt-tokens": 1_048_576,
    "--user-tokens": 1_048_576,
    "--output-tokens": 1_048_576,
    "--mean-turns": 1000.0,
    "--think-s": 86_400.0,
    "--ttft-budget-s": 86_400.0,
    "--light-rate": 10_000.0,
    "--flood-factor": 100.0,
    "--capacity-rps": 1_000_000.0,
}
"""The most each numeric flag takes: a run's wall time grows with the requests it simulates
(replicas x load x duration, 4-8 ms of CPU each, docs/sim.md) and with the replicas it builds,
so a value past these (``--replicas 100000``) ran for hours before printing anything."""


def check_upper_bounds(args: argparse.Namespace) -> None:
    """Refuse a flag above its :data:`UPPER_BOUNDS` entry, naming it.

    Raises:
        ValueError: the first flag over its bound.
    """
    for flag, most in UPPER_BOUNDS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and value > most:
            raise ValueError(
                f"{flag} must be <= {most:g}, got {value:g} (a run's time grows with it; "
                "docs/sim.md)"
            )


def _from_flags(config: type[T], args: argparse.Namespace) -> T:
    """``config`` (a dataclass) with each field a flag sets (``--max-num-seqs`` for
    ``max_num_seqs``) taken from ``args``, the others at their defaults."""
    names = [f.name for f in fields(config)]  # type: ignore[arg-type]  # a dataclass
    return config(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def _in_flag_words(message: str, names: Iterable[str]) -> str:
    """``message`` with the config fields among ``names`` named by their flags: a snake_case
    name anywhere (``light_rate`` → ``--light-rate``), a one-word name only where it leads the
    message (``replicas must be ...``); other words stay words (``profile``, ``json`` in a path)."""
    for name in names:
        flag = "--" + name.replace("_", "-")
        if "_" in name:
            message = re.sub(rf"(?<![-\w./]){name}\b", flag, message)
        elif re.match(rf"{name}\b", message):
            message = flag + message[len(name) :]
    return message


def run(args: argparse.Namespace) -> int:
    """Run ``prefixgate sim``; prints the report (and the wall time) and writes ``--json``."""
    from prefixgate.gateway.sim.fleet import FleetConfig, few_collections
    from prefixgate.gateway.sim.workload import WorkloadConfig
    from prefixgate.sdk.bench.output_file import check_output_file

    try:
        check_upper_bounds(args)
        fc = _from_flags(FleetConfig, args)
        wc = _from_flags(WorkloadConfig, args)
        for flag, value in (
            ("--load", args.load),
            ("--duration-s", args.duration_s),
            ("--capacity-rps", 1.0 if args.capacity_rps is None else args.capacity_rps),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{flag} must be a finite number > 0, got {value}")
        if args.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {args.seed}")
        fc.engine_config(args.seed)  # the engine's own checks, before any work
        fc.check_workload(wc)  # a first turn fits a replica's context
        check_output_file("--json", args.json)  # written at the end: a bad path lost the run
        check_output_file("--plot", args.plot)
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ValueError(
                    "--plot needs matplotlib: pip install 'prefixgate[bench]'"
                ) from None
    except (ValueError, TypeError) as exc:
        message = str(exc).replace("sim_profile", "--profile")  # the engine's field, the flag
        message = _in_flag_words(message, vars(args))
        print(f"prefixgate sim: bad option: {message}", file=sys.stderr)
        return 2
    with few_collections():
        return _run(args, fc, wc)


def _run(args: argparse.Namespace, fc: FleetConfig, wc: WorkloadConfig) -> int:
    """``run``'s work once the options are checked."""
    from prefixgate.gateway.sim.fleet import Fleet, saturated_rate
    from prefixgate.gateway.sim.report import plot, summarize
    from prefixgate.gateway.sim.workload import LIGHT_TENANT

    def progress(line: str) -> None:
        print(f"prefixgate sim: {line}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    if args.capacity_rps is None:
        progress("measuring one replica's capacity (40 virtual s; --capacity-rps skips it)")
    capacity = args.capacity_rps or saturated_rate(fc, wc, args.seed, args.step_by_step)
    t_cap = time.perf_counter() - t0
    rate = args.load * capacity * args.replicas
    progress(
        f"fleet: {args.replicas} replicas x {args.gateways} gateways at {rate:.1f} requests/s "
        f"for {args.duration_s:g} virtual s, then the drain"
    )
    fleet = Fleet(
        fc,
        wc,
        rate,
        args.duration_s,
        args.seed,
        step_by_step=args.step_by_step,
        progress=lambda line: progress("fleet " + line),
        keep_tokens=False,
    ).run()
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
            keep_tokens=False,
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
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.plot:
        plot(fleet, args.plot)
    return 0
