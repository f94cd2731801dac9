"""Targets of ``bench compare``: what each server is, its command, and running it on loopback."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prefixgate.sdk.bench.shared import find_shared

TARGET_KEYS = ("a", "b", "c", "d", "e")
SMOLLM2_SHAPE = Path("models") / "smollm2-135m-shape"


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


def default_model() -> str | None:
    """The SmolLM2-135M-shaped config (no weights: served with dummy weights), if present."""
    found = find_shared(SMOLLM2_SHAPE / "config.json")
    return str(found.parent) if found else None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound then released: the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen, timeout_s: float = 30.0, kill_wait_s: float = 10.0) -> None:
    """SIGTERM ``proc`` and wait up to ``timeout_s`` seconds for it to exit; past that SIGKILL it
    and wait up to ``kill_wait_s`` seconds more (``subprocess.TimeoutExpired`` if even that
    fails). Does nothing to a process that has already exited."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(kill_wait_s)


def wait_http_ready(
    proc: subprocess.Popen, url: str, timeout_s: float, name: str, log: str, poll_s: float = 0.5
) -> None:
    """Block until ``GET url`` answers 200 (a server ``proc`` starting; ``log``: where its
    output goes, named in the errors).

    Raises:
        RuntimeError: ``proc`` exited first.
        TimeoutError: not ready within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}): see {log}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{name} not ready after {timeout_s:.0f} s (log: {log})")


def _has_weights(model: str) -> bool:
    path = Path(model)
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def build_targets(args: argparse.Namespace) -> list[Target]:
    """The targets ``args.targets`` names, with their server commands."""
    py = sys.executable
    model = args.model
    load_format = args.load_format or ("auto" if model and _has_weights(model) else "dummy")
    engine = [
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
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
                "prefixgate.engine.hf_server",
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
    threads = getattr(args, "threads", None)
    if threads:  # the same intra-op thread count for every server we start
        for t in all_targets.values():
            t.env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    keys = [k.strip() for k in args.targets.split(",") if k.strip()]
    bad = [k for k in keys if k not in TARGET_KEYS]
    if bad:
        raise ValueError(f"unknown target(s) {bad}: choose among {','.join(TARGET_KEYS)}")
    external = (
        Target(
            "e",
            "upstream",
            f"external server {args.upstream}",
            None,
            args.upstream,
            args.upstream_model,
        )
        if args.upstream
        else None
    )
    targets = []
    for k in keys:
        if k == "e":
            if external is not None:
                targets.append(external)
            continue
        if k == "d" and not model:
            print(
                "bench compare: skipping (d): the transformers baseline needs --model DIR",
                file=sys.stderr,
            )
            continue
        targets.append(all_targets[k])
    if external is not None and "e" not in keys:
        targets.append(external)
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
        if self.proc is not None:
            terminate(self.proc, 15, 5)

    def log_tail(self, n: int = 1500) -> str:
        """The last ``n`` characters of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"
