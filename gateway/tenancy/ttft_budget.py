"""TTFT budgets: a request may say how long it is willing to wait for its first token
(header ``x-prefixgate-ttft-budget-ms``, milliseconds); when the engine predicts a longer wait
it is refused at once with 429 ``ttft_budget_exceeded`` and a ``Retry-After``, instead of
queueing to fail late.

The prediction is the engine's ``predict_ttft`` (``engine/scheduler.estimate_ttft``: queued
prefill over the measured prefill rate, running decodes over the decode rate, and the wait for
a free seat). Until the engine has measured its rates it predicts nothing and every request
is admitted (the answer then has no ``x-prefixgate-predicted-ttft-ms``). ``Retry-After`` is the
predicted wait beyond the budget: the time for the queue ahead to drain by that much, at the
rates measured now.
"""

from __future__ import annotations

import math

from aiohttp import web
from prefixgate.engine.protocol import EngineClient
from prefixgate.gateway.http.errors import APIError, bad_request

BUDGET_HEADER = "x-prefixgate-ttft-budget-ms"
MAX_BUDGET_MS = 3_600_000.0  # one hour: a larger budget is no budget


def budget_s(request: web.Request) -> float | None:
    """The request's TTFT budget in seconds, or ``None`` without the header.

    Raises:
        APIError: 400 naming the header when it is not a number of milliseconds in
            (0, 3,600,000].
    """
    raw = request.headers.get(BUDGET_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= MAX_BUDGET_MS:  # also NaN and inf
        raise bad_request(
            f"{BUDGET_HEADER} must be a number of milliseconds in (0, {MAX_BUDGET_MS:.0f}], "
            f"got {raw[:40]!r}",
            param=BUDGET_HEADER,
            code="invalid_header",
        )
    return ms / 1000.0


def check_budget(request: web.Request, engine: EngineClient, prompt_tokens: int) -> float | None:
    """Refuse the request when its predicted TTFT exceeds its budget; the prediction (seconds,
    ``None`` when no budget was asked for or the engine cannot predict yet).

    Raises:
        APIError: 400 for a malformed budget header; 429 ``ttft_budget_exceeded`` with
            ``Retry-After`` = predicted wait - budget (at least 1 s).
    """
    budget = budget_s(request)
    if budget is None:
        return None
    predicted = engine.predict_ttft(max(1, prompt_tokens))
    if predicted is None:
        return None
    if predicted > budget:
        wait = predicted - budget if math.isfinite(predicted) else 60.0
        raise APIError(
            429,
            f"the predicted time to first token ({_ms(predicted)} ms) exceeds this request's "
            f"budget ({_ms(budget)} ms, {BUDGET_HEADER}); retry later",
            code="ttft_budget_exceeded",
            retry_after=max(1.0, wait),
        )
    return predicted


def _ms(seconds: float) -> str:
    return "inf" if not math.isfinite(seconds) else f"{seconds * 1000:.0f}"
