"""Workload and load-shape options shared by ``bench serve`` and ``bench compare``."""

from __future__ import annotations

import argparse
import os

from prefixgate.sdk.bench.loadgen import LoadConfig
from prefixgate.sdk.bench.workload import WorkloadConfig, parse_output_len_dist


def add_api_key_arg(p: argparse.ArgumentParser, help: str) -> None:
    """``--api-key``: the bearer key, by default ``$PREFIXGATE_API_KEY`` (read when the parser
    is built)."""
    p.add_argument("--api-key", default=os.environ.get("PREFIXGATE_API_KEY"), help=help)


def add_workload_args(p: argparse.ArgumentParser, *, num_requests: int, output_len: str) -> None:
    """The workload and load-shape options shared by ``serve`` and ``compare``."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--system-prompts",
        metavar="CSV",
        help="system prompts CSV (act,prompt); default: the shipped sample (compare: ../shared/workloads when present)",
    )
    g.add_argument(
        "--user-tasks",
        metavar="JSONL",
        help="user tasks JSONL (instruction, instances); default: the shipped sample (compare: ../shared/workloads when present)",
    )
    g.add_argument(
        "--num-requests",
        type=int,
        default=num_requests,
        help=f"requests to send (default {num_requests})",
    )
    g.add_argument(
        "--num-system-prompts",
        type=int,
        default=1,
        help="S distinct system prompts, each shared by num_requests/S users (default 1)",
    )
    g.add_argument(
        "--system-prompt-min-chars",
        type=int,
        default=0,
        help="draw only system prompts at least this long",
    )
    g.add_argument(
        "--system-prompt-max-chars",
        type=int,
        default=None,
        help="draw only system prompts at most this long",
    )
    g.add_argument(
        "--user-task-max-chars",
        type=int,
        default=None,
        help="draw only user tasks at most this long",
    )
    out = g.add_mutually_exclusive_group()
    out.add_argument("--output-len", type=int, help="fixed output length in tokens (max_tokens)")
    out.add_argument(
        "--output-len-dist",
        default=None,
        help=f"output lengths: L, fixed:L, uniform:LO:HI or choice:A,B,... (default {output_len})",
    )
    p.set_defaults(_default_output_len=output_len)
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the workload and of Poisson arrivals"
    )
    lg = p.add_argument_group("load")
    lg.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson arrival rate, requests/s (default: all at once)",
    )
    lg.add_argument(
        "--concurrency", type=int, default=None, help="most requests in flight (closed loop)"
    )
    lg.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    lg.add_argument("--no-progress", action="store_true", help="no progress bar")
    g2 = p.add_argument_group("results")
    g2.add_argument("--json", metavar="OUT", help="write the results as JSON")
    g2.add_argument("--plot", metavar="OUT.png", help="write a PNG plot (matplotlib)")


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    """A :class:`WorkloadConfig` from parsed options (raises ValueError on bad values)."""
    if args.output_len is not None:
        dist = parse_output_len_dist(str(args.output_len))
    else:
        dist = parse_output_len_dist(args.output_len_dist or args._default_output_len)
    return WorkloadConfig(
        num_requests=args.num_requests,
        num_system_prompts=args.num_system_prompts,
        system_prompt_min_chars=args.system_prompt_min_chars,
        system_prompt_max_chars=args.system_prompt_max_chars,
        user_task_max_chars=args.user_task_max_chars,
        output_len=dist,
        seed=args.seed,
    )


def load_from_args(args: argparse.Namespace, base_url: str, model: str | None) -> LoadConfig:
    """The load shape of ``--rate``, ``--concurrency``, ``--seed``, ``--timeout``,
    ``--no-progress`` and ``--api-key``, sent to ``base_url`` for ``model``.

    Raises:
        ValueError: a bad rate, concurrency or timeout (``LoadConfig``'s checks).
    """
    return LoadConfig(
        base_url=base_url,
        model=model,
        api_key=args.api_key,
        rate=args.rate,
        concurrency=args.concurrency,
        seed=args.seed,
        timeout_s=args.timeout,
        progress=not args.no_progress,
    )


def workload_doc(wl: WorkloadConfig, args: argparse.Namespace) -> dict:
    """The workload as recorded in the JSON results (sources, sizes, output lengths, seed)."""
    return {
        "system_prompts": args.system_prompts or "sample",
        "user_tasks": args.user_tasks or "sample",
        "num_requests": wl.num_requests,
        "num_system_prompts": wl.num_system_prompts,
        "system_prompt_min_chars": wl.system_prompt_min_chars,
        "system_prompt_max_chars": wl.system_prompt_max_chars,
        "user_task_max_chars": wl.user_task_max_chars,
        "output_len": {"kind": wl.output_len.kind, "values": list(wl.output_len.values)},
        "seed": wl.seed,
    }
