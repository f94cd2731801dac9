"""TTFT budgets: a request may say how long it is willing to wait for its first token
(header ``x-prefixgate-ttft-budget-ms``, milliseconds); when the engine predicts a longer wait
it is refused at once with 429 ``ttft_budget_exceeded`` and a ``Retry-After``, instead of
queueing to fail late.

The check is admission's (``AdmissionController.admit(budget_s=...)``): the prediction is the
engine's ``predict_ttft`` (``engine/load_model.estimate_ttft``: queued prefill over the measured
prefill rate, running decodes over the decode rate, and the wait for a free seat) plus what
the places promised to refused requests coming back add (``admission_wait``). An admitted
answer carries the engine's prediction as ``x-prefixgate-predicted-ttft-ms``. Until the engine has
measured its rates it predicts nothing and every request is admitted. ``Retry-After`` is the
time of an admission slot reserved for the request (``admission_slots``): the first free one
once its prediction is within its budget, after the slots of the requests refused before it.
Back at its slot, the request is admitted into it.
"""

from __future__ import annotations

import math

from aiohttp import web
from prefixgate.gateway.http.errors import bad_request

BUDGET_HEADER = "x-prefixgate-ttft-budget-ms"
PREDICTED_TTFT_HEADER = "x-prefixgate-predicted-ttft-ms"
"""On an admitted answer (local mode): the engine's predicted first-token wait at admission."""
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
