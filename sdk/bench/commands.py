"""``prefixgate bench serve`` (load generator) and ``prefixgate bench compare`` (baselines).

``prefixgate.gateway.cli`` calls :func:`add_bench_parser`; each sub-command sets ``func`` to a
callable ``(args) -> exit code``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from prefixgate.sdk.bench.args import (
    add_api_key_arg,
    add_workload_args,
    load_from_args,
    workload_doc,
    workload_from_args,
)
from prefixgate.sdk.bench.compare import (
    COMPARE_DEFAULTS,
    COMPARE_OUTPUT_LEN,
    add_compare_args,
    run_compare,
)
from prefixgate.sdk.bench.fit import FitResult, WorkloadDoesNotFitError, fit_to_context
from prefixgate.sdk.bench.loadgen import (
    LoadConfig,
    LoadResult,
    make_client,
    resolve_model,
    root_url,
    run_load,
)
from prefixgate.sdk.bench.output_file import check_output_file
from prefixgate.sdk.bench.workload import BenchRequest, load_workload


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
    add_api_key_arg(serve, "bearer key (default $PREFIXGATE_API_KEY)")
    serve.add_argument(
        "--no-fit",
        action="store_true",
        help="send the workload as it is; by default requests are fitted to the model's context "
        "(max_model_len of GET /v1/models, prompt tokens from POST /tokenize): a prompt that "
        "fills it is dropped, a max_tokens that overruns it is lowered, and the run is refused "
        "in one line when no prompt fits",
    )
    add_workload_args(serve, num_requests=64, output_len="64")
    serve.set_defaults(func=run_serve)

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
    from prefixgate.sdk.bench.stats import print_table, summary_rows

    try:
        wl = workload_from_args(args)
        requests = load_workload(wl, args.system_prompts, args.user_tasks)
        cfg = load_from_args(args, args.base_url, args.model)
        check_output_file("--json", args.json)  # written after the run: refused before it
        check_output_file("--plot", args.plot)
    except (ValueError, OSError) as exc:
        print(f"prefixgate bench serve: {exc}", file=sys.stderr)
        return 2
    from prefixgate.sdk import APIError

    try:
        fit, result = asyncio.run(_fit_and_run(requests, cfg, fit=not args.no_fit))
    except WorkloadDoesNotFitError as exc:
        print(f"prefixgate bench serve: {exc}", file=sys.stderr)
        return 2
    except (APIError, ValueError) as exc:  # e.g. the server is down while listing its models
        print(f"prefixgate bench serve: {args.base_url}: {exc}", file=sys.stderr)
        return 1
    requests = fit.requests
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
            "workload": workload_doc(wl, args),
            "fit": {
                "context": fit.context,
                "dropped": fit.dropped,
                "shortened": fit.shortened,
                "note": fit.note,
            },
            "summary": summary,
            "requests": [r.to_dict() for r in result.results],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.plot:
        from prefixgate.sdk.bench.plot import plot_run

        plot_run(result.results, args.plot, title=f"bench serve: {args.base_url}")
    return 0 if summary["completed"] else 1


async def _fit_and_run(
    requests: list[BenchRequest], cfg: LoadConfig, *, fit: bool
) -> tuple[FitResult, LoadResult]:
    """Resolve the model, fit ``requests`` to its context (unless ``fit`` is False), send them.

    Raises:
        WorkloadDoesNotFitError: no prompt fits (nothing was sent).
        prefixgate.sdk.APIError, ValueError: as :func:`run_load`.
    """
    client = make_client(cfg, max_concurrency=1)
    try:
        cfg.model = await resolve_model(client, cfg.model)
    finally:
        await client.close()
    if fit:
        fitted = await fit_to_context(
            requests, root_url(cfg.base_url), cfg.model, cfg.api_key, min(cfg.timeout_s, 60.0)
        )
    else:
        fitted = FitResult(list(requests), note=None)
    line = fitted.describe()
    if line:
        print(f"prefixgate bench serve: {line}", file=sys.stderr)
    return fitted, await run_load(fitted.requests, cfg)
