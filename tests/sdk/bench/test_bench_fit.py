"""Fitting a workload to the served model's context (``bench serve`` before it sends)."""

from __future__ import annotations

import asyncio

import pytest
from prefixgate.gateway.cli import main  # noqa: E402
from prefixgate.sdk.bench.fit import WorkloadDoesNotFitError, fit_to_context  # noqa: E402
from prefixgate.sdk.bench.workload import BenchRequest  # noqa: E402
from support.stub_upstream import StubServer  # noqa: E402


@pytest.fixture
def stub():
    server = StubServer().start()
    yield server
    server.stop()


def _requests() -> list[BenchRequest]:
    """Prompts of 10, 20, 30 and 40 characters (= stub tokens), max_tokens 8 each."""
    return [
        BenchRequest(i, [{"role": "user", "content": "x" * (10 * (i + 1))}], 8) for i in range(4)
    ]


def _fit(stub: StubServer, requests: list[BenchRequest]):
    return asyncio.run(fit_to_context(requests, stub.base_url, "stub-model"))


def test_fit_drops_prompts_that_fill_the_context_and_shortens_outputs(stub):
    stub.max_model_len = 25  # 10 + 8 fits; 20 + 8 overruns; 30 and 40 fill it
    fit = _fit(stub, _requests())
    assert fit.context == 25 and fit.prompt_tokens == {0: 10, 1: 20, 2: 30, 3: 40}
    assert [r.index for r in fit.requests] == [0, 1] and fit.dropped == [2, 3]
    assert fit.shortened == [1] and [r.max_tokens for r in fit.requests] == [8, 5]
    assert fit.describe() == (
        "the model's context is 25 tokens: dropped 2 request(s) whose prompt fills it; "
        "lowered max_tokens of 1 to fit"
    )


def test_fit_leaves_a_workload_that_fits_alone(stub):
    stub.max_model_len = 1000
    fit = _fit(stub, _requests())
    assert fit.requests == _requests() and fit.describe() is None


def test_fit_without_a_context_or_a_token_count_sends_unchanged(stub):
    fit = _fit(stub, _requests())  # no max_model_len in the card
    assert fit.requests == _requests() and fit.context is None and fit.describe() is None
    stub.max_model_len, stub.tokenize = 25, False
    fit = _fit(stub, _requests())
    assert fit.requests == _requests() and "cannot count prompt tokens" in fit.describe()


def test_fit_refuses_when_no_prompt_fits(stub):
    stub.max_model_len = 10
    with pytest.raises(WorkloadDoesNotFitError) as err:
        _fit(stub, _requests())
    msg = str(err.value)
    assert "context of 10 tokens" in msg and "shortest prompt of this workload has 10 tokens" in msg


def test_bench_serve_refuses_in_one_line(stub, capsys):
    stub.max_model_len = 16
    argv = ["bench", "serve", "--base-url", stub.base_url, "--num-requests", "4", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "context of 16 tokens" in err, err
    assert not stub.seen  # nothing was sent


def test_bench_serve_fits_and_names_error_reasons(stub, capsys):
    stub.max_model_len = 700  # the sample prompts are ~100-700 characters
    argv = ["bench", "serve", "--base-url", stub.base_url, "--num-requests", "8"]
    argv += ["--output-len", "4", "--no-progress", "--num-system-prompts", "4"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert all(sum(len(m["content"]) for m in b["messages"]) < 700 for b in stub.seen)
    assert "TTFT p99" in out
    stub.seen.clear()
    stub.fail_every = 2
    assert main(argv + ["--no-fit"]) == 0
    out = capsys.readouterr().out
    assert "RateLimitError(429)" in out and "overloaded" in out  # the kind and its message


def test_fit_drops_a_prompt_the_server_will_not_tokenize_as_too_long():
    """prefixgate's ``/tokenize`` refuses a text past 8 contexts (400
    ``context_length_exceeded``, nothing tokenized): such a prompt is dropped as not fitting,
    not taken for a server that cannot count."""
    from prefixgate.gateway.app import create_app
    from prefixgate.gateway.http.server import BackgroundServer
    from prefixgate.gateway.settings import GatewaySettings
    from support.fake_engine import FakeEngine  # one token per byte, a context of 128

    requests = [
        BenchRequest(0, [{"role": "user", "content": "x" * 10}], 8),
        BenchRequest(1, [{"role": "user", "content": "x" * 5000}], 8),
    ]
    with BackgroundServer(
        lambda: create_app(FakeEngine(), GatewaySettings(model_name="fake"))
    ) as srv:
        fit = asyncio.run(fit_to_context(requests, srv.url, "fake"))
    assert [r.index for r in fit.requests] == [0] and fit.dropped == [1], fit
    assert "cannot count" not in (fit.describe() or "")
