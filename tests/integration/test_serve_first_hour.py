"""The first hour with ``prefixgate serve``, as a new user meets it: a bad ``--port``,
``--dtype`` or ``--max-model-len`` and a keys-file typo are one-line errors listing the valid
values, given before the port is bound or the model loads (exit 2); a second Ctrl-C during
the drain exits at once."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading

import httpx
import pytest
from support.serve_process import READY_LINE, SERVE

pytest.importorskip("prefixgate.engine.async_engine")


def _serve(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # any free port unless a test names one: these refusals must not hinge on 8000 being free
    port = () if "--port" in flags else ("--port", "0")
    return subprocess.run(
        [*SERVE, *flags, *port],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The error, asserting exit 2 before any port was bound or model loaded, no traceback,
    one line (argparse's: one short usage line before it)."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "listening on" not in out and "loading" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) <= 2, out
    return lines[-1]


@pytest.mark.parametrize(
    "flags,says",
    [
        (("--port", "99999"), "from 0 to 65535"),
        (("--port", "-1"), "from 0 to 65535"),
        (("--port", "http"), "from 0 to 65535"),
        (("--dtype", "float99"), "'auto', 'float32', 'bfloat16', 'float16'"),
        (("--max-model-len", "0"), "--max-model-len must be >= 1"),
    ],
)
def test_bad_flags_are_one_line_errors_before_binding(flags, says):
    assert says in _one_line_error(_serve(*flags))


def test_max_model_len_over_the_models_limit_is_refused_before_binding(aidreams_path):
    line = _one_line_error(_serve("--model", str(aidreams_path), "--max-model-len", "5000"))
    assert "exceeds the model's limit of" in line, line


@pytest.mark.parametrize("upstream", [False, True])
def test_a_keys_file_typo_names_the_field_and_the_valid_ones(tmp_path, upstream):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "k", "requests_per_min": 5}]}))
    flags = ["--keys-file", str(keys)] + (["--upstream", "http://127.0.0.1:9"] if upstream else [])
    line = _one_line_error(_serve(*flags))
    assert "unknown field 'requests_per_min'" in line and "'requests_per_minute'" in line, line
    assert "KeySpec" not in line and "valid fields: key, name," in line, line


def test_a_second_ctrl_c_exits_at_once():
    """SIGINT drains (here: up to 120 s of grace for a long stream); a second SIGINT exits
    with 130 without waiting for the grace period."""
    proc = subprocess.Popen(
        [
            *SERVE,
            "--port",
            "0",
            "--shutdown-grace-s",
            "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, "".join(log)
            log.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        while READY_LINE not in log[-1]:
            log.append(proc.stdout.readline())
            assert log[-1], "".join(log)
        started = threading.Event()

        def stream() -> None:
            body = {
                "model": "tiny-random",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1500,
                "stream": True,
            }
            try:
                with httpx.stream(
                    "POST", url + "/v1/chat/completions", json=body, timeout=200
                ) as r:
                    for _ in r.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass

        threading.Thread(target=stream, daemon=True).start()
        assert started.wait(60)
        proc.send_signal(signal.SIGINT)
        while "shutting down" not in log[-1]:
            log.append(proc.stdout.readline())
            assert log[-1], "".join(log)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, "".join(log)  # well inside the 120 s of grace
        rest = proc.stdout.read()
        assert "second interrupt" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--upstream", "http://127.0.0.1:9", "--model", "x"), "--model serves a local model"),
        (("--api-key", " "), "--api-key: every API key must be a non-empty string"),
    ],
)
def test_flags_that_cannot_hold_together_are_refused_before_imports(flags, says):
    """A --model beside --upstream was ignored without a word; an empty --api-key was refused
    only once the engine had loaded (a new user's trial)."""
    assert says in _one_line_error(_serve(*flags))
