"""Results of ``bench compare``: ratios against (a), the compare targets' checks, the printed table."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prefixgate.sdk.bench.stats import HEADLINE, fmt, lookup, print_table


def ratios(summaries: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """For each target: each headline figure divided by the first target's (a)."""
    keys = list(summaries)
    ref = summaries[keys[0]]
    out = {}
    for k in keys:
        row = {}
        for label, path, _, _ in HEADLINE:
            v, r = lookup(summaries[k], path), lookup(ref, path)
            row[label] = v / r if v is not None and r else None
        out[k] = row
    return out


def checks(summaries: dict[str, dict]) -> list[dict]:
    """The compare targets (the claims this benchmark exists to check), evaluated on this run where the targets exist.

    (a) vs (d): >= 3x output tokens/s and <= 1/5 of p99 TTFT; (a) vs (b): mean TTFT >= 80 %
    lower; (a) vs (c): higher output tokens/s and lower p99 TTFT.
    """

    def get(k: str, *path: str) -> float | None:
        return lookup(summaries[k], path) if k in summaries else None

    out = []

    def add(name: str, value: float | None, target: str, ok: bool | None) -> None:
        out.append({"check": name, "value": value, "target": target, "pass": ok})

    a_tp, a_p99, a_mean = (
        get("a", "output_throughput"),
        get("a", "ttft_ms", "p99"),
        get("a", "ttft_ms", "mean"),
    )
    if "d" in summaries and a_tp and a_p99:
        d_tp, d_p99 = get("d", "output_throughput"), get("d", "ttft_ms", "p99")
        tp = a_tp / d_tp if d_tp else None
        tt = a_p99 / d_p99 if d_p99 else None
        add("(a)/(d) output tokens/s", tp, ">= 3", tp is not None and tp >= 3)
        add("(a)/(d) p99 TTFT", tt, "<= 0.2", tt is not None and tt <= 0.2)
    if "b" in summaries and a_mean is not None:
        b_mean = get("b", "ttft_ms", "mean")
        red = 1 - a_mean / b_mean if b_mean else None
        add("(a) vs (b) mean TTFT reduction", red, ">= 0.8", red is not None and red >= 0.8)
    if "c" in summaries and a_tp and a_p99:
        c_tp, c_p99 = get("c", "output_throughput"), get("c", "ttft_ms", "p99")
        tp = a_tp / c_tp if c_tp else None
        tt = a_p99 / c_p99 if c_p99 else None
        add("(a)/(c) output tokens/s", tp, "> 1", tp is not None and tp > 1)
        add("(a)/(c) p99 TTFT", tt, "< 1", tt is not None and tt < 1)
    return out


def machine() -> dict:
    """The machine, in a few words (CPU count, model name, torch threads)."""
    info: dict = {"cpus": os.cpu_count(), "platform": sys.platform}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def title(doc: dict) -> str:
    """One line naming the model, the load and the workload's shared share."""
    load = doc["load"]
    shape = (
        f"concurrency {load['concurrency']}" if load["concurrency"] else f"rate {load['rate']}/s"
    )
    share = doc.get("shared_prefix") or {}
    s = ""
    if share.get("system_prompt_share"):
        s += f", system prompt {share['system_prompt_share'] * 100:.1f} % of prompt tokens"
    if share.get("share"):
        s += f" ({share['share'] * 100:.1f} % shared prefix)"
    return f"{Path(str(doc['model'])).name}: {load['num_requests']} requests, {shape}{s}"


def print_compare(doc: dict, summaries: dict[str, dict]) -> None:
    for r in doc["targets"]:
        if "error" in r:
            print(f"({r['target']}) {r['label']} failed: {r['error'][:300]}", file=sys.stderr)
    if not summaries:
        return
    names = list(summaries)
    rat = doc["ratios_vs_a"]
    rows = []
    for label, path, unit, _ in HEADLINE:
        row = [f"{label} ({unit})" if unit else label]
        for n in names:
            v = fmt(lookup(summaries[n], path), unit)
            q = rat.get(n, {}).get(label)
            row.append(v if n == names[0] or q is None else f"{v} ({q:.2f}x)")
        rows.append(row)
    metrics = {
        f"({r['target']}) {r['label']}": r.get("server_metrics") or {} for r in doc["targets"]
    }
    if any("prefixgate_engine_preemptions" in metrics.get(n, {}) for n in names):
        pre = [metrics.get(n, {}).get("prefixgate_engine_preemptions") for n in names]
        rows.append(["engine preemptions", *(fmt(int(v)) if v is not None else "-" for v in pre)])
    if any(summaries[n].get("errors") for n in names):
        rows.append(
            [
                "errors",
                *(
                    ", ".join(f"{k}: {v}" for k, v in summaries[n]["errors"].items()) or "-"
                    for n in names
                ),
            ]
        )
    print_table(title(doc) + " — ratio vs the first in ()", ["metric", *names], rows)
    for r in doc["targets"]:
        if r.get("note"):
            print(f"  note ({r['target']}) {r['label']}: {r['note']}")
    for c in doc["checks"]:
        v = "-" if c["value"] is None else f"{c['value']:.3f}"
        print(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['check']}: {v} (target {c['target']})")
