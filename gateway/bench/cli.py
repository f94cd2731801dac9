"""``prefixgate bench serve`` (load generator) and ``prefixgate bench compare`` (baselines).

``gateway/cli.py`` calls :func:`add_bench_parser`; each sub-command sets ``func`` to a
callable ``(args) -> exit code``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from prefixgate.gateway.bench.workload import (
    WorkloadConfig,
    load_workload,
    parse_output_len_dist,
)


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


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` with its ``serve`` and ``compare`` sub-commands to ``subparsers``."""
    bench = subparsers.add_parser(
        "bench", help="benchmark a server, or compare prefixgate with baselines"
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="{serve,compare}")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    serve = sub.add_parser(
        "serve",
        help="load-test one OpenAI-compatible server",
        description="Send a workload of streaming chat completions to --base-url and report TTFT, "
        "TPOT, ITL, E2E latency, throughput, cached-token share and errors.",
    )
    serve.add_argument(
        "--base-url", required=True, help="server root URL, e.g. http://127.0.0.1:8000"
    )
    serve.add_argument(
        "--model", default=None, help="model name (default: the first of GET /v1/models)"
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PREFIXGATE_API_KEY"),
        help="bearer key (default $PREFIXGATE_API_KEY)",
    )
    add_workload_args(serve, num_requests=64, output_len="64")
    serve.set_defaults(func=run_serve)

    from prefixgate.gateway.bench.compare import (
        COMPARE_DEFAULTS,
        COMPARE_OUTPUT_LEN,
        add_compare_args,
        run_compare,
    )

    compare = sub.add_parser(
        "compare",
        help="the same workload on prefixgate and its baselines, one at a time",
        description="Run one workload against (a) prefixgate, (b) prefix caching off, (c) static "
        "batching, (d) Hugging Face transformers generate in static batches, (e) an optional "
        "--upstream server, each started on loopback in turn; report every figure and its ratio "
        "against (a).",
    )
    add_compare_args(compare)
    add_workload_args(
        compare, num_requests=COMPARE_DEFAULTS["num_requests"], output_len=COMPARE_OUTPUT_LEN
    )
    compare.set_defaults(func=run_compare, **COMPARE_DEFAULTS)
    return bench


def run_serve(args: argparse.Namespace) -> int:
    """``bench serve``: run the load, print the table, write JSON/plot; exit 0 unless all failed."""
    from prefixgate.gateway.bench.loadgen import LoadConfig, run_load
    from prefixgate.gateway.bench.stats import print_table, summary_rows

    try:
        wl = workload_from_args(args)
        requests = load_workload(wl, args.system_prompts, args.user_tasks)
        cfg = LoadConfig(
            base_url=args.base_url,
            model=args.model,
            api_key=args.api_key,
            rate=args.rate,
            concurrency=args.concurrency,
            seed=args.seed,
            timeout_s=args.timeout,
            progress=not args.no_progress,
        )
    except (ValueError, OSError) as exc:
        print(f"prefixgate bench serve: {exc}", file=sys.stderr)
        return 2
    from prefixgate.sdk import APIError

    try:
        result = asyncio.run(run_load(requests, cfg))
    except (APIError, ValueError) as exc:  # e.g. the server is down while listing its models
        print(f"prefixgate bench serve: {args.base_url}: {exc}", file=sys.stderr)
        return 1
    summary = result.summary()
    load = f"rate {args.rate} req/s" if args.rate else "all at once"
    if args.concurrency:
        load += f", concurrency {args.concurrency}"
    print_table(
        f"{args.base_url} · {result.model} · {len(requests)} requests · {load}",
        ["metric", "value"],
        summary_rows(summary),
    )
    if args.json:
        doc = {
            "base_url": args.base_url,
            "model": result.model,
            "load": {
                "rate": args.rate,
                "concurrency": args.concurrency,
                "num_requests": len(requests),
            },
            "workload": _workload_doc(wl, args),
            "summary": summary,
            "requests": [r.to_dict() for r in result.results],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.plot:
        from prefixgate.gateway.bench.plot import plot_run

        plot_run(result.results, args.plot, title=f"bench serve: {args.base_url}")
    return 0 if summary["completed"] else 1


def _workload_doc(wl: WorkloadConfig, args: argparse.Namespace) -> dict:
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
