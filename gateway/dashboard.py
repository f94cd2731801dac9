"""The live page: ``GET /dashboard`` (HTML + JS, package data) and ``GET /dashboard/data`` (JSON).

A background task started with the app samples the gateway's own metrics every
``dashboard_sample_s`` seconds (2 s by default) into a ring buffer covering the last
``dashboard_window_s`` seconds (5 min): TTFT and TPOT percentiles (p50, p99), API requests/s,
generated tokens/s, the admission queue (queued and running requests), KV-cache usage and the
prefix hit rate (local mode: ``engine.stats()``), and per-key usage (requests and tokens per
API key *name*, never the key). The page polls ``/dashboard/data`` and draws small line charts
on ``<canvas>`` with its own few lines of JS: no build step, no outside network.

Percentiles are computed over the last ``quantile_window_s`` seconds (10 s) from the deltas
of the Prometheus histograms' cumulative bucket counts, interpolated linearly inside a bucket
as Prometheus' ``histogram_quantile`` does (so they are as coarse as the buckets). The prefix
hit rate is over the same window (hit tokens / looked-up tokens; ``null`` when nothing was
looked up). A value that cannot be known is ``null``: in proxy mode there is no engine (no KV
usage, no hit rate) and the gateway does not time upstream tokens (no TTFT/TPOT); tokens per
key there are the upstream's reported usage (none for an answer without usage); requests per
key and the queue are counted in both modes.

Auth: the page itself holds no numbers and is public; ``/dashboard/data`` needs a valid API
key (``Authorization: Bearer``) when the server has keys, like every other route but
``/health``, ``/ready`` and ``/metrics``. An operator's key (``role: "operator"``, or
``--api-key``) sees every key's name and usage; a tenant's key only its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from aiohttp import web
from prefixgate.gateway.http.errors import APIError, Handler, expect_continue
from prefixgate.gateway.http.metrics import GatewayMetrics
from prefixgate.gateway.http.request_account import ACCOUNT
from prefixgate.gateway.local.serving import LOCAL
from prefixgate.gateway.proxy.serving import PROXY
from prefixgate.gateway.state import STATE, GatewayState

logger = logging.getLogger("prefixgate.gateway")

_STATIC = {
    "dashboard.html": "text/html",
    "dashboard.js": "text/javascript",
}


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The ``q``-quantile of a histogram, as Prometheus' ``histogram_quantile``.

    Args:
        q: quantile in [0, 1].
        bounds: upper bounds of the buckets, increasing, the last one ``inf``.
        counts: cumulative observation counts per bucket (same length as ``bounds``).

    Returns:
        The quantile (linear interpolation inside its bucket, the first bucket's lower bound
        being 0; the largest finite bound when it falls in the ``+Inf`` bucket), or ``None``
        when the histogram is empty.

    Raises:
        ValueError: ``q`` outside [0, 1] or lengths that differ.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if len(bounds) != len(counts) or not bounds:
        raise ValueError("bounds and counts must be non-empty and of the same length")
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    for i, (upper, cum) in enumerate(zip(bounds, counts, strict=True)):
        if cum >= rank:
            if math.isinf(upper):
                return bounds[i - 1] if i > 0 else None
            lower = bounds[i - 1] if i > 0 else 0.0
            below = counts[i - 1] if i > 0 else 0.0
            inside = cum - below
            if inside <= 0:
                return upper
            return lower + (upper - lower) * (rank - below) / inside
    return bounds[-2] if len(bounds) > 1 else None


def _buckets(hist: Any) -> tuple[list[float], list[float]]:
    """(upper bounds, cumulative counts) of an unlabelled prometheus-client Histogram."""
    bounds, counts = [], []
    for fam in hist.collect():
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                bounds.append(float(s.labels["le"]))
                counts.append(s.value)
    return bounds, counts


def _by_label(counter: Any, *labels: str) -> dict[tuple[str, ...], float]:
    """Values of a labelled prometheus-client Counter, by label values."""
    out: dict[tuple[str, ...], float] = {}
    for fam in counter.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                out[tuple(s.labels[k] for k in labels)] = s.value
    return out


def _total(counter: Any) -> float:
    """Value of an unlabelled prometheus-client Counter."""
    for fam in counter.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                return s.value
    return 0.0


@dataclass(slots=True)
class _Totals:
    """Cumulative readings at one sample (differences of two give a window's figures)."""

    t: float  # monotonic seconds
    ttft: list[float]
    tpot: list[float]
    generated: float
    queries: float | None
    hits: float | None
    key_requests: dict[str, float] = field(default_factory=dict)
    key_tokens: dict[str, float] = field(default_factory=dict)


def _delta(new: Sequence[float], old: Sequence[float]) -> list[float]:
    return [a - b for a, b in zip(new, old, strict=True)] if len(new) == len(old) else list(new)


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(x, digits)


class DashboardSampler:
    """Ring buffer of dashboard samples, one every ``interval_s`` seconds over ``window_s``.

    ``interval_s > 0`` and ``window_s, quantile_window_s >= interval_s`` (``GatewaySettings``
    checks the first two; :func:`install` derives the third).
    """

    def __init__(
        self,
        st: GatewayState,
        interval_s: float = 2.0,
        window_s: float = 300.0,
        quantile_window_s: float = 10.0,
        app: web.Application | None = None,
    ) -> None:
        self.st = st
        self.app = app  # its LOCAL (engine stats) or PROXY part, once the mode sets it
        self.interval_s = interval_s
        self.window_s = window_s
        self.quantile_window_s = quantile_window_s
        self.samples: deque[dict[str, Any]] = deque(maxlen=max(1, round(window_s / interval_s)))
        self._totals: deque[_Totals] = deque(
            maxlen=max(2, round(quantile_window_s / interval_s) + 1)
        )
        self._task: asyncio.Task | None = None

    def _read(self) -> tuple[_Totals, dict[str, Any] | None]:
        m: GatewayMetrics = self.st.metrics
        stats = None
        local = self.app.get(LOCAL) if self.app is not None else None
        if local is not None and local.engine is not None:
            try:
                stats = local.engine.stats()
            except Exception:  # noqa: BLE001 - the dashboard never fails because of the engine
                stats = None
        requests = {k[0]: v for k, v in _by_label(m.key_requests, "key").items()}
        tokens: dict[str, float] = {}
        for (key, _kind), v in _by_label(m.key_tokens, "key", "kind").items():
            tokens[key] = tokens.get(key, 0.0) + v
        totals = _Totals(
            t=time.monotonic(),
            ttft=_buckets(m.ttft)[1],
            tpot=_buckets(m.tpot)[1],
            generated=_total(m.generation_tokens),
            queries=_num(stats, "prefix_cache_queries"),
            hits=_num(stats, "prefix_cache_hits"),
            key_requests=requests,
            key_tokens=tokens,
        )
        return totals, stats

    def sample(self) -> dict[str, Any]:
        """Read the metrics now, append one sample to the ring buffer and return it."""
        now, stats = self._read()
        prev = self._totals[-1] if self._totals else None
        first = self._totals[0] if self._totals else None
        self._totals.append(now)
        m = self.st.metrics
        adm = self.st.admission
        sample: dict[str, Any] = {
            "t": round(time.time(), 3),
            "queued": adm.queued_requests,
            "running": adm.in_flight - adm.queued_requests,
            "kv_usage": None,
            "prefix_hit_rate": None,
            "ttft_p50": None,
            "ttft_p99": None,
            "tpot_p50": None,
            "tpot_p99": None,
            "requests_per_s": None,
            "tokens_per_s": None,
            "keys": {},
        }
        used, total = _num(stats, "kv_blocks_used"), _num(stats, "kv_blocks_total")
        if used is not None and total:
            sample["kv_usage"] = _round(used / total, 4)
        if first is not None:
            bounds = _buckets(m.ttft)[0]
            tb = _buckets(m.tpot)[0]
            for name, b, new, old in (
                ("ttft", bounds, now.ttft, first.ttft),
                ("tpot", tb, now.tpot, first.tpot),
            ):
                d = _delta(new, old)
                sample[f"{name}_p50"] = _round(histogram_quantile(0.5, b, d))
                sample[f"{name}_p99"] = _round(histogram_quantile(0.99, b, d))
            if now.queries is not None and first.queries is not None and first.hits is not None:
                dq = now.queries - first.queries
                if dq > 0 and now.hits is not None:
                    sample["prefix_hit_rate"] = _round((now.hits - first.hits) / dq, 4)
        if prev is not None and now.t > prev.t:
            dt = now.t - prev.t
            reqs = {k: v - prev.key_requests.get(k, 0.0) for k, v in now.key_requests.items()}
            toks = {k: v - prev.key_tokens.get(k, 0.0) for k, v in now.key_tokens.items()}
            sample["requests_per_s"] = _round(sum(reqs.values()) / dt, 3)
            sample["tokens_per_s"] = _round((now.generated - prev.generated) / dt, 3)
            sample["keys"] = {
                _shown_key(k): {"requests": int(reqs.get(k, 0)), "tokens": int(toks.get(k, 0))}
                for k in now.key_requests
            }
        self.samples.append(sample)
        return sample

    def snapshot(self, own: str | None = None) -> dict[str, Any]:
        """The JSON of ``/dashboard/data``: settings, the samples and per-key totals — of
        every key, or with ``own`` (a tenant key's name) of that key only."""
        m = self.st.metrics
        reqs = _by_label(m.key_requests, "key")
        toks = _by_label(m.key_tokens, "key", "kind")
        keys = {
            _shown_key(k): {
                "requests": int(v),
                "prompt_tokens": int(toks.get((k, "prompt"), 0)),
                "completion_tokens": int(toks.get((k, "completion"), 0)),
            }
            for (k,), v in sorted(reqs.items())
            if own is None or k == own
        }
        samples = list(self.samples)
        if own is not None:
            samples = [
                {**x, "keys": {k: v for k, v in x["keys"].items() if k == own}} for x in samples
            ]
        return {
            "mode": "upstream" if self.app is not None and PROXY in self.app else "local",
            "model": self.st.model_name,
            "ready": self.st.ready,
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "quantile_window_s": self.quantile_window_s,
            "samples": samples,
            "keys": keys,
        }

    async def run(self) -> None:
        """Sample every ``interval_s`` seconds until cancelled (a failed read is logged)."""
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a bad read must not stop the sampling
                logger.exception("dashboard sample failed")
            await asyncio.sleep(self.interval_s)

    async def start(self, app: web.Application) -> None:
        """``on_startup``: start the sampling task."""
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self, app: web.Application) -> None:
        """``on_cleanup``: stop the sampling task."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def _num(stats: dict[str, Any] | None, key: str) -> float | None:
    value = stats.get(key) if stats else None
    return float(value) if isinstance(value, int | float) else None


def _shown_key(name: str) -> str:
    """The key's display name: ``anonymous`` on an open gateway (logged as ``-``)."""
    return "anonymous" if name in ("-", "") else name


