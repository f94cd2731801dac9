"""Fan-out of one HTTP request into engine requests (one per choice) and fan-in of outputs.

``engine_request`` is the one place a route turns its caller and body into the engine's
``EngineRequest`` (salt, tenant, priority included), so every route sends the same fields.
``ChoiceRun`` starts one task per choice that drains ``engine.generate`` into a shared queue;
the route reads ``(choice index, StepOutput)`` events in arrival order (each output is the
engine's own, holding only what the step added; the route's ``CompletionOutput`` per choice
accumulates them). Leaving the
``async with`` block for any reason (client gone, handler cancelled, error) aborts every
engine request that has not finished, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging

from prefixgate.engine.outputs import StepOutput
from prefixgate.engine.protocol import EngineClient, EngineRequest
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.gateway.tenancy.keys import Principal, effective_salt
from prefixgate.gateway.tenancy.pool_hints import PoolHint

logger = logging.getLogger("prefixgate.gateway")


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

    ``await next(timeout)`` returns ``(index, StepOutput)``, or ``None`` when ``timeout`` seconds
    pass with no output (the caller checks the client and sends keep-alives). An engine error
    is re-raised from ``next``.
    """

    def __init__(self, engine: EngineClient, requests: list[EngineRequest]) -> None:
        self._engine = engine
        self.requests = requests
        self._queue: asyncio.Queue[tuple[int, StepOutput | BaseException | None]] = asyncio.Queue()
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
        try:
            async for out in self._engine.generate(request):
                put((i, out))  # an output is the step's own delta: never changed after
                if out.finished:
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

    async def next(self, timeout: float) -> tuple[int, StepOutput] | None:
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
