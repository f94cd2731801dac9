"""``prefixgate serve`` model options as a real process: a hub id resolved offline from a
pre-filled cache, ``--served-model-name``, ``--chat-template`` (inline or a file)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from support.serve_process import SERVE, read_until_ready  # noqa: E402

pytest.importorskip("prefixgate.engine.async_engine")
pytest.importorskip("huggingface_hub")


def start_serve(
    argv: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str, list[str]]:
    """Start ``prefixgate serve --port 0 ...``; return (process, base URL, log lines so far)
    once the model is ready, or fail with the log."""
    proc = subprocess.Popen(
        [*SERVE, "--port", "0", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    url, log, ready = read_until_ready(proc, time.monotonic() + 120)
    if ready:
        return proc, url, log
    proc.kill()
    proc.wait()
    raise AssertionError("serve did not become ready:\n" + "".join(log))


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM, wait, return the rest of the log."""
    proc.send_signal(signal.SIGTERM)
    try:
        rest = proc.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        rest = proc.communicate()[0]
    assert proc.returncode == 0, rest
    return rest


def fake_hub_cache(root: Path, repo_id: str, model_dir: Path) -> Path:
    """A Hugging Face hub cache holding ``repo_id`` at one revision (the layout
    huggingface_hub writes: models--org--name/snapshots/<commit>/..., refs/main)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return root


def test_model_by_hub_id_from_an_offline_cache(tmp_path, aidreams_path):
    cache = fake_hub_cache(tmp_path / "hub", "testorg/aidreams", Path(aidreams_path))
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc, url, _ = start_serve(["--model", "testorg/aidreams", "--num-kv-blocks", "64"], env)
    try:
        card = httpx.get(url + "/v1/models").json()["data"][0]
        assert card["id"] == "testorg/aidreams" and card["max_model_len"] == 128
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model="testorg/aidreams", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert r.usage.completion_tokens >= 1
    finally:
        stop(proc)
    # a name the cache does not hold: one line, exit 1, no traceback
    out = subprocess.run(
        [*SERVE, "--port", "0"] + ["--model", "testorg/absent"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    assert "cannot get 'testorg/absent' from the Hugging Face hub" in out.stderr
    assert "Traceback" not in out.stderr


def test_served_model_name_and_chat_template(tmp_path, aidreams_path):
    from prefixgate.engine.tokenizer import Tokenizer

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    argv = ["--model", aidreams_path, "--num-kv-blocks", "64", "--served-model-name", "tiny-llama"]
    proc, url, _ = start_serve([*argv, "--chat-template", template])
    try:
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-llama"
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "hello there"}]
        with pytest.raises(openai.NotFoundError) as err:  # the folder's name is not served
            client.chat.completions.create(model="aidreams-260k", max_tokens=2, messages=messages)
        assert err.value.code == "model_not_found"
        r = client.chat.completions.create(model="tiny-llama", max_tokens=2, messages=messages)
        tok = Tokenizer.from_pretrained(aidreams_path)
        assert r.usage.prompt_tokens == len(tok.encode("hello there", add_special_tokens=False))
    finally:
        stop(proc)
    # the same template from a file; a missing file is a one-line error before anything starts
    path = tmp_path / "t.jinja"
    path.write_text(template)
    proc, url, _ = start_serve([*argv, "--chat-template", str(path)])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="tiny-llama", max_tokens=2, messages=messages)
        assert r.usage.prompt_tokens == len(tok.encode("hello there", add_special_tokens=False))
    finally:
        stop(proc)
    out = subprocess.run(
        [*SERVE, "--port", "0"] + ["--chat-template", str(tmp_path / "absent.jinja")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "absent.jinja" in out.stderr and "Traceback" not in out.stderr


def test_access_log_and_engine_line(tmp_path):
    """One access line per request naming the key's name (never the key); the engine line
    after activity; neither line with --no-access-log / --stats-interval-s 0."""
    keys = tmp_path / "keys.json"
    keys.write_text('{"keys": [{"key": "sk-secret-1", "name": "team-a"}]}')
    argv = ["--max-model-len", "64", "--num-kv-blocks", "64", "--keys-file", str(keys)]
    proc, url, _ = start_serve([*argv, "--stats-interval-s", "0.5"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-secret-1", max_retries=0)
        r = client.chat.completions.create(
            model="tiny-random", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
        httpx.get(url + "/health")
        time.sleep(1.5)  # at least one stats interval after the request
    finally:
        log = stop(proc)
    access = [line for line in log.splitlines() if "prefixgate.access" in line]
    assert len(access) == 1, log  # the /health probe is logged at DEBUG only
    assert '"POST /v1/chat/completions" 200 key=team-a' in access[0]
    assert f"prompt={r.usage.prompt_tokens} completion={r.usage.completion_tokens}" in access[0]
    assert "sk-secret-1" not in log
    engine_lines = [line for line in log.splitlines() if "engine: prompt" in line]
    assert engine_lines and "generation" in engine_lines[0] and "prefix hit rate" in engine_lines[0]

    quiet = ["--no-access-log", "--stats-interval-s", "0"]
    proc, url, _ = start_serve([*argv, *quiet])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-secret-1", max_retries=0)
        client.chat.completions.create(
            model="tiny-random", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
    finally:
        log = stop(proc)
    assert "prefixgate.access" not in log and "engine: prompt" not in log


def test_bench_serve_against_aidreams_fits_or_refuses_in_one_line(aidreams_path):
    """``prefixgate bench serve`` with its defaults against the 128-token aidreams model."""
    proc, url, _ = start_serve(["--model", aidreams_path, "--num-kv-blocks", "64"])
    try:
        out = subprocess.run(
            [sys.executable, "-m", "prefixgate.gateway.cli", "bench", "serve", "--base-url", url]
            + ["--no-progress"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stop(proc)
    if out.returncode == 0:  # fitted: the table shows no context-length failure
        assert "context_length_exceeded" not in out.stdout, out.stdout
        assert "TTFT p99" in out.stdout
    else:
        assert out.returncode == 2, out.stderr
        err = [x for x in out.stderr.splitlines() if x.startswith("prefixgate bench serve:")]
        assert len(err) == 1 and "context of 128 tokens" in err[0], out.stderr
        assert re.search(r"the shortest prompt of this workload has \d+ tokens", err[0])
        assert "Traceback" not in out.stderr
