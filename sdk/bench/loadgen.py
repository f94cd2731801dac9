"""Load generator: sends a workload to an OpenAI-compatible server through the prefixgate SDK.

Each request is a streaming chat completion (``stream=True``, ``stream_options.include_usage``,
``temperature=0``); the generator timestamps every chunk to measure TTFT, ITL, TPOT and E2E
(definitions in :mod:`prefixgate.sdk.bench.stats`). Arrivals are a Poisson process at
``rate`` requests/s, or as fast as ``concurrency`` allows (closed loop: a user sends the next
request when the previous one ends), or both (Poisson, at most ``concurrency`` in flight, as
vLLM's ``--max-concurrency``). The SDK client runs with ``max_retries=0`` so every failure is
counted, by kind, instead of hidden behind a retry.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixgate.sdk.bench.stats import RequestResult, summarize
from prefixgate.sdk.bench.workload import BenchRequest, poisson_arrivals


@dataclass(slots=True)
class LoadConfig:
    """How to send a workload.

    Attributes:
        base_url: the server's root URL (``http://127.0.0.1:8000``; a trailing ``/v1`` is fine).
        model: model name to request; ``None`` asks ``GET /v1/models`` and takes the first.
        api_key: bearer key, or ``None``.
        rate: Poisson arrival rate in requests/s; ``None`` (or ``inf``) sends at once.
        concurrency: most requests in flight; ``None`` means no bound (all of them).
        seed: seed of the Poisson arrivals.
        timeout_s: per-request timeout in seconds (connect to end of stream).
        progress: show a progress bar (tqdm) on stderr.
        extra_body: extra fields merged into every request body (e.g. ``{"ignore_eos": True}``).
    """

    base_url: str
    model: str | None = None
    api_key: str | None = None
    rate: float | None = None
    concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True
    extra_body: dict | None = None

    def __post_init__(self) -> None:
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")


@dataclass(slots=True)
class LoadResult:
    """A finished run: per-request results, the wall time (seconds) and the model used."""

    results: list[RequestResult]
    duration_s: float
    model: str

    def summary(self) -> dict:
        """See :func:`prefixgate.sdk.bench.stats.summarize`."""
        return summarize(self.results, self.duration_s)


def root_url(base_url: str) -> str:
    """``base_url`` without a trailing ``/`` or ``/v1`` (the SDK adds ``/v1/...`` itself)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def error_kind(exc: BaseException) -> str:
    """A short kind for the error table: the class name with the HTTP status and the OpenAI
    error ``code`` when known, e.g. ``"BadRequestError(400, context_length_exceeded)"``."""
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    code = getattr(exc, "code", None)
    detail = ", ".join(str(x) for x in (status, code) if x is not None)
    name = type(exc).__name__
    return f"{name}({detail})" if detail else name


def _usage_fields(usage: Any) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, completion_tokens, cached_tokens) of a usage object or dict."""

    def get(obj: Any, key: str) -> Any:
        if obj is None:
            return None
        return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

    details = get(usage, "prompt_tokens_details")
    return (
        get(usage, "prompt_tokens"),
        get(usage, "completion_tokens"),
        get(details, "cached_tokens"),
    )


async def send_one(
    client: Any, model: str, req: BenchRequest, extra_body: dict | None = None
) -> RequestResult:
    """Send one streaming chat completion and time its chunks (never raises for API errors).

    ``client`` is a ``prefixgate.sdk.AsyncClient``. ``start`` of the result is the absolute
    ``perf_counter`` at send (the caller rebases it).
    """
    res = RequestResult(index=req.index, ok=False)
    start = time.perf_counter()
    res.start = start
    first: float | None = None
    last: float | None = None
    chunks = 0
    completion_tokens = None
    kwargs: dict[str, Any] = {
        "model": model,
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if extra_body:
        kwargs["extra_body"] = extra_body
    try:
        stream = client.chat.completions.create(**kwargs)
        if inspect.isawaitable(stream):
            stream = await stream
        async for chunk in stream:
            now = time.perf_counter()
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                res.prompt_tokens, completion_tokens, res.cached_tokens = _usage_fields(usage)
            for choice in getattr(chunk, "choices", None) or []:
                delta = getattr(choice, "delta", None)
                if getattr(delta, "content", None):
                    if first is None:
                        first = now
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                elif first is None and getattr(choice, "finish_reason", None):
                    first = last = now  # ended without content: TTFT is the end
        res.e2e = time.perf_counter() - start
        res.ttft = (first - start) if first is not None else res.e2e
        res.output_tokens = completion_tokens if completion_tokens is not None else chunks
        res.ok = True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # counted by kind, the run goes on
        res.error = error_kind(exc)
        res.error_message = str(exc)[:300]
    return res


async def resolve_model(client: Any, model: str | None) -> str:
    """``model``, or the first id of ``GET /v1/models``.

    Raises:
        ValueError: the server lists no model.
    """
    if model:
        return model
    page = client.models.list()
    if inspect.isawaitable(page):
        page = await page
    data = getattr(page, "data", page)
    ids = [getattr(m, "id", None) or (m.get("id") if isinstance(m, dict) else None) for m in data]
    ids = [i for i in ids if i]
    if not ids:
        raise ValueError("the server lists no model; pass --model")
    return ids[0]


def make_client(cfg: LoadConfig, max_concurrency: int) -> Any:
    """A ``prefixgate.sdk.AsyncClient`` for a benchmark: no retries, pool sized to the load."""
    from prefixgate.sdk import AsyncClient

    return AsyncClient(
        root_url(cfg.base_url) + "/v1",
        api_key=cfg.api_key,
        max_concurrency=max_concurrency,
        max_retries=0,
        timeout=cfg.timeout_s,
    )


async def run_load(
    requests: list[BenchRequest],
    cfg: LoadConfig,
    on_done: Callable[[RequestResult], None] | None = None,
) -> LoadResult:
    """Send ``requests`` as ``cfg`` says and gather their results (input order).

    Raises:
        ValueError: no request, or the server lists no model.
        prefixgate.sdk.APIError: listing the models failed (when ``cfg.model`` is ``None``).
    """
    if not requests:
        raise ValueError("the workload has no request")
    n = len(requests)
    limit = min(cfg.concurrency or n, n)
    client = make_client(cfg, max_concurrency=limit)
    try:
        model = await resolve_model(client, cfg.model)
        sem = asyncio.Semaphore(limit)
        arrivals = poisson_arrivals(cfg.rate, n, cfg.seed) if cfg.rate else [0.0] * n
        bar = _progress(n, cfg.progress)
        t0 = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                res = await send_one(client, model, req, cfg.extra_body)
            res.start -= t0
            if bar is not None:
                bar.update(1)
            if on_done is not None:
                on_done(res)
            return res

        try:
            results = await asyncio.gather(
                *(one(r, a) for r, a in zip(requests, arrivals, strict=True))
            )
        finally:
            if bar is not None:
                bar.close()
        duration = time.perf_counter() - t0
    finally:
        await client.close()
    return LoadResult(list(results), duration, model)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", leave=False)
