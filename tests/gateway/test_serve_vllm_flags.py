"""vLLM's ``serve`` flags a new user's command line carries: each does what vLLM's does, or
is a bad option saying why (exit 2), never taken and ignored.

``--gpu-memory-utilization`` (the KV share of a CUDA device), ``--trust-remote-code`` and
``--disable-log-requests`` (taken: nothing to permit / nothing logged), ``--enable-prefix-caching``
/ ``--no-enable-prefix-caching``, ``--tensor-parallel-size`` (1 only), ``--served-model-name a b``
(several names, all served; ``b`` was taken as the positional MODEL)."""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest
from prefixgate.gateway.cli import build_parser, main
from prefixgate.gateway.serve.args import check_parallel_sizes, positional_model
from prefixgate.gateway.serve.configure import engine_config, settings_from_args


def _args(*argv: str):
    args = build_parser("serve").parse_args(["serve", *argv])
    positional_model(args)
    return args


def _bad_option(caplog, *argv: str) -> str:
    with caplog.at_level(logging.ERROR, logger="prefixgate.gateway"):
        code = main(["serve", "--port", "0", *argv])
    assert code == 2
    lines = [r.getMessage() for r in caplog.records if "bad option" in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    return lines[0]


def test_several_served_model_names_are_names_not_the_model(aidreams_path):
    args = _args(aidreams_path, "--served-model-name", "a", "b")
    assert args.model == aidreams_path
    settings = settings_from_args(args)
    assert settings.model_name == "a" and settings.model_aliases == ["b"]
    one = settings_from_args(_args(aidreams_path, "--served-model-name", "a"))
    assert one.model_name == "a" and one.model_aliases == []
    default = settings_from_args(_args(aidreams_path))
    assert default.model_name == "aidreams" or default.model_name  # the folder's name
    assert default.model_aliases == []


def test_a_served_model_name_twice_is_refused(caplog, aidreams_path):
    line = _bad_option(caplog, aidreams_path, "--served-model-name", "a", "a")
    assert "--served-model-name" in line and "twice" in line


def test_a_served_model_name_in_proxy_mode_is_refused(caplog):
    line = _bad_option(caplog, "--upstream", "http://127.0.0.1:9", "--served-model-name", "a")
    assert "--served-model-name" in line


def test_every_served_name_answers(serve_fake):
    from prefixgate.gateway.settings import GatewaySettings

    srv, _engine = serve_fake(GatewaySettings(model_name="a", model_aliases=["b", "c"]))
    listed = httpx.get(srv.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in listed["data"]] == ["a", "b", "c"]
    assert httpx.get(srv.url + "/v1/models/b", timeout=10).json()["id"] == "b"
    for name in ("a", "b", "c"):
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "a"  # answers name the first, as vLLM's
    body = {"model": "d", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'a' or 'b' or 'c'" in r.json()["error"]["message"]
    gemini = httpx.get(srv.url + "/v1beta/models", timeout=10).json()
    assert [m["name"] for m in gemini["models"]] == ["models/a", "models/b", "models/c"]
    assert httpx.get(srv.url + "/v1beta/models/c", timeout=10).json()["name"] == "models/c"


def test_served_names_are_checked():
    from prefixgate.gateway.settings import GatewaySettings

    with pytest.raises(ValueError, match="twice"):
        GatewaySettings(model_name="a", model_aliases=["a"])
    with pytest.raises(ValueError, match="needs model_name"):
        GatewaySettings(model_aliases=["a"])
    with pytest.raises(ValueError, match="non-empty"):
        GatewaySettings(model_name="a", model_aliases=[""])


def test_permission_and_logging_flags_are_taken(aidreams_path):
    args = _args(aidreams_path, "--trust-remote-code", "--disable-log-requests")
    assert args.trust_remote_code and args.disable_log_requests
    engine_config(args)  # nothing of theirs reaches the engine
    from prefixgate.gateway.serve.args import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    help_text = parser.format_help()
    assert "never runs a model's code" in " ".join(help_text.split())
    assert "never logs a request's content" in " ".join(help_text.split())


@pytest.mark.parametrize(
    ("flags", "on"),
    [
        ([], True),
        (["--enable-prefix-caching"], True),
        (["--no-enable-prefix-caching"], False),
        (["--no-prefix-caching"], False),
    ],
)
def test_prefix_caching_flags(aidreams_path, flags, on):
    assert engine_config(_args(aidreams_path, *flags)).enable_prefix_caching is on


def test_tensor_parallel_size_one_is_taken_more_is_refused(caplog, aidreams_path):
    check_parallel_sizes(_args(aidreams_path, "--tensor-parallel-size", "1"))
    check_parallel_sizes(_args(aidreams_path, "-tp", "1", "-pp", "1"))
    line = _bad_option(caplog, aidreams_path, "--tensor-parallel-size", "2")
    assert "--tensor-parallel-size 2" in line and "one device" in line
    with pytest.raises(ValueError, match="--pipeline-parallel-size 4"):
        check_parallel_sizes(_args(aidreams_path, "-pp", "4"))
    with pytest.raises(ValueError, match=">= 1"):
        check_parallel_sizes(_args(aidreams_path, "-tp", "0"))


def test_gpu_memory_utilization_on_cpu_is_refused_before_the_load(caplog, aidreams_path):
    line = _bad_option(caplog, aidreams_path, "--device", "cpu", "--gpu-memory-utilization", "0.9")
    assert "--gpu-memory-utilization applies to a CUDA device" in line
    assert "--kv-cache-memory" in line or "kv_cache_memory" in line


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (
            ["--gpu-memory-utilization", "0.9", "--kv-cache-memory", "1GiB"],
            "give one of them",
        ),
        (
            ["--gpu-memory-utilization", "0.9", "--runner", "sim"],
            "runner 'sim' does not use it",
        ),
    ],
)
def test_gpu_memory_utilization_values_are_checked(caplog, aidreams_path, flags, said):
    assert said in _bad_option(caplog, aidreams_path, *flags)


