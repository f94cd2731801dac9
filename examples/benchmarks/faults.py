"""Faults: what clients see when other clients, the server's own stop, or an upstream misbehave.

Every part starts ``prefixgate serve`` as its own process (the built-in ``tiny-random``
model, loopback only) and prints what each client received:

1. **Slow headers**: ``--slow`` connections (1,000) each send one header byte every second
   and never finish their headers, started while the model is still loading. Figures: how
   many the server closed and when (vs ``--header-timeout-s``), the time to ``/ready``, and
   ``/health`` latency (p50/p99, failures) during the attack.
2. **Over-context bodies**: 12 concurrent 3.9 MB chat bodies (under the 4 MiB body limit, far
   over the context) with one small chat request beside them. Figures: each big one's
   status and latency, the server's memory (RSS) before/after and its peak growth, the small
   request's latency.
3. **SIGTERM**: 6 long requests in flight (3 streamed, 3 not) with ``--shutdown-grace-s 2``;
   what each client saw (its ending) and the time from SIGTERM to the process's exit.
4. **Proxy fault matrix**: ``prefixgate serve --upstream`` in front of ``fault_upstream``
   (HTML 200, garbage, clean EOF without [DONE], stall, reset mid-stream) and of a dead
   upstream (down at start), streamed and not: the client's status and ending; a *silent
   truncation* (a 200 that ends without [DONE] and without an error event, or a 200 body
   that is not a completion) is counted and must be 0.

Bounded: about 1-2 minutes on a 2-core machine.

    python -m examples.benchmarks.faults [--slow 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx
from prefixgate.sdk.bench.targets import free_port

from examples.benchmarks.fault_upstream import FaultUpstream

HOST = "127.0.0.1"


class Server:
    """``prefixgate serve`` in its own process (stderr to a temp file)."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "prefixgate.gateway.cli", "serve", "--host", HOST]
        cmd += ["--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log, text=True)

    def wait(self, path: str = "/ready", timeout: float = 120.0) -> float:
        """Seconds until ``path`` answers 200."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {open(self.log.name).read()[-2000:]}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{path} not 200 after {timeout} s")

    def rss_mb(self) -> tuple[float, float]:
        """(current RSS, peak RSS) of the server process in MB."""
        fields = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields[name] = value
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


# --- 1. slow headers ----------------------------------------------------------------------


async def _slow_client(port: int, stop_at: float, lifetimes: list[float]) -> None:
    """One attacker slot until ``stop_at``: a connection that sends one header byte a second
    and never ends its headers; when the server closes it, the next one opens. Appends each
    connection's lifetime (-age: still open at the end, -1: refused)."""
    while time.monotonic() < stop_at:
        t0 = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            lifetimes.append(-1.0)
            await asyncio.sleep(0.1)
            continue
        try:
            writer.write(b"GET /health HTTP/1.1\r\n")
            while time.monotonic() < stop_at:
                try:
                    if not await asyncio.wait_for(reader.read(1024), 1.0):
                        break  # closed by the server
                except TimeoutError:
                    writer.write(b"X")  # one more header byte, never the end of the headers
                    await writer.drain()
            else:
                lifetimes.append(-max(time.monotonic() - t0, 1.01))  # still open: -age
                return
            lifetimes.append(time.monotonic() - t0)
        except OSError:
            lifetimes.append(time.monotonic() - t0)
        finally:
            writer.close()


def _attack(port: int, n: int, window_s: float, results: Any) -> None:
    """The slow-header clients, in their own process (their 1,000 wake-ups a second must not
    slow the /health prober's own process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    closed: list[float] = []

    async def attack() -> None:
        stop_at = time.monotonic() + window_s
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(_slow_client(port, stop_at, closed)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)

    asyncio.run(attack())
    results.put(closed)


def slow_headers(n: int, header_timeout_s: float) -> dict[str, Any]:
    srv = Server("--header-timeout-s", str(header_timeout_s))
    try:
        srv.wait("/health")
        health: list[float] = []
        when: list[float] = []
        failures = 0
        window = max(20.0, 3 * header_timeout_s)  # the attack outlasts the model load

        def probe() -> None:
            nonlocal failures
            end = time.monotonic() + window - 1.0
            with httpx.Client(timeout=5.0) as c:
                while time.monotonic() < end:
                    t = time.monotonic()
                    try:
                        ok = c.get(srv.url + "/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if ok:
                        health.append(time.monotonic() - t)
                        when.append(t)
                    else:
                        failures += 1
                    time.sleep(0.05)

        prober = threading.Thread(target=probe)
        prober.start()
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        attacker = ctx.Process(target=_attack, args=(srv.port, n, window, queue))
        attacker.start()
        t_attack = time.monotonic()
        ready_s = srv.wait("/ready")
        t_ready = t_attack + ready_s
        prober.join()
        closed: list[float] = queue.get(timeout=window + 60)
        attacker.join(30)
        after = [h for h, t in zip(health, when, strict=True) if t > t_ready]
        during = [h for h, t in zip(health, when, strict=True) if t <= t_ready]
        still_open = [-c for c in closed if c < -1.0]  # ages of those open when it ended
        open_at_end = sum(1 for c in still_open if c > header_timeout_s + 1.0)
        refused = sum(1 for c in closed if c == -1.0)
        times = [c for c in closed if c >= 0]
        return {
            "connections": n,
            "header_timeout_s": header_timeout_s,
            "closed_by_server": len(times),
            "refused": refused,
            "open_past_timeout_at_end": open_at_end,
            "open_at_end": len(still_open),
            "close_s_max": max(times) if times else None,
            "close_s_p50": _pct(times, 50),
            "ready_after_start_s": ready_s,
            "attack_s": window,
            "health_p50_ms": _pct(health, 50) * 1000,
            "health_p99_ms": _pct(health, 99) * 1000,
            "health_p99_ms_loaded": _pct(after, 99) * 1000,
            "health_p99_ms_loading": _pct(during, 99) * 1000,
            "health_failures": failures,
            "health_probes": len(health) + failures,
        }
    finally:
        srv.stop()


# --- 2. over-context bodies ---------------------------------------------------------------


def over_context(n: int = 12, size: int = 3_900_000) -> dict[str, Any]:
    srv = Server("--max-body-bytes", "4MiB")
    try:
        srv.wait()
        rss0, _ = srv.rss_mb()
        big = json.dumps(
            {"model": "tiny-random", "messages": [{"role": "user", "content": "x" * size}]}
        ).encode()
        small = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}]}
        small["max_tokens"] = 8

        async def run() -> tuple[list[tuple[int, str, float]], float, float]:
            limits = httpx.Limits(max_connections=n + 2)
            async with httpx.AsyncClient(timeout=120, limits=limits) as c:

                async def one_big() -> tuple[int, str, float]:
                    t = time.monotonic()
                    r = await c.post(
                        srv.url + "/v1/chat/completions",
                        content=big,
                        headers={"Content-Type": "application/json"},
                    )
                    code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
                    return r.status_code, code, time.monotonic() - t

                async def one_small(delay: float = 0.0) -> float:
                    await asyncio.sleep(delay)
                    t = time.monotonic()
                    r = await c.post(srv.url + "/v1/chat/completions", json=small)
                    return time.monotonic() - t if r.status_code == 200 else float("nan")

                alone = await one_small()  # its baseline, then beside the big ones
                *bigs, beside = await asyncio.gather(
                    *(one_big() for _ in range(n)), one_small(0.05)
                )
                return bigs, alone, beside

        results, baseline, beside = asyncio.run(run())
        time.sleep(0.5)
        rss1, peak = srv.rss_mb()
        lat = [r[2] for r in results]
        return {
            "bodies": n,
            "body_mb": len(big) / 1e6,
            "statuses": sorted({f"{s} {c}" for s, c, _ in results}),
            "latency_s_max": max(lat),
            "latency_s_p50": _pct(lat, 50),
            "rss_before_mb": rss0,
            "rss_after_mb": rss1,
            "rss_peak_growth_mb": peak - rss0,
            "small_request_alone_s": baseline,
            "small_request_beside_s": beside,
        }
    finally:
        srv.stop()


# --- 3. SIGTERM ---------------------------------------------------------------------------


def sigterm(grace_s: float = 2.0) -> dict[str, Any]:
    srv = Server("--shutdown-grace-s", str(grace_s), "--max-model-len", "2048")
    try:
        srv.wait()
        seen: dict[str, str] = {}
        body = {
            "model": "tiny-random",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2000,
            "ignore_eos": True,
        }

        def streamed(i: int) -> None:
            last = ""
            try:
                with httpx.stream(
                    "POST",
                    srv.url + "/v1/chat/completions",
                    json={**body, "stream": True},
                    timeout=60,
                ) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            last = line[6:]
                if last == "[DONE]":
                    seen[f"stream {i}"] = "[DONE]"
                elif last.startswith('{"error"'):
                    seen[f"stream {i}"] = "error event: " + json.loads(last)["error"]["code"]
                else:
                    seen[f"stream {i}"] = "SILENT TRUNCATION"
            except httpx.HTTPError as exc:
                seen[f"stream {i}"] = f"connection error: {type(exc).__name__}"

        def plain(i: int) -> None:
            try:
                r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
                code = r.json()["error"]["code"] if r.status_code != 200 else "completion"
                seen[f"non-stream {i}"] = f"{r.status_code} {code}"
            except httpx.HTTPError as exc:
                seen[f"non-stream {i}"] = f"connection error: {type(exc).__name__}"

        threads = [threading.Thread(target=streamed, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=plain, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(30)
        exit_s = time.monotonic() - t0
        for t in threads:
            t.join(30)
        return {
            "grace_s": grace_s,
            "exit_s": exit_s,
            "exit_code": code,
            "clients": dict(sorted(seen.items())),
        }
    finally:
        srv.stop()


# --- 4. proxy fault matrix ----------------------------------------------------------------


def _client_view(url: str, stream: bool) -> tuple[str, bool]:
    """(what the client received, silent truncation?)."""
    body = {"model": "fault", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    t = time.monotonic()
    try:
        if not stream:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            took = time.monotonic() - t
            if r.status_code == 200:
                ok = isinstance(r.json().get("choices"), list)
                return f"200 completion ({took:.1f} s)", not ok
            return f"{r.status_code} {r.json()['error']['code']} ({took:.1f} s)", False
        last, keepalives = "", 0
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            if r.status_code != 200:
                r.read()
                return f"{r.status_code} {r.json()['error']['code']}", False
            for line in r.iter_lines():
                if line.startswith("data: "):
                    last = line[6:]
                elif line.startswith(":"):
                    keepalives += 1
        took = time.monotonic() - t
        extra = f", {keepalives} keep-alives" if keepalives else ""
        if last == "[DONE]":
            return f"200 ... [DONE] ({took:.1f} s{extra})", False
        if last.startswith('{"error"'):
            code = json.loads(last)["error"]["code"]
            return f"200 ... error event {code} ({took:.1f} s{extra})", False
        return f"200 ... ends without [DONE] or error ({took:.1f} s)", True
    except httpx.HTTPError as exc:
        return f"connection error {type(exc).__name__}", False


def proxy_matrix(idle_timeout_s: float = 2.0) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    silent = 0
    with FaultUpstream("ok", chunks=4, delay_s=0.05) as up:
        srv = Server(
            "--upstream",
            up.url,
            "--upstream-timeout-s",
            str(idle_timeout_s),
            "--keepalive-s",
            "0.5",
            "--health-interval-s",
            "0.2",
        )
        try:
            srv.wait()
            for mode in ("ok", "html200", "garbage", "eof", "stall", "kill"):
                row: dict[str, Any] = {"upstream": mode}
                for stream in (False, True):
                    up.mode = mode
                    srv.wait(timeout=10)  # back in rotation after the previous case
                    seen, truncated = _client_view(srv.url, stream)
                    silent += truncated
                    row["stream" if stream else "non-stream"] = seen
                rows.append(row)
        finally:
            srv.stop()
    dead = Server("--upstream", f"http://{HOST}:{free_port()}", "--health-interval-s", "30")
    try:
        dead.wait("/health")
        ready = httpx.get(dead.url + "/ready", timeout=5).status_code
        row = {"upstream": f"down at start (/ready {ready})"}
        for stream in (False, True):
            seen, truncated = _client_view(dead.url, stream)
            silent += truncated
            row["stream" if stream else "non-stream"] = seen
        rows.append(row)
    finally:
        dead.stop()
    return {"idle_timeout_s": idle_timeout_s, "rows": rows, "silent_truncations": silent}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slow", type=int, default=1000, help="slow-header connections")
    p.add_argument("--header-timeout-s", type=float, default=5.0)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--only", default="", help="comma list of parts: slow,big,sigterm,proxy")
    args = p.parse_args(argv)
    parts = set(args.only.split(",")) if args.only else {"slow", "big", "sigterm", "proxy"}
    out: dict[str, Any] = {}
    if "slow" in parts:
        s = out["slow_headers"] = slow_headers(args.slow, args.header_timeout_s)
        print(
            f"\n1. {s['connections']} slow-header connections held for {s['attack_s']:g} s "
            f"(each reopened when closed), header timeout {s['header_timeout_s']:g} s"
        )
        print(
            f"   closed by the server: {s['closed_by_server']} (lifetime max "
            f"{s['close_s_max']:.1f} s, p50 {s['close_s_p50']:.1f} s), refused {s['refused']}, "
            f"open past the timeout at the end {s['open_past_timeout_at_end']} "
            f"(of {s['open_at_end']} open)"
        )
        print(
            f"   /ready {s['ready_after_start_s']:.1f} s after the attack began; /health "
            f"p50 {s['health_p50_ms']:.1f} ms, p99 {s['health_p99_ms']:.1f} ms (p99 while the "
            f"model loads {s['health_p99_ms_loading']:.1f} ms, after {s['health_p99_ms_loaded']:.1f}"
            f" ms), {s['health_failures']} failed of {s['health_probes']}"
        )
    if "big" in parts:
        b = out["over_context"] = over_context()
        print(f"\n2. {b['bodies']} concurrent {b['body_mb']:.1f} MB over-context chat bodies")
        print(
            f"   answers: {', '.join(b['statuses'])}; latency p50 {b['latency_s_p50']:.2f} s, "
            f"max {b['latency_s_max']:.2f} s"
        )
        print(
            f"   server RSS {b['rss_before_mb']:.0f} -> {b['rss_after_mb']:.0f} MB (peak growth "
            f"{b['rss_peak_growth_mb']:.0f} MB); small request {b['small_request_alone_s']:.2f} s "
            f"alone, {b['small_request_beside_s']:.2f} s beside them"
        )
    if "sigterm" in parts:
        t = out["sigterm"] = sigterm()
        print(f"\n3. SIGTERM with 6 long requests in flight, grace {t['grace_s']:g} s")
        print(f"   exit {t['exit_s']:.2f} s after SIGTERM (code {t['exit_code']})")
        for name, seen in t["clients"].items():
            print(f"   {name:<13} {seen}")
    if "proxy" in parts:
        m = out["proxy"] = proxy_matrix()
        print(f"\n4. proxy fault matrix (upstream idle timeout {m['idle_timeout_s']:g} s)")
        print("| upstream | non-stream: client gets | stream: client gets |")
        print("|---|---|---|")
        for row in m["rows"]:
            print(f"| {row['upstream']} | {row['non-stream']} | {row['stream']} |")
        print(f"   silent truncations: {m['silent_truncations']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