API_PATHS = ("/v1/", "/v1beta/")  # the API routes of every dialect (Gemini's under /v1beta/)

SAMPLER: web.AppKey[DashboardSampler] = web.AppKey("prefixgate_dashboard", DashboardSampler)


@web.middleware
async def usage_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count each finished ``POST /v1/...`` or ``/v1beta/...`` (Gemini's) request against its
    key's name (requests, and the prompt + completion tokens of its ``RequestAccount``: the
    engine's counts in local mode, the upstream's reported usage in proxy mode), once the
    handler is done (streams included). Requests refused before authentication (401) have no
    key and are not counted. The account's ``status`` is noted here when the handler did not
    (an error raised: its status; cancelled: 499, the client left; anything else: 500)."""
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except (APIError, web.HTTPException) as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client left first (nginx's "client closed request")
        raise
    finally:
        acct = request.get(ACCOUNT)
        if acct is not None and acct.status is None:
            acct.status = status
        if request.method == "POST" and request.path.startswith(API_PATHS) and acct is not None:
            request.app[STATE].metrics.count_key_request(acct)


def static_file(name: str) -> bytes:
    """A file of ``prefixgate.gateway``'s ``static/`` package data.

    Raises:
        FileNotFoundError: no such file in the installed package.
    """
    return resources.files("prefixgate.gateway").joinpath("static", name).read_bytes()


def install(app: web.Application) -> None:
    """Add ``/dashboard``, its script and ``/dashboard/data``, and the sampling task."""
    st = app[STATE]
    s = st.settings
    sampler = DashboardSampler(
        st, s.dashboard_sample_s, s.dashboard_window_s, max(10.0, s.dashboard_sample_s), app
    )
    app[SAMPLER] = sampler
    app.on_startup.append(sampler.start)
    app.on_cleanup.append(sampler.stop)
    r = app.router
    r.add_get("/dashboard", page, expect_handler=expect_continue)
    r.add_get("/dashboard/dashboard.js", script, expect_handler=expect_continue)
    r.add_get("/dashboard/data", data, expect_handler=expect_continue)


def _static(name: str) -> web.Response:
    return web.Response(
        body=static_file(name),
        content_type=_STATIC[name],
        charset="utf-8",
        headers={"Cache-Control": "no-cache"},
    )


async def page(request: web.Request) -> web.Response:
    """GET /dashboard: the page (public: it holds no numbers)."""
    return _static("dashboard.html")


async def script(request: web.Request) -> web.Response:
    """GET /dashboard/dashboard.js: the page's script."""
    return _static("dashboard.js")


async def data(request: web.Request) -> web.Response:
    """GET /dashboard/data: the samples as JSON (a valid key when the server has keys).

    Raises:
        APIError: 401 ``invalid_api_key`` when keys are configured and none valid is sent.
    """
    st = request.app[STATE]
    principal = st.keys.authenticate(request)
    own = None if principal.operator else principal.name
    return web.json_response(
        request.app[SAMPLER].snapshot(own), headers={"Cache-Control": "no-store"}
    )
