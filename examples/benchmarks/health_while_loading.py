"""Does the server answer while its model loads? ``/health`` latency during the load.

Starts ``prefixgate serve --model MODEL --load-format dummy`` (default: the
``smollm2-135m-shape`` folder of ``../shared/models``, 134.5 M parameters of random weights,
CPU) as its own process and probes ``GET /health`` every ``--interval-ms`` (20) from the moment
the port answers until ``/ready`` turns 200 (the load ended). Prints the load's duration, the
number of probes, their latency (p50, p99, max, in ms) and how many took over 100 ms, and the
longest gap between two answers (a stalled event loop shows as a gap far above the interval).
Then, as a control, as many probes again on the loaded, idle server: on a busy machine, what
the load adds is the difference between the two.

    python -m examples.benchmarks.health_while_loading [--model PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prefixgate.sdk.bench.targets import free_port

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / ".." / "shared/models/smollm2-135m-shape"


def _figures(latencies: list[float], answers: list[float]) -> dict:
    gaps = [(b - a) * 1000 for a, b in zip(answers, answers[1:], strict=False)]
    ordered = sorted(latencies)
    worst = max(range(len(latencies)), key=latencies.__getitem__)
    return {
        "probes": len(latencies),
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max_ms": ordered[-1],
        "max_at_s": answers[worst] - answers[0],
        "over_100ms": sum(x > 100 for x in latencies),
        "longest_gap_ms": max(gaps, default=0.0),
    }


def _line(name: str, f: dict) -> str:
    return (
        f"{name}: {f['probes']} /health probes: p50 {f['p50_ms']:.1f} p99 {f['p99_ms']:.1f} "
        f"max {f['max_ms']:.1f} ms (at +{f['max_at_s']:.1f} s), {f['over_100ms']} over 100 ms, "
        f"longest gap between answers {f['longest_gap_ms']:.0f} ms"
    )


def probe(model: str, interval_s: float, serve_args: list[str], timeout_s: float) -> dict:
    """Probe one server start, then as many probes once it is ready (the control); the
    figures as a dict (latencies in ms, times in s)."""
    port = free_port()
    cmd = [sys.executable, "-m", "prefixgate.gateway.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--model", model, "--load-format", "dummy", *serve_args]
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would stall it
    t_spawn = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    latencies: list[float] = []
    answers: list[float] = []
    ready_at = bound_at = None
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(
                        f"prefixgate serve exited with {proc.returncode}: {log.read()}"
                    )
                t = time.monotonic()
                try:
                    r = http.get("/health")
                except httpx.TransportError:
                    time.sleep(interval_s)
                    continue
                done = time.monotonic()
                bound_at = bound_at or t
                latencies.append((done - t) * 1000)
                answers.append(done)
                assert r.status_code == 200, r.text
                if http.get("/ready").status_code == 200:
                    ready_at = time.monotonic()
                    break
                time.sleep(max(0.0, interval_s - (time.monotonic() - t)))
            control: list[float] = []
            control_answers: list[float] = []
            for _ in range(len(latencies)):
                t = time.monotonic()
                http.get("/health")
                control_answers.append(time.monotonic())
                control.append((control_answers[-1] - t) * 1000)
                time.sleep(max(0.0, interval_s - (time.monotonic() - t)))
    finally:
        proc.terminate()
        proc.wait(30)
    if ready_at is None or bound_at is None:
        raise SystemExit(f"not ready within {timeout_s:.0f} s")
    return {
        "model": model,
        "bound_after_s": bound_at - t_spawn,
        "ready_after_s": ready_at - t_spawn,
        "loading": _figures(latencies, answers),
        "ready": _figures(control, control_answers),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL.resolve()))
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--serve-args", default="", help="more `prefixgate serve` flags")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = []
    for _ in range(args.runs):
        res = probe(args.model, args.interval_ms / 1000, args.serve_args.split(), args.timeout_s)
        results.append(res)
        print(
            f"bound {res['bound_after_s']:.2f} s, ready {res['ready_after_s']:.2f} s after spawn",
            _line("while loading", res["loading"]),
            _line("once ready (control)", res["ready"]),
            sep="\n",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
