"""A key's own bounds through the real gateway: is each 429's ``Retry-After`` the truth?

One ``prefixgate serve`` process (built-in ``tiny-random`` preset unless ``--model``) with four
keys, one bound each (and one with two):

- ``conc``: ``max_concurrent=1``; a streaming request of ``--hold-tokens`` tokens holds the slot
  (one such request first, so the key's hold time is measured);
- ``rpm``: ``requests_per_minute=--rpm``; the bucket emptied by ``--rpm`` requests;
- ``tpm``: ``tokens_per_minute=--tpm``; emptied by one request of about ``--tpm`` prompt
  tokens;
- ``both``: ``max_concurrent=1`` and ``requests_per_minute=--rpm``: the slot held and the
  bucket empty (the 429 states the longer wait).

A fifth key without limits warms the server up first (one long request: first-use costs
would otherwise lengthen the hold time ``conc`` learns). For each, the refused request's ``retry-after-ms`` (stated) against the actual wait: from the
429 until a one-token request of the key is admitted, polled every 50 ms (a refusal takes
nothing). Figures only, no timed assertion.

    python -m examples.benchmarks.key_bounds [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prefixgate.sdk.bench.targets import free_port, terminate

from examples.benchmarks.gateway_overhead import start_serve
from examples.benchmarks.options import write_results


def _body(model: str, max_tokens: int, prompt: str = "hi", stream: bool = False) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def _post(url: str, key: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def _until_admitted(url: str, key: str, model: str) -> float:
    """Seconds from now until a one-token request of ``key`` is answered 200."""
    t0 = time.monotonic()
    while True:
        r = _post(url, key, _body(model, 1))
        if r.status_code == 200:
            return time.monotonic() - t0
        if r.status_code != 429:
            raise SystemExit(f"unexpected {r.status_code}: {r.text}")
        time.sleep(0.05)


def _stated(r: httpx.Response) -> float:
    if r.status_code != 429:
        raise SystemExit(f"expected a 429, got {r.status_code}: {r.text}")
    return int(r.headers["retry-after-ms"]) / 1000.0


def _hold(url: str, key: str, model: str, tokens: int) -> threading.Thread:
    """A long request of ``key`` in its own thread (holding its concurrency slot)."""

    def run() -> None:
        _post(url, key, _body(model, tokens))

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)  # admitted and generating
    return t


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    keys = [
        {"key": "sk-conc", "name": "conc", "max_concurrent": 1},
        {"key": "sk-rpm", "name": "rpm", "requests_per_minute": args.rpm},
        {"key": "sk-tpm", "name": "tpm", "tokens_per_minute": args.tpm},
        {"key": "sk-both", "name": "both", "max_concurrent": 1, "requests_per_minute": args.rpm},
        {"key": "sk-warm", "name": "warm"},
    ]
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    Path(path).write_text(json.dumps({"keys": keys}))
    port = free_port()
    flags = ["--keys-file", path, "--log-level", "WARNING", "--no-access-log"]
    if args.model:
        flags += ["--model", args.model]
    proc = start_serve(port, flags, timeout_s=180.0)
    url = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        model = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sk-conc"}).json()
        model = model["data"][0]["id"]
        _post(url, "sk-warm", _body(model, args.hold_tokens))  # first-use costs, not timed
        # conc: learn the hold time with one long request, then hold the slot and be refused
        _hold(url, "sk-conc", model, args.hold_tokens).join()
        holder = _hold(url, "sk-conc", model, args.hold_tokens)
        stated = _stated(_post(url, "sk-conc", _body(model, 1)))
        rows.append({"bound": "max_concurrent=1", "stated_s": stated})
        rows[-1]["actual_s"] = _until_admitted(url, "sk-conc", model)
        holder.join()
        # rpm: empty the bucket
        for _ in range(args.rpm):
            _post(url, "sk-rpm", _body(model, 1))
        stated = _stated(_post(url, "sk-rpm", _body(model, 1)))
        rows.append({"bound": f"requests_per_minute={args.rpm}", "stated_s": stated})
        rows[-1]["actual_s"] = _until_admitted(url, "sk-rpm", model)
        # tpm: one request of about the minute's tokens, then a small one is refused
        _post(url, "sk-tpm", _body(model, 1, prompt="x" * args.tpm))
        stated = _stated(_post(url, "sk-tpm", _body(model, 1, prompt="x" * 60)))
        rows.append({"bound": f"tokens_per_minute={args.tpm}", "stated_s": stated})
        t0 = time.monotonic()
        while True:  # the same 60-character prompt: the tokens it needs
            r = _post(url, "sk-tpm", _body(model, 1, prompt="x" * 60))
            if r.status_code == 200:
                break
            time.sleep(0.05)
        rows[-1]["actual_s"] = time.monotonic() - t0
        # both: the slot held and the bucket empty
        for _ in range(args.rpm - 1):
            _post(url, "sk-both", _body(model, 1))
        holder = _hold(url, "sk-both", model, args.hold_tokens)
        stated = _stated(_post(url, "sk-both", _body(model, 1)))
        rows.append({"bound": f"max_concurrent=1 + rpm={args.rpm}", "stated_s": stated})
        rows[-1]["actual_s"] = _until_admitted(url, "sk-both", model)
        holder.join()
    finally:
        terminate(proc)
        os.unlink(path)
    for r in rows:
        r["error"] = abs(r["stated_s"] - r["actual_s"]) / r["actual_s"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: built-in tiny-random)")
    p.add_argument("--rpm", type=int, default=6)
    p.add_argument("--tpm", type=int, default=600)
    p.add_argument("--hold-tokens", type=int, default=400)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    rows = measure(args)
    print(f"{'bound':32} {'stated s':>9} {'actual s':>9} {'error':>7}")
    for r in rows:
        print(f"{r['bound']:32} {r['stated_s']:9.2f} {r['actual_s']:9.2f} {r['error']:7.1%}")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    write_results(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
