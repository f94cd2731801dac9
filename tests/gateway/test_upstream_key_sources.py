"""The upstream credential comes from ``--upstream-api-key``, ``--upstream-api-key-file`` or
``$PREFIXGATE_UPSTREAM_API_KEY`` (``serve/configure.upstream_api_key``): not only argv, which
every local user reads in ``ps``."""

from __future__ import annotations

import argparse

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.cli import build_parser
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.serve.configure import (
    UPSTREAM_KEY_ENV,
    settings_from_args,
    upstream_api_key,
)

from examples.benchmarks.fault_upstream import FaultUpstream


def _args(*flags: str) -> argparse.Namespace:
    return build_parser("serve").parse_args(["serve", "--upstream", "http://127.0.0.1:1", *flags])


def test_each_source_and_its_precedence(tmp_path):
    path = tmp_path / "key"
    path.write_text("  sk-from-file\n")
    env = {UPSTREAM_KEY_ENV: "sk-from-env"}
    assert upstream_api_key(_args(), {}) is None
    assert upstream_api_key(_args(), env) == "sk-from-env"
    assert upstream_api_key(_args("--upstream-api-key-file", str(path)), env) == "sk-from-file"
    assert upstream_api_key(_args("--upstream-api-key", "sk-argv"), env) == "sk-argv"


@pytest.mark.parametrize(
    "flags,says",
    [
        (("--upstream-api-key", "a", "--upstream-api-key-file", "f"), "one of"),
        (("--upstream-api-key-file", "/nonexistent/key"), "cannot read"),
        (("--upstream-api-key", "two words"), "without whitespace"),
    ],
)
def test_bad_sources_are_one_line_errors(flags, says):
    with pytest.raises(ValueError, match=says):
        upstream_api_key(_args(*flags), {})


def test_an_empty_key_file_is_refused(tmp_path):
    path = tmp_path / "key"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        upstream_api_key(_args("--upstream-api-key-file", str(path)), {})


def test_the_key_from_a_file_reaches_the_upstream(tmp_path):
    path = tmp_path / "key"
    path.write_text("sk-file-key\n")
    with FaultUpstream("ok") as up:
        args = build_parser("serve").parse_args(
            ["serve", "--upstream", up.url, "--upstream-api-key-file", str(path)]
        )
        settings = settings_from_args(args)
        with BackgroundServer(lambda: create_proxy_app([up.url], settings)) as gw:
            body = {"model": "fault", "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
            assert r.status_code == 200, r.text
        assert up.auth == "Bearer sk-file-key"
