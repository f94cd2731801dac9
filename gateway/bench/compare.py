"""``prefixgate bench compare``: one workload, side by side, on prefixgate and its baselines.

Targets, each started as a real server on a free loopback port and benchmarked one at a time
(so they never compete for the CPU), then stopped:

* (a) ``prefixgate``: continuous batching + prefix caching (the defaults);
* (b) ``no-prefix-cache``: the same with prefix caching off;
* (c) ``static-batching``: the same with ``scheduling="static"`` (a new batch only when the
  running one has drained);
* (d) ``hf-transformers``: transformers ``generate`` in static batches behind a minimal
  OpenAI-compatible server (:mod:`prefixgate.gateway.bench.hf_server`);
* (e) ``upstream``: an already running server given by ``--upstream URL`` (optional).

Each target gets the same warm-up (two short requests that share no block with the workload)
and then the same workload; every figure is also reported as a ratio against (a).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prefixgate.gateway.bench.loadgen import LoadConfig, run_load
from prefixgate.gateway.bench.stats import HEADLINE, fmt, lookup, print_table
from prefixgate.gateway.bench.workload import BenchRequest, load_workload

TARGET_KEYS = ("a", "b", "c", "d", "e")
SMOLLM2_SHAPE = Path("models") / "smollm2-135m-shape"

# The issue-7 demonstration on a 2-core CPU with the SmolLM2-135M-shaped dummy model, sized so
# one run of the four targets takes minutes: 40 requests from 32 concurrent users (a second
# wave of 8 arrives as the first finish: what continuous batching is for), one system prompt
# of 540-760 characters (seed 1 draws the 557-character "Personal Trainer" from the full CSV)
# with user tasks of at most 65 characters (43 distinct in the full JSONL), so ~90 % of the
# prompt tokens are the shared system prompt; short answers of 4-24 tokens.
COMPARE_DEFAULTS = {
    "num_requests": 40,
    "system_prompt_min_chars": 540,
    "system_prompt_max_chars": 760,
    "user_task_max_chars": 65,
    "seed": 1,
}
COMPARE_OUTPUT_LEN = "uniform:4:24"


@dataclass(slots=True)
class Target:
    """One server to benchmark.

    Attributes:
        key: ``"a"`` .. ``"e"``.
        label: short name for tables and plots.
        description: what it is, one line.
        command: argv that serves on the port substituted for ``{port}``; ``None`` for an
            external server (``base_url`` then names it).
        base_url: set once the server runs (or given for an external one).
        model: model name to request (``None``: the server's first listed model).
    """

    key: str
    label: str
    description: str
    command: list[str] | None = None
    base_url: str | None = None
    model: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    note: str | None = None


def find_shared(rel: str | Path) -> Path | None:
    """``rel`` under the shared test-data folder, if present.

    Looked up under ``$PREFIXGATE_SHARED``, ``./shared``, ``../shared`` and the ``shared``
    folder beside the checkout this file lives in; ``None`` when absent.
    """
    roots = [os.environ.get("PREFIXGATE_SHARED")] if os.environ.get("PREFIXGATE_SHARED") else []
    roots += [
        Path.cwd() / "shared",
        Path.cwd().parent / "shared",
        Path(__file__).resolve().parents[3] / "shared",
    ]
    for root in roots:
        cand = Path(root) / rel
        if cand.exists():
            return cand
    return None


def default_model() -> str | None:
    """The SmolLM2-135M-shaped config (no weights: served with dummy weights), if present."""
    found = find_shared(SMOLLM2_SHAPE / "config.json")
    return str(found.parent) if found else None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound then released: the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_weights(model: str) -> bool:
    path = Path(model)
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def build_targets(args: argparse.Namespace) -> list[Target]:
    """The targets ``args.targets`` names, with their server commands."""
    py = sys.executable
    model = args.model
    load_format = args.load_format or ("auto" if model and _has_weights(model) else "dummy")
    engine = [
        "--kv-cache-memory",
        str(args.kv_cache_memory),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    if model:
        engine = ["--model", model, "--load-format", load_format, *engine]
    engine += shlex.split(args.serve_args or "")
    serve = [
        py,
        "-m",
        "prefixgate.gateway.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        *engine,
    ]
    all_targets = {
        "a": Target("a", "prefixgate", "continuous batching + prefix caching", serve),
        "b": Target(
            "b",
            "no-prefix-cache",
            "continuous batching, prefix caching off",
            [*serve, "--no-prefix-caching"],
        ),
        "c": Target(
            "c",
            "static-batching",
            "static batching (+ prefix caching)",
            [*serve, "--scheduling", "static"],
        ),
        "d": Target(
            "d",
            "hf-transformers",
            "transformers generate, static batches",
            [
                py,
                "-m",
                "prefixgate.gateway.bench.hf_server",
                "--model",
                model or "",
                "--load-format",
                load_format,
                "--port",
                "{port}",
                "--max-batch-size",
                str(args.hf_batch_size or args.concurrency or 32),
            ],
            note="streams all of a request's tokens when its batch ends: TTFT is honest, its TPOT and ITL are ~0 by construction",
        ),
    }
    keys = [k.strip() for k in args.targets.split(",") if k.strip()]
    bad = [k for k in keys if k not in TARGET_KEYS]
    if bad:
        raise ValueError(f"unknown target(s) {bad}: choose among {','.join(TARGET_KEYS)}")
    targets = []
    for k in keys:
        if k == "e":
            if args.upstream:
                targets.append(
                    Target(
                        "e",
                        "upstream",
                        f"external server {args.upstream}",
                        None,
                        args.upstream,
                        args.upstream_model,
                    )
                )
            continue
        if k == "d" and not model:
            print(
                "bench compare: skipping (d): the transformers baseline needs --model DIR",
                file=sys.stderr,
            )
            continue
        targets.append(all_targets[k])
    if args.upstream and "e" not in keys:
        targets.append(
            Target(
                "e",
                "upstream",
                f"external server {args.upstream}",
                None,
                args.upstream,
                args.upstream_model,
            )
        )
    return targets


class ServerProcess:
    """A server subprocess on a free loopback port, its output in ``log_path``.

    Raises (from :meth:`start`):
        RuntimeError: the process exited, or was not ready within ``startup_timeout_s``.
    """

    def __init__(
        self, command: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.command = [c.replace("{port}", str(self.port)) for c in command]
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.base_url = f"http://127.0.0.1:{self.port}"

    async def start(self, startup_timeout_s: float) -> None:
        """Start the process and wait until ``GET /ready`` (or ``/health``) answers 200."""
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        log.close()
        deadline = time.monotonic() + startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode}: {self.log_tail()}"
                    )
                for route in ("/ready", "/health"):
                    try:
                        r = await http.get(self.base_url + route)
                    except httpx.HTTPError:
                        break
                    if r.status_code == 200:
                        return
                    if r.status_code != 404:
                        break
                await asyncio.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready within {startup_timeout_s:.0f} s: {self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def log_tail(self, n: int = 1500) -> str:
        """The last ``n`` characters of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


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
        cfg = LoadConfig(
            base_url=target.base_url or "",
            model=target.model,
            api_key=args.api_key,
            rate=args.rate,
            concurrency=args.concurrency,
            seed=args.seed,
            timeout_s=args.timeout,
            progress=not args.no_progress,
        )
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
    except Exception as exc:  # one target failing must not lose the others' results
        info["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{target.key}] {target.label}: FAILED {info['error'][:500]}", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
    return info


def ratios(summaries: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """For each target: each headline figure divided by the first target's (a)."""
    keys = list(summaries)
    ref = summaries[keys[0]]
    out = {}
    for k in keys:
        row = {}
        for label, path, _, _ in HEADLINE:
            v, r = lookup(summaries[k], path), lookup(ref, path)
            row[label] = v / r if v is not None and r else None
        out[k] = row
    return out


def checks(summaries: dict[str, dict]) -> list[dict]:
    """The issue-7 claims, evaluated on this run where the targets exist.

    (a) vs (d): >= 3x output tokens/s and <= 1/5 of p99 TTFT; (a) vs (b): mean TTFT >= 80 %
    lower; (a) vs (c): higher output tokens/s and lower p99 TTFT.
    """

    def get(k: str, *path: str) -> float | None:
        return lookup(summaries[k], path) if k in summaries else None

    out = []

    def add(name: str, value: float | None, target: str, ok: bool | None) -> None:
        out.append({"check": name, "value": value, "target": target, "pass": ok})

    a_tp, a_p99, a_mean = (
        get("a", "output_throughput"),
        get("a", "ttft_ms", "p99"),
        get("a", "ttft_ms", "mean"),
    )
    if "d" in summaries and a_tp and a_p99:
        d_tp, d_p99 = get("d", "output_throughput"), get("d", "ttft_ms", "p99")
        tp = a_tp / d_tp if d_tp else None
        tt = a_p99 / d_p99 if d_p99 else None
        add("(a)/(d) output tokens/s", tp, ">= 3", tp is not None and tp >= 3)
        add("(a)/(d) p99 TTFT", tt, "<= 0.2", tt is not None and tt <= 0.2)
    if "b" in summaries and a_mean is not None:
        b_mean = get("b", "ttft_ms", "mean")
        red = 1 - a_mean / b_mean if b_mean else None
        add("(a) vs (b) mean TTFT reduction", red, ">= 0.8", red is not None and red >= 0.8)
    if "c" in summaries and a_tp and a_p99:
        c_tp, c_p99 = get("c", "output_throughput"), get("c", "ttft_ms", "p99")
        tp = a_tp / c_tp if c_tp else None
        tt = a_p99 / c_p99 if c_p99 else None
        add("(a)/(c) output tokens/s", tp, "> 1", tp is not None and tp > 1)
        add("(a)/(c) p99 TTFT", tt, "< 1", tt is not None and tt < 1)
    return out


def shared_prefix_share(model: str | None, requests: list[BenchRequest]) -> dict | None:
    """Share of prompt tokens that are a prefix shared with another request (the workload's
    dedup potential), with ``model``'s tokenizer and chat template (transformers); ``None``
    when it cannot be computed."""
    if not model:
        return None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        ids = []
        for r in requests:
            text = tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
            ids.append(tok(text, add_special_tokens=False)["input_ids"])
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
    p.add_argument(
        "--api-key",
        default=os.environ.get("PREFIXGATE_API_KEY"),
        help="bearer key sent to every target",
    )
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
    from prefixgate.gateway.bench.cli import _workload_doc, workload_from_args

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
        "workload": _workload_doc(wl, args),
        "shared_prefix": share,
        "machine": machine(),
        "wall_s": wall,
        "targets": runs,
        "ratios_vs_a": ratios(ok) if ok else {},
        "checks": checks(by_key),
    }
    _print_compare(doc, ok)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.plot and ok:
        from prefixgate.gateway.bench.plot import plot_compare

        plot_compare(ok, args.plot, title=_title(doc))
    return 0 if ok else 1


def machine() -> dict:
    """The machine, in a few words (CPU count, model name, torch threads)."""
    info: dict = {"cpus": os.cpu_count(), "platform": sys.platform}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def _title(doc: dict) -> str:
    load = doc["load"]
    shape = (
        f"concurrency {load['concurrency']}" if load["concurrency"] else f"rate {load['rate']}/s"
    )
    share = doc.get("shared_prefix") or {}
    s = f", {share['share'] * 100:.0f} % shared prefix" if share.get("share") else ""
    return f"{Path(str(doc['model'])).name}: {load['num_requests']} requests, {shape}{s}"


def _print_compare(doc: dict, summaries: dict[str, dict]) -> None:
    for r in doc["targets"]:
        if "error" in r:
            print(f"({r['target']}) {r['label']} failed: {r['error'][:300]}", file=sys.stderr)
    if not summaries:
        return
    names = list(summaries)
    rat = doc["ratios_vs_a"]
    rows = []
    for label, path, unit, _ in HEADLINE:
        row = [f"{label} ({unit})" if unit else label]
        for n in names:
            v = fmt(lookup(summaries[n], path), unit)
            q = rat.get(n, {}).get(label)
            row.append(v if n == names[0] or q is None else f"{v} ({q:.2f}x)")
        rows.append(row)
    if any(summaries[n].get("errors") for n in names):
        rows.append(
            [
                "errors",
                *(
                    ", ".join(f"{k}: {v}" for k, v in summaries[n]["errors"].items()) or "-"
                    for n in names
                ),
            ]
        )
    print_table(_title(doc) + " — ratio vs the first in ()", ["metric", *names], rows)
    for r in doc["targets"]:
        if r.get("note"):
            print(f"  note ({r['target']}) {r['label']}: {r['note']}")
    for c in doc["checks"]:
        v = "-" if c["value"] is None else f"{c['value']:.3f}"
        print(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['check']}: {v} (target {c['target']})")
