"""``prefixgate bench compare``: one workload, side by side, on prefixgate and its baselines.

Targets, each started as a real server on a free loopback port and benchmarked one at a time
(so they never compete for the CPU), then stopped:

* (a) ``prefixgate``: continuous batching + prefix caching (the defaults);
* (b) ``no-prefix-cache``: the same with prefix caching off;
* (c) ``static-batching``: the same with ``scheduling="static"`` (a new batch only when the
  running one has drained);
* (d) ``hf-transformers``: transformers ``generate`` in static batches behind a minimal
  OpenAI-compatible server (:mod:`prefixgate.engine.hf_server`);
* (e) ``upstream``: an already running server given by ``--upstream URL`` (optional).

Each target gets the same warm-up (two short requests that share no block with the workload)
and then the same workload; every figure is also reported as a ratio against (a).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prefixgate.sdk.bench.args import (
    add_api_key_arg,
    load_from_args,
    workload_doc,
    workload_from_args,
)
from prefixgate.sdk.bench.loadgen import LoadConfig, run_load
from prefixgate.sdk.bench.output_file import check_output_file
from prefixgate.sdk.bench.report import checks, machine, print_compare, ratios, title
from prefixgate.sdk.bench.targets import (
    ServerProcess,
    Target,
    build_targets,
    default_model,
    find_shared,
)
from prefixgate.sdk.bench.workload import BenchRequest, load_workload

# The compare demonstration on a 2-core CPU with the SmolLM2-135M-shaped dummy model, sized so
# one run of the four targets takes minutes: 40 requests from 32 concurrent users (a second
# wave of 8 arrives as the first finish: what continuous batching is for), one system prompt
# of 710-760 characters (716-720 in the full CSV) with user tasks of at most 65 characters (43
# distinct in the full JSONL), so the system prompt's own tokens are 90 % of the prompt tokens
# (92 % counting the chat template's shared lead); short answers of 4-24 tokens.
COMPARE_DEFAULTS = {
    "num_requests": 40,
    "system_prompt_min_chars": 710,
    "system_prompt_max_chars": 760,
    "user_task_max_chars": 65,
    "seed": 1,
}
COMPARE_OUTPUT_LEN = "uniform:4:24"


WARMUP = [
    BenchRequest(-1, [{"role": "user", "content": "Hello there."}], 4),
    BenchRequest(-2, [{"role": "user", "content": "Say something."}], 4),
]


async def bench_target(
    target: Target, requests: list[BenchRequest], args: argparse.Namespace, log_dir: Path
) -> dict:
    """Start ``target`` (unless external), warm it up, run the workload, stop it.

    Returns ``{"target", "label", "description", "summary", "requests", "model", "command",
    "log"}`` or, when the server failed, ``{..., "error": text}``.
    """
    info: dict = {"target": target.key, "label": target.label, "description": target.description}
    if target.note:
        info["note"] = target.note
    server = None
    try:
        if target.command is not None:
            server = ServerProcess(
                target.command, log_dir / f"{target.key}-{target.label}.log", target.env
            )
            info["command"] = shlex.join(server.command)
            info["log"] = str(server.log_path)
            print(f"[{target.key}] {target.label}: starting {info['command']}", file=sys.stderr)
            await server.start(args.startup_timeout)
            target.base_url = server.base_url
        cfg = load_from_args(args, target.base_url or "", target.model)
        warm = LoadConfig(
            base_url=cfg.base_url,
            model=cfg.model,
            api_key=cfg.api_key,
            timeout_s=cfg.timeout_s,
            progress=False,
        )
        await run_load(WARMUP, warm)
        print(f"[{target.key}] {target.label}: {len(requests)} requests", file=sys.stderr)
        result = await run_load(requests, cfg)
        info.update(
            model=result.model,
            summary=result.summary(),
            requests=[r.to_dict() for r in result.results],
        )
        info["server_metrics"] = await scrape_metrics(cfg.base_url)
    except Exception as exc:  # one target failing must not lose the others' results
        info["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{target.key}] {target.label}: FAILED {info['error'][:500]}", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
    return info


SCRAPED = (
    "prefixgate_engine_preemptions",
    "prefixgate_prefix_cache_hits_tokens",
    "prefixgate_prefix_cache_queries_tokens",
    "prefixgate_kv_blocks_total",
)


async def scrape_metrics(base_url: str) -> dict[str, float]:
    """A few engine gauges from the server's ``GET /metrics`` (Prometheus text), after a run.

    Returns ``{}`` for a server without that route (the baselines) or on any error.
    """
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        from prometheus_client.parser import text_string_to_metric_families

        async with httpx.AsyncClient(timeout=10.0) as http:
            r = await http.get(url)
        if r.status_code != 200:
            return {}
        return {
            s.name: s.value
            for fam in text_string_to_metric_families(r.text)
            for s in fam.samples
            if s.name in SCRAPED
        }
    except Exception:  # metrics are a bonus: never fail a run over them
        return {}


def shared_prefix_share(model: str | None, requests: list[BenchRequest]) -> dict | None:
    """How much of the workload's prompt tokens can be shared, with ``model``'s tokenizer and
    chat template (transformers).

    Returns ``{"prompt_tokens", "mean_prompt_tokens", "shared_prefix_tokens", "share"}`` (tokens
    of each prompt's longest prefix common with another request of the same system prompt: the
    dedup potential, chat-template lead included) and ``{"system_prompt_tokens",
    "system_prompt_share"}`` (the system prompts' own tokens), or ``None`` when the tokenizer
    cannot be loaded."""
    if not model:
        return None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        ids, system_tokens = [], 0
        for r in requests:
            text = tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
            ids.append(tok(text, add_special_tokens=False)["input_ids"])
            system = "".join(m["content"] for m in r.messages if m["role"] == "system")
            system_tokens += (
                len(tok(system, add_special_tokens=False)["input_ids"]) if system else 0
            )
    except Exception:
        return None
    shared = 0
    for i, a in enumerate(ids):
        best = 0
        for j, b in enumerate(ids):
            if i == j or requests[i].system_prompt != requests[j].system_prompt:
                continue
            n = 0
            for x, y in zip(a, b, strict=False):
                if x != y:
                    break
                n += 1
            best = max(best, n)
            break  # the same system prompt gives the same shared run
        shared += best
    total = sum(len(x) for x in ids)
    return {
        "prompt_tokens": total,
        "shared_prefix_tokens": shared,
        "share": shared / total if total else None,
        "mean_prompt_tokens": total / len(ids),
        "system_prompt_tokens": system_tokens,
        "system_prompt_share": system_tokens / total if total else None,
    }


def add_compare_args(p: argparse.ArgumentParser) -> None:
    """Options of ``bench compare`` (the workload options are added by the caller)."""
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory (default: ../shared/models/smollm2-135m-shape with dummy weights, if present)",
    )
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default=None,
        help="default: dummy when the directory has no weights",
    )
    p.add_argument(
        "--targets",
        default="a,b,c,d",
        help="which of a,b,c,d,e to run, in order (default a,b,c,d; e is added by --upstream)",
    )
    p.add_argument(
        "--upstream",
        default=None,
        metavar="URL",
        help="(e): also benchmark this running OpenAI-compatible server",
    )
    p.add_argument(
        "--upstream-model",
        default=None,
        help="model name for --upstream (default: its first listed)",
    )
    add_api_key_arg(p, "bearer key sent to every target")
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=1536 * 1024**2,
        help="KV cache bytes of each prefixgate target (default 1.5 GiB)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="prefixgate's running-batch bound (default 64)"
    )
    p.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="(d)'s static batch size (default: --concurrency, else 32)",
    )
    p.add_argument(
        "--serve-args",
        default=None,
        help="extra options for every `prefixgate serve`, one shell-quoted string",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="token budget per engine step of every prefixgate target (default 512, the "
        "latency-oriented chunked-prefill budget vLLM V0 used for online serving; the engine's "
        "own default is 2048)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads of every server started (OMP_NUM_THREADS; default: torch's)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for each server to be ready",
    )
    p.add_argument(
        "--log-dir", default=None, help="where the servers' logs go (default: a temporary folder)"
    )
    p.set_defaults(concurrency_default=32)


def run_compare(args: argparse.Namespace) -> int:
    """``bench compare``: run every target in turn; print, write JSON and plot; exit 0 unless all failed."""
    if args.concurrency is None and args.rate is None:
        args.concurrency = args.concurrency_default
    if args.model is None:
        args.model = default_model()
    if args.system_prompts is None and args.user_tasks is None:
        csv_path, jsonl_path = (
            find_shared("workloads/system_prompts.csv"),
            find_shared("workloads/user_tasks.jsonl"),
        )
        if csv_path and jsonl_path:  # the full real files; else the shipped sample
            args.system_prompts, args.user_tasks = str(csv_path), str(jsonl_path)
    try:
        wl = workload_from_args(args)
        requests = load_workload(wl, args.system_prompts, args.user_tasks)
        targets = build_targets(args)
        check_output_file("--json", args.json)  # written after every target ran
        check_output_file("--plot", args.plot)
    except (ValueError, OSError) as exc:
        print(f"prefixgate bench compare: {exc}", file=sys.stderr)
        return 2
    if not targets:
        print("prefixgate bench compare: no target to run", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="prefixgate-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    share = shared_prefix_share(args.model, requests)
    t0 = time.perf_counter()
    runs = [asyncio.run(bench_target(t, requests, args, log_dir)) for t in targets]
    wall = time.perf_counter() - t0
    ok = {f"({r['target']}) {r['label']}": r["summary"] for r in runs if "summary" in r}
    by_key = {r["target"]: r["summary"] for r in runs if "summary" in r}
    doc = {
        "model": args.model or "built-in preset",
        "load": {"rate": args.rate, "concurrency": args.concurrency, "num_requests": len(requests)},
        "threads": args.threads,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "workload": workload_doc(wl, args),
        "shared_prefix": share,
        "machine": machine(),
        "wall_s": wall,
        "targets": runs,
        "ratios_vs_a": ratios(ok) if ok else {},
        "checks": checks(by_key),
    }
    print_compare(doc, ok)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.plot and ok:
        from prefixgate.sdk.bench.plot import plot_compare

        plot_compare(ok, args.plot, title=title(doc))
    return 0 if ok else 1
