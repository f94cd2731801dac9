"""CI smoke of the proxy extra and of the SDK alone, each in its own fresh environment.

Run by ``.ci/smoke_extras`` with the ``[proxy]`` environment's Python:
``smoke_proxy.py SDK_PYTHON``. It checks that this environment has no torch, serves the tests'
stub OpenAI upstream on loopback, starts ``prefixgate serve --upstream URL`` (this
environment's console script), waits for ``/health``, relays one chat with plain httpx, then
has the SDK-only environment's Python (no aiohttp, no torch) make the same call with
``prefixgate.sdk``. Exits non-zero, with the server's log, on any failure.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
from support.stub_upstream import StubServer  # noqa: E402

SDK_CALL = """
import sys
from prefixgate.sdk import Client
for absent in ("aiohttp", "torch"):
    assert absent not in sys.modules, absent + " was imported by the SDK"
    try:
        __import__(absent)
    except ImportError:
        pass
    else:
        raise SystemExit(absent + " is installed in the SDK-only environment")
with Client(base_url=sys.argv[1], api_key="none", max_retries=0) as client:
    r = client.chat.completions.create(
        model="stub-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
print("sdk:", r.model, repr(r.choices[0].message.content))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    sdk_python = sys.argv[1]
    for absent in ("torch", "transformers"):
        if importlib.util.find_spec(absent) is not None:
            raise SystemExit(f"{absent} is installed in the [proxy] environment")
    stub = StubServer().start()
    port = _free_port()
    log = open(ROOT / ".ci" / "smoke_proxy.log", "w")  # noqa: SIM115
    serve = Path(sys.executable).parent / "prefixgate"
    server = subprocess.Popen(
        [str(serve), "serve", "--upstream", stub.base_url, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if server.poll() is not None:
                raise SystemExit(f"prefixgate serve --upstream exited {server.returncode}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise SystemExit("the proxy never answered /health")
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, (r.status_code, r.text)
        assert r.json()["choices"][0]["message"]["role"] == "assistant", r.text
        print("proxy: relayed", r.json()["model"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        subprocess.run(
            [sdk_python, "-c", SDK_CALL, f"{base}/v1"], check=True, cwd="/", env=env, timeout=120
        )
    except BaseException:
        log.flush()
        print((ROOT / ".ci" / "smoke_proxy.log").read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        server.terminate()
        server.wait(timeout=30)
        stub.stop()


if __name__ == "__main__":
    main()
