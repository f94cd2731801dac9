"""Fan-out of one HTTP request into engine requests (one per choice) and fan-in of outputs.

``engine_request`` is the one place a route turns its caller and body into the engine's
``EngineRequest`` (salt, tenant, priority included), so every route sends the same fields.
``ChoiceRun`` starts one task per choice that drains ``engine.generate`` into a shared queue;
the route reads ``(choice index, Delta)`` events in arrival order. Leaving the
``async with`` block for any reason (client gone, handler cancelled, error) aborts every
engine request that has not finished, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from prefixgate.engine.outputs import TokenLogprobs
from prefixgate.engine.protocol import EngineClient, EngineRequest
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.gateway.tenancy.keys import Principal, effective_salt
from prefixgate.gateway.tenancy.pool_hints import PoolHint

logger = logging.getLogger("prefixgate.gateway")


@dataclass(slots=True)
class Delta:
    """What one engine output adds to a choice, copied out of the engine's objects.

    Attributes:
        text: cumulative text; delta_text: the new text.
        num_tokens: tokens generated so far; new_tokens: how many are new.
        logprobs: TokenLogprobs of the new tokens (None when not requested).
        finish_reason: None while running, else "stop" | "length" | "abort".
        num_cached_tokens: prompt tokens served from the prefix cache.
        stop_reason: on the last output, the stop string matched (str) or the stop token id
            (int) that ended it; None otherwise (EOS, length, running).
        engine_metrics: on the choice's first output with tokens, a copy of the engine's
            ``RequestOutput.metrics`` (its timeline: monotonic timestamps in seconds, the
            steps it waited, its first step's tokens and seconds); None on the others.
    """

    text: str
    delta_text: str
    num_tokens: int
    new_tokens: int
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    num_cached_tokens: int
    stop_reason: str | int | None = None
    engine_metrics: dict[str, float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class ChoiceOutput:
    """What one choice has produced so far (``add`` each of its Deltas).

    Attributes:
        text: the text so far; finish_reason: None while running; stop_reason: the stop
            string (or stop token id) that ended it, else None.
        num_tokens: tokens generated; logprobs: TokenLogprobs of each (when asked for).
        t_first_token: monotonic seconds of its first token (0.0 before).
    """

    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    t_first_token: float = 0.0
    stop_reason: str | int | None = None

    def add(self, d: Delta, now: float) -> None:
        """Take in one output of this choice, seen at ``now`` (monotonic seconds)."""
        if d.new_tokens and self.num_tokens == 0:
            self.t_first_token = now
        self.num_tokens = d.num_tokens
        if d.logprobs is not None:
            self.logprobs.extend(d.logprobs)
        self.text = d.text
        if d.finished:
            self.finish_reason = d.finish_reason
            self.stop_reason = d.stop_reason


def engine_request(
    principal: Principal,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    *,
    cache_salt: str | None = None,
    priority: int | None = None,
    hint: PoolHint | None = None,
) -> EngineRequest:
    """The engine request of one choice, built once by its route.

    Args:
        principal: the caller: its key's salt partition, tenant (``fair``'s charge) and
            default priority. request_id: unique engine id; prompt: token ids (int).
        params: sampling parameters. cache_salt: the body's own ``cache_salt`` (a
            sub-partition of the key's, ``effective_salt``). priority: the body's
            ``priority`` (None: the pool's objective's, else the key's). hint: a trusted
            pool's fairness id and objective (``tenancy.pool_hints``; None: none).

    Raises:
        APIError: 400 naming ``priority`` when the key may not set one.
    """
    return EngineRequest(
        request_id,
        prompt,
        params,
        cache_salt=effective_salt(principal.salt, cache_salt),
        tenant=hint.tenant if hint is not None and hint.tenant is not None else principal.tenant,
        priority=hint.priority
        if priority is None and hint is not None and hint.priority is not None
        else principal.request_priority(priority),
    )


_ABORTING: set[asyncio.Task] = set()  # aborts finishing in the background (kept referenced)


class ChoiceRun:
    """Runs the choices of one HTTP request on the engine (``async with``).

    ``await next(timeout)`` returns ``(index, Delta)``, or ``None`` when ``timeout`` seconds
    pass with no output (the caller checks the client and sends keep-alives). An engine error
    is re-raised from ``next``.
    """

    def __init__(self, engine: EngineClient, requests: list[EngineRequest]) -> None:
        self._engine = engine
        self.requests = requests
        self._queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._finished: set[int] = set()
        self.pending = len(requests)

    async def __aenter__(self) -> ChoiceRun:
        for i, request in enumerate(self.requests):
            self._tasks.append(asyncio.create_task(self._pump(i, request)))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.abort()

    async def _pump(self, i: int, request: EngineRequest) -> None:
        put = self._queue.put_nowait
        seen_tokens = seen_logprobs = 0
        try:
            async for out in self._engine.generate(request):
                # Copy now: an engine may reuse its output objects for the next step.
                comp = out.outputs[0]
                n = len(comp.token_ids)
                lps = comp.logprobs
                if lps is not None:
                    lps = lps[seen_logprobs:]
                    seen_logprobs += len(lps)
                finish = comp.finish_reason if out.finished or comp.finish_reason else None
                if out.finished and finish is None:
                    finish = "stop"
                put(
                    (
                        i,
                        Delta(
                            comp.text,
                            comp.delta_text,
                            n,
                            n - seen_tokens,
                            lps,
                            finish,
                            out.num_cached_tokens,
                            comp.stop_reason if finish is not None else None,
                            dict(out.metrics) if seen_tokens == 0 and n else None,
                        ),
                    )
                )
                seen_tokens = n
                if finish is not None:
                    self._finished.add(i)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            self._finished.add(i)
            put((i, exc))
            return
        if i not in self._finished:  # the stream ended without a finished output
            self._finished.add(i)
            put((i, None))

    async def next(self, timeout: float) -> tuple[int, Delta] | None:
        """The next output of any choice, or None after ``timeout`` s (or when all are done).

        Raises:
            Exception: what the engine raised for a choice.
        """
        while self.pending:
            try:
                async with asyncio.timeout(timeout):
                    i, item = await self._queue.get()
            except TimeoutError:
                return None
            if item is None:
                self.pending -= 1
                continue
            if isinstance(item, BaseException):
                self.pending -= 1
                raise item
            if item.finished:
                self.pending -= 1
            return i, item
        return None

    async def abort(self) -> None:
        """Abort every unfinished engine request (concurrently) and stop the pumps
        (idempotent). Unknown ids (finished meanwhile, or never started) are ignored.

        Shielded: a second cancellation of the caller (the client's disconnect, then the
        shutdown's ending) cannot interrupt it half-way — the aborts and the pumps' ends run
        to completion in the background, so no engine request outlives its client.
        """
        task = asyncio.ensure_future(self._abort())
        _ABORTING.add(task)
        task.add_done_callback(_ABORTING.discard)
        await asyncio.shield(task)

    async def _abort(self) -> None:
        live = [
            i for i, task in enumerate(self._tasks) if i not in self._finished and not task.done()
        ]
        if live:
            results = await asyncio.gather(
                *(self._engine.abort(self.requests[i].request_id) for i in live),
                return_exceptions=True,
            )
            for i, res in zip(live, results, strict=True):
                if isinstance(res, Exception) and not isinstance(res, ValueError | KeyError):
                    logger.error("abort of %s failed: %r", self.requests[i].request_id, res)
        for task in self._tasks:
            if not task.done():
                task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
