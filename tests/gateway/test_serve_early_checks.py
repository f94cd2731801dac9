"""``prefixgate serve`` tells a bad port, keys file or model path in one line, before torch.

Each case runs the real command line in a fresh interpreter and then asks that interpreter
whether torch was imported: the check must come before the engine's imports, so a user waits
for the interpreter and aiohttp, never for torch, to hear that the port is taken.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from prefixgate.gateway.serve.early_checks import (
    CannotListenError,
    check_model_path,
    check_port_free,
)

# main() returns the exit code of a refused start; the last stdout line says whether torch
# (or the engine's async core) was imported by then.
PROBE = (
    "import sys, json\n"
    "from prefixgate.gateway.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules,"
    " 'engine': 'prefixgate.engine.async_engine' in sys.modules}))\n"
)


def _serve(*flags: str) -> tuple[dict, list[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "serve", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    return seen, errors


def _one_line(errors: list[str], *words: str) -> str:
    assert len(errors) == 1, errors
    assert "bad option:" in errors[0] and all(w in errors[0] for w in words), errors[0]
    return errors[0]


def test_a_port_in_use_is_told_before_torch():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        seen, errors = _serve("--port", str(port), "--host", "127.0.0.1")
    assert seen == {"code": 1, "torch": False, "engine": False}  # as a bind that fails later
    assert len(errors) == 1, errors
    assert f"cannot listen on 127.0.0.1:{port}" in errors[0], errors
    assert "choose another --port" in errors[0], errors


def test_a_missing_keys_file_is_told_before_torch(tmp_path):
    missing = tmp_path / "keys.json"
    seen, errors = _serve("--keys-file", str(missing), "--port", "0")
    assert seen == {"code": 2, "torch": False, "engine": False}
    _one_line(errors, "keys file", str(missing))


def test_a_bad_keys_file_field_is_told_before_torch(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-a", "rate": 3}]}))
    seen, errors = _serve("--keys-file", str(keys), "--port", "0")
    assert seen == {"code": 2, "torch": False, "engine": False}
    _one_line(errors, "unknown field 'rate'")


def test_a_model_path_that_does_not_exist_is_told_before_torch(tmp_path):
    missing = tmp_path / "models" / "nope"
    seen, errors = _serve("--model", str(missing), "--port", "0")
    assert seen == {"code": 2, "torch": False, "engine": False}
    _one_line(errors, f"--model {missing}", "no such folder")


def test_model_values_that_are_not_refused(tmp_path):
    check_model_path(None)  # the built-in preset
    check_model_path("tiny-random")
    check_model_path("HuggingFaceTB/SmolLM2-135M")  # a hub id: fetched when it loads
    check_model_path(str(tmp_path))  # a folder: its config.json is read by the preflight
    for bad in ("../no/such/model", "./nope", "a/b/c"):
        with pytest.raises(ValueError, match="no such folder"):
            check_model_path(bad)
    a_file = tmp_path / "config.json"
    a_file.write_text("{}")
    with pytest.raises(ValueError, match="a file, not a model folder"):
        check_model_path(str(a_file))


def test_port_checks():
    check_port_free("127.0.0.1", 0)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port_free("127.0.0.1", port)  # bound then released: free again
    with pytest.raises(CannotListenError, match="not an address of this machine"):
        check_port_free("192.0.2.1", port)  # TEST-NET-1, never local


def test_local_mode_without_the_engine_packages_is_told_in_one_line(monkeypatch, caplog):
    """A proxy-only install (``.[proxy]``: no torch, no tokenizers) asked to serve a local
    model: one line naming what is missing and the extra that brings it, exit 2 — not a
    ``ModuleNotFoundError`` traceback from the engine's imports. Simulated by a module name
    that is never installed."""
    import logging

    from prefixgate.gateway.cli import main
    from prefixgate.gateway.serve import early_checks

    monkeypatch.setattr(
        early_checks, "engine_requirements", lambda: ["jinja2", "no_such_module_pg"]
    )
    with pytest.raises(ValueError, match=r"no_such_module_pg not installed.*\.\[engine\]"):
        early_checks.check_engine_installed()
    with caplog.at_level(logging.ERROR):
        assert main(["serve", "--port", "0"]) == 2
    told = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(told) == 1 and "no_such_module_pg" in told[0] and "--upstream" in told[0], told


def test_the_engine_check_reads_the_engine_extra_and_names_what_is_missing(monkeypatch):
    """Was: the check held its own list of the ``[engine]`` extra's imports
    (``ENGINE_MODULES``), which had drifted from the extra (no xgrammar, jsonschema,
    huggingface_hub, ninja): an install missing one of them passed the check and failed later
    with a traceback. The list is now the extra itself, read from the installed
    distribution's metadata (the checkout's pyproject.toml when not installed)."""
    from importlib import metadata

    from prefixgate.gateway.serve import early_checks

    names = early_checks.engine_requirements()
    assert {"torch", "tokenizers", "pyzmq", "xgrammar", "jsonschema", "ninja"} <= set(names)
    assert {"aiohttp", "pydantic"} <= set(names)  # the proxy extra, which engine includes
    assert not {"pytest", "transformers", "triton", "prefixgate"} & set(names)

    real = metadata.distribution

    def without_xgrammar(name: str):
        if name == "xgrammar":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "distribution", without_xgrammar)
    with pytest.raises(ValueError, match=r"\(xgrammar not installed\).*\.\[engine\]"):
        early_checks.check_engine_installed()


def test_extra_requirements_expands_the_projects_own_extras():
    from prefixgate.gateway.serve.early_checks import extra_requirements

    requires = [
        "httpx>=0.27",
        'aiohttp>=3.14; extra == "proxy"',
        'pyzmq>=25; extra == "proxy"',
        'prefixgate[proxy]; extra == "engine"',
        'pyzmq>=25; extra == "engine"',
        "torch >=2.13 ; extra == 'engine'",
        'Jinja2[i18n]>=3.1; extra == "engine"',
        'prefixgate[engine]; extra == "bench"',
        'rich>=13; extra == "bench"',
    ]
    assert extra_requirements(requires, "engine") == ["aiohttp", "pyzmq", "torch", "Jinja2"]
    assert extra_requirements(requires, "bench")[-1] == "rich"
    assert extra_requirements(requires, "none") == []


def test_routing_options_are_checked_once_per_start(monkeypatch):
    """Was: ``prefixgate serve`` checked the routing policies' options twice, before its
    imports (``runner.run``) and again when the app was built (``app._base_app``). The CLI's
    early check is the one on that path; an app built by ``create_app`` /
    ``create_proxy_app`` (tests, embedders) still checks its settings itself."""
    from prefixgate.gateway import app
    from prefixgate.gateway.cli import main
    from prefixgate.gateway.http import server
    from prefixgate.gateway.proxy import policies
    from prefixgate.gateway.serve import runner
    from prefixgate.gateway.settings import GatewaySettings

    calls: list[str] = []
    check = policies.check_settings

    def counted(settings: GatewaySettings) -> None:
        calls.append(settings.routing)
        check(settings)

    async def cannot_listen(*args, **kwargs):
        raise OSError("not in this test")

    for module in (policies, app, runner):  # wherever it is called from
        monkeypatch.setattr(module, "check_settings", counted)
    monkeypatch.setattr(server, "start_server", cannot_listen)
    assert main(["serve", "--upstream", "http://127.0.0.1:9", "--port", "0"]) == 1
    assert calls == ["cache_aware"]  # the app was built (its listen failed), checked once

    calls.clear()
    app.create_proxy_app(["http://127.0.0.1:9"], GatewaySettings())
    app.create_app(None, GatewaySettings())
    assert calls == ["cache_aware", "cache_aware"]
    for make in (
        lambda s: app.create_app(None, s),
        lambda s: app.create_proxy_app(["http://a:1"], s),
    ):
        with pytest.raises(ValueError, match="routing must be one of"):
            make(GatewaySettings(routing="nope"))


def test_a_keys_file_with_no_keys_is_told_before_torch(tmp_path):
    # was: an open server (every request 200) started without a word
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": []}))
    seen, errors = _serve("--keys-file", str(keys), "--port", "0")
    assert seen == {"code": 2, "torch": False, "engine": False}
    _one_line(errors, "has no keys: every request would be open", "drop --keys-file")


@pytest.mark.parametrize("mode", ["upstream", "local"])
def test_the_keys_file_is_read_once_per_start(monkeypatch, tmp_path, mode):
    """Was: ``prefixgate serve`` read the keys file in its early check, again for the
    tenants' weights and the policy's warnings (local mode), and again when the app was
    built. It is read once; the app is built with what that read gave."""
    from pathlib import Path

    from prefixgate.gateway.cli import main
    from prefixgate.gateway.http import server
    from prefixgate.gateway.serve import runner
    from prefixgate.gateway.tenancy import keys

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"key": "sk-a", "name": "a", "weight": 2}]}))
    reads: list[str] = []
    load = keys.load_keys_file

    def counted(p: str):
        reads.append(p)
        return load(p)

    built: list[object] = []
    ring = keys.KeyRing.__init__

    def init(self, specs=None):
        built.append([s.name for s in specs or []])
        ring(self, specs)

    async def cannot_listen(*args, **kwargs):
        raise OSError("not in this test")

    monkeypatch.setattr(keys, "load_keys_file", counted)
    monkeypatch.setattr(keys.KeyRing, "__init__", init)
    monkeypatch.setattr(server, "start_server", cannot_listen)
    monkeypatch.setattr(runner, "preflight", lambda config: None)  # no torch here
    if mode == "upstream":
        where = ["--upstream", "http://127.0.0.1:9"]
    else:
        model = Path(__file__).resolve().parents[3] / "shared" / "models" / "aidreams-260k"
        where = ["--model", str(model)]
    assert main(["serve", *where, "--keys-file", str(path), "--port", "0"]) == 1
    assert reads == [str(path)]
    assert built == [["a"]]  # the app's key ring: the keys that one read gave


def test_a_bad_host_is_named_as_the_host_even_with_any_free_port():
    # port 0 (any free port) still checks the host: the hint names --host, not --port
    # foo..bar and a 64-character label: idna cannot encode them (a UnicodeError, which was
    # told as "bad option: encoding with 'idna' codec failed")
    for host, words in [
        ("0.0.0.0.0", "choose another --host"),
        ("192.0.2.1", "--host"),
        ("foo..bar", "choose another --host"),
        ("a" * 64 + ".example", "choose another --host"),
    ]:
        with pytest.raises(CannotListenError, match=words) as err:
            check_port_free(host, 0)
        assert "--port" not in str(err.value), err.value
    seen, errors = _serve("--host", "0.0.0.0.0", "--port", "0")
    assert seen == {"code": 1, "torch": False, "engine": False}
    assert len(errors) == 1 and "choose another --host" in errors[0], errors


def test_engine_options_beside_upstream_are_refused_by_name_before_torch():
    # they were taken and did nothing: `serve --upstream URL --max-num-seqs 4` served with
    # the upstream's own seats, the flag silently ignored
    seen, errors = _serve(
        "--upstream",
        "http://127.0.0.1:9",
        "--max-num-seqs",
        "4",
        "--kv-cache-memory",
        "64MiB",
        "--port",
        "0",
    )
    assert seen == {"code": 2, "torch": False, "engine": False}
    line = _one_line(errors, "--max-num-seqs", "--kv-cache-memory", "--upstream")
    assert "configure the local engine" in line


def test_which_engine_options_count_as_given():
    import argparse

    from prefixgate.gateway.serve.args import add_serve_arguments, engine_flags_given

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert engine_flags_given(p.parse_args(["--upstream", "http://u"])) == []
    # a permission configures nothing; the parallel sizes at their default of 1 are not set
    assert engine_flags_given(p.parse_args(["--trust-remote-code", "-tp", "1"])) == []
    got = engine_flags_given(p.parse_args(["--no-prefix-caching", "--threads", "2"]))
    assert sorted(got) == ["--enable-prefix-caching", "--threads"]