def test_utilization_budget_is_the_share_less_what_is_in_use():
    from prefixgate.engine.kv_cache import utilization_budget

    gib = 2**30
    # 80 GiB device, 20 GiB in use after the load: 0.9 * 80 - 20 = 52 GiB for the KV cache
    assert utilization_budget(0.9, 60 * gib, 80 * gib) == int(0.9 * 80 * gib) - 20 * gib
    with pytest.raises(ValueError, match="leaves no memory for the KV cache"):
        utilization_budget(0.2, 60 * gib, 80 * gib)


def test_gpu_memory_utilization_sizes_the_kv_cache_on_cuda(monkeypatch):
    """The CUDA path without a GPU: ``mem_get_info`` stands in for the device."""
    import torch
    from prefixgate.engine.kv_cache import KVCacheSpec, resolve_num_blocks

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (60 * gib, 80 * gib))
    spec = KVCacheSpec(2, 2, 64, 16, torch.float16)  # 16 KiB a block
    blocks = resolve_num_blocks(spec, None, None, "cuda", 0.9)
    assert blocks == (int(0.9 * 80 * gib) - 20 * gib) // spec.bytes_per_block
    assert resolve_num_blocks(spec, None, None, "cuda") == 30 * gib // spec.bytes_per_block
    with pytest.raises(ValueError, match="applies to a CUDA device"):
        resolve_num_blocks(spec, None, None, "cpu", 0.9)


def test_a_model_after_several_served_names_is_not_taken_as_a_name(caplog, aidreams_path):
    """``serve --served-model-name a PATH`` served PATH as ``a`` before names took several
    words; now PATH would be a second name and the preset served: refused, saying why."""
    line = _bad_option(caplog, "--served-model-name", "a", aidreams_path)
    assert "give the model first" in line
    line = _bad_option(caplog, "--served-model-name", "a", "org/some-model")
    assert "give the model first" in line
    args = _args(aidreams_path, "--served-model-name", "a", "org/alias")
    assert settings_from_args(args).model_aliases == ["org/alias"]  # with a model: a name
