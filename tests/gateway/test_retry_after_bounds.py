"""``Retry-After`` from the bound that refused, measured against the actual wait (fake engine,
real server on loopback): under ``max_running`` (the in-flight cap) and a key's
``max_concurrent``, the refused client is told about when the first running request ends —
estimated from the running requests' ages against the recent hold time
(``tenancy/slot_wait.SlotClock``) — not a constant 1 s. The assertion bounds the error of the
advice against the wait measured; it times nothing else."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prefixgate.gateway.settings import GatewaySettings

TOKEN_DELAY_S = 0.05
LONG = 80  # tokens: ~4 s per request at TOKEN_DELAY_S


def _body(max_tokens: int) -> dict:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
    }


def _stats(srv, engine) -> dict:
    async def get():
        return engine.stats()

    return srv.call(get)


def _measure(srv, engine, headers: dict, slots: int) -> tuple[int, float]:
    """Fill ``slots`` with long requests (after ``slots`` of them ran once, so the hold time is
    known), then: (Retry-After of the refusal, seconds until a request was admitted)."""
    url = srv.url + "/v1/chat/completions"

    def run() -> None:
        r = httpx.post(url, json=_body(LONG), headers=headers, timeout=60)
        assert r.status_code == 200, r.text

    for _ in range(2):  # once to learn the hold time, once to measure
        threads = [threading.Thread(target=run) for _ in range(slots)]
        for t in threads:
            t.start()
        while _stats(srv, engine)["num_running"] < slots:
            time.sleep(0.01)
        if _ == 0:
            for t in threads:
                t.join()
    time.sleep(0.5)  # the running requests have progressed
    refused = httpx.post(url, json=_body(1), headers=headers, timeout=30)
    t_refused = time.monotonic()
    assert refused.status_code == 429, refused.text
    advice = int(refused.headers["Retry-After"])
    while True:
        r = httpx.post(url, json=_body(1), headers=headers, timeout=30)
        if r.status_code == 200:
            break
        assert r.status_code == 429, r.text
        time.sleep(0.05)
    waited = time.monotonic() - t_refused
    for t in threads:
        t.join()
    return advice, waited


def test_in_flight_cap_retry_after_matches_the_wait(serve_fake):
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", max_running=2), token_delay_s=TOKEN_DELAY_S
    )
    advice, waited = _measure(srv, engine, {}, slots=2)
    print(f"max_running: Retry-After {advice} s, actual wait {waited:.2f} s")
    assert waited > 2.0  # the scenario holds: the slots free seconds later, not at once
    assert abs(advice - waited) <= max(1.5, 0.35 * waited), (advice, waited)  # was always 1


@pytest.mark.parametrize("max_concurrent", [1, 2])
def test_key_concurrency_retry_after_matches_the_wait(serve_fake, tmp_path, max_concurrent):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "k", "max_concurrent": max_concurrent}]}))
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", keys_file=str(keys)), token_delay_s=TOKEN_DELAY_S
    )
    advice, waited = _measure(srv, engine, {"Authorization": "Bearer k"}, slots=max_concurrent)
    print(f"max_concurrent={max_concurrent}: Retry-After {advice} s, actual wait {waited:.2f} s")
    assert waited > 2.0
    assert abs(advice - waited) <= max(1.5, 0.35 * waited), (advice, waited)  # was always 1


@pytest.mark.parametrize("before", ["nothing", "short requests"])
def test_in_flight_cap_retry_after_from_the_running_requests_work_left(serve_fake, before):
    """Long outputs and no hold time to go by (none finished yet), or a misleading one (short
    requests finished first): the Retry-After comes from the running requests' own tokens
    left over their token rate (``Exchange.eta_s`` via ``Ticket.set_eta``). Measured
    against when the first slot really frees (the first running request's end), not against
    a retry loop, which a promise (``admission_wait.Promises``) admits at the time told."""
    slots = 4
    srv, engine = serve_fake(
        GatewaySettings(model_name="fake", max_running=slots), token_delay_s=TOKEN_DELAY_S
    )
    url = srv.url + "/v1/chat/completions"
    ended: list[float] = []

    def run(max_tokens: int) -> None:
        r = httpx.post(url, json=_body(max_tokens), timeout=60)
        assert r.status_code == 200, r.text
        ended.append(time.monotonic())

    if before == "short requests":
        warm = [threading.Thread(target=run, args=(2,)) for _ in range(slots)]
        for t in warm:
            t.start()
        for t in warm:
            t.join()
        ended.clear()
    threads = [threading.Thread(target=run, args=(LONG + 10 * i,)) for i in range(slots)]
    for t in threads:
        t.start()
    while _stats(srv, engine)["num_running"] < slots:
        time.sleep(0.01)
    time.sleep(0.8)  # past ETA_MIN_TOKENS tokens each
    refused = httpx.post(url, json=_body(1), timeout=30)
    t_refused = time.monotonic()
    assert refused.status_code == 429, refused.text
    advice = int(refused.headers["Retry-After"])
    for t in threads:
        t.join()
    first_free = min(ended) - t_refused
    print(
        f"max_running, {before} before: Retry-After {advice} s, first slot free {first_free:.2f} s"
    )
    assert first_free > 2.0  # the scenario holds: the slots free seconds later
    assert abs(advice - first_free) <= max(1.5, 0.35 * first_free), (advice, first_free)
