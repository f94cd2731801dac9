"""Fit a workload to the served model's context before sending it.

The server says its context in the model card (``max_model_len`` in ``GET /v1/models``, as vLLM
and prefixgate serve it) and counts a prompt's tokens with ``POST /tokenize`` (vLLM's route:
``{"model", "messages", "add_generation_prompt"}`` → ``{"count", "max_model_len", ...}``), so
the benchmark needs no tokenizer of its own. A request whose prompt alone fills the context
is dropped; one whose prompt plus ``max_tokens`` exceeds it asks for what is left (the server
would answer 400 ``context_length_exceeded`` to both). When the server does not say its context
or cannot count tokens, the workload is sent as it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from prefixgate.sdk.bench.workload import BenchRequest


class WorkloadDoesNotFitError(ValueError):
    """No request of the workload fits the served model's context."""


@dataclass(slots=True)
class FitResult:
    """What fitting did.

    Attributes:
        requests: the requests to send (input order; dropped ones left out).
        context: the served model's context in tokens, or ``None`` when unknown.
        prompt_tokens: ``index`` → prompt tokens as the server counts them (empty: not counted).
        dropped: indexes of requests whose prompt alone fills the context.
        shortened: indexes of requests whose ``max_tokens`` was lowered to fit.
        note: why nothing was fitted, when it was not (no context, no ``/tokenize``).
    """

    requests: list[BenchRequest]
    context: int | None = None
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    dropped: list[int] = field(default_factory=list)
    shortened: list[int] = field(default_factory=list)
    note: str | None = None

    def describe(self) -> str | None:
        """One line for the user about what was changed or why nothing was, else ``None``."""
        if self.note:
            return self.note
        if not (self.dropped or self.shortened):
            return None
        parts = []
        if self.dropped:
            parts.append(f"dropped {len(self.dropped)} request(s) whose prompt fills it")
        if self.shortened:
            parts.append(f"lowered max_tokens of {len(self.shortened)} to fit")
        return f"the model's context is {self.context} tokens: " + "; ".join(parts)


async def model_context(http: httpx.AsyncClient, model: str) -> int | None:
    """``max_model_len`` of ``model``'s card in ``GET /v1/models``, or ``None`` when absent."""
    try:
        resp = await http.get("/v1/models")
        resp.raise_for_status()
        cards = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    for card in cards:
        if isinstance(card, dict) and card.get("id") == model:
            value = card.get("max_model_len")
            return value if isinstance(value, int) and value > 0 else None
    return None


async def count_prompt_tokens(
    http: httpx.AsyncClient, model: str, messages: list[dict[str, Any]]
) -> int | None:
    """Prompt tokens of a chat request as the server renders it, ``BEYOND_CONTEXT`` when the
    server refuses to tokenize it as too long (400 ``context_length_exceeded``), or ``None``
    when the server has no ``POST /tokenize`` (404/405/501) or answers something else."""
    body = {"model": model, "messages": messages, "add_generation_prompt": True}
    try:
        resp = await http.post("/tokenize", json=body)
        data = resp.json()
        if resp.status_code == 400 and _error_code(data) == "context_length_exceeded":
            return BEYOND_CONTEXT  # too long to count (prefixgate: past 8 contexts)
        count = data.get("count") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return count if isinstance(count, int) else None


BEYOND_CONTEXT = 2**62  # the count of a prompt the server refused to tokenize as too long


def _error_code(data: Any) -> Any:
    err = data.get("error") if isinstance(data, dict) else None
    return err.get("code") if isinstance(err, dict) else None


async def fit_to_context(
    requests: list[BenchRequest],
    base_url: str,
    model: str,
    api_key: str | None = None,
    timeout_s: float = 60.0,
    concurrency: int = 8,
) -> FitResult:
    """Drop or shorten the requests that cannot fit ``model``'s context on the server.

    Args:
        requests: the workload.
        base_url: the server's root URL (without ``/v1``).
        model: the model id the requests name.
        api_key: bearer key, or ``None``.
        timeout_s: timeout of each call, seconds.
        concurrency: most ``/tokenize`` calls in flight.

    Raises:
        WorkloadDoesNotFitError: every prompt fills the context (the message names the context
            and the shortest prompt, in tokens).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s) as http:
        context = await model_context(http, model)
        if context is None:
            return FitResult(list(requests), note=None)
        sem = asyncio.Semaphore(concurrency)
        distinct = {json.dumps(r.messages, sort_keys=True): r.messages for r in requests}

        async def count(key: str) -> tuple[str, int | None]:
            async with sem:
                return key, await count_prompt_tokens(http, model, distinct[key])

        counts = dict(await asyncio.gather(*(count(k) for k in distinct)))
        if any(v is None for v in counts.values()):
            note = (
                f"the model's context is {context} tokens, but the server cannot count prompt "
                "tokens (no POST /tokenize): the workload is sent unfitted"
            )
            return FitResult(list(requests), context=context, note=note)
        result = FitResult([], context=context)
        for r in requests:
            n = counts[json.dumps(r.messages, sort_keys=True)]
            result.prompt_tokens[r.index] = n
            if n >= context:
                result.dropped.append(r.index)
            elif n + r.max_tokens > context:
                result.shortened.append(r.index)
                result.requests.append(dataclasses.replace(r, max_tokens=context - n))
            else:
                result.requests.append(r)
        if not result.requests:
            shortest = min(result.prompt_tokens.values())
            has = (
                f"{shortest} tokens" if shortest < BEYOND_CONTEXT else "more tokens than it counts"
            )
            advice = await _what_would_fit(http, model, requests, context, sem)
            raise WorkloadDoesNotFitError(
                f"no prompt fits the model's context of {context} tokens: the shortest prompt "
                f"of this workload has {has} ({advice})"
            )
    return result


async def _what_would_fit(
    http: httpx.AsyncClient,
    model: str,
    requests: list[BenchRequest],
    context: int,
    sem: asyncio.Semaphore,
) -> str:
    """The advice of a refused run, only what is true of this workload on this server: without
    its system prompts, do some user turns alone fit? (counted with ``/tokenize`` as well)."""
    other = (
        "use shorter prompts (--system-prompts CSV, --user-tasks JSONL) or a model with a "
        "longer context"
    )
    users: dict[str, list[dict[str, Any]]] = {}
    for r in requests:
        if any(m.get("role") == "system" for m in r.messages):
            turns = [m for m in r.messages if m.get("role") != "system"]
            users[json.dumps(turns, sort_keys=True)] = turns
    if not users:
        return other

    async def count(messages: list[dict[str, Any]]) -> int | None:
        async with sem:
            return await count_prompt_tokens(http, model, messages)

    counts = await asyncio.gather(*(count(u) for u in users.values()))
    fit = sum(1 for n in counts if n is not None and n < context)
    if not fit:
        return f"the user turns alone do not fit either: {other}"
    return (
        f"without a system prompt {fit} of its {len(users)} user turns fit: "
        f"--num-system-prompts 0; or {other}"
    )
