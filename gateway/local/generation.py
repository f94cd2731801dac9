"""Fan-out of one HTTP request into engine requests (one per choice) and fan-in of outputs.

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
    """

    text: str
    delta_text: str
    num_tokens: int
    new_tokens: int
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    num_cached_tokens: int
    stop_reason: str | int | None = None

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


@dataclass(slots=True)
class Choice:
    """One engine request: choice ``index`` of an HTTP request.

    Attributes:
        index: the choice's index in the response.
        request_id: the engine request id (unique).
        prompt_token_ids: the prompt, token ids (int).
        params: its sampling parameters.
        prompt_index: which prompt of a batched completions request it belongs to.
    """

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0


_ABORTING: set[asyncio.Task] = set()  # aborts finishing in the background (kept referenced)


class ChoiceRun:
    """Runs the choices of one HTTP request on the engine (``async with``).

    ``await next(timeout)`` returns ``(index, Delta)``, or ``None`` when ``timeout`` seconds
    pass with no output (the caller checks the client and sends keep-alives). An engine error
    is re-raised from ``next``.
    """

    def __init__(
        self,
        engine: EngineClient,
        choices: list[Choice],
        cache_salt: str | None,
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        self._engine = engine
        self.choices = choices
        self._salt = cache_salt
        self._tenant = tenant
        self._priority = priority
        self._queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._finished: set[int] = set()
        self.pending = len(choices)

    async def __aenter__(self) -> ChoiceRun:
        for i, choice in enumerate(self.choices):
            self._tasks.append(asyncio.create_task(self._pump(i, choice)))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.abort()

    async def _pump(self, i: int, choice: Choice) -> None:
        put = self._queue.put_nowait
        seen_tokens = seen_logprobs = 0
        try:
            request = EngineRequest(
                choice.request_id,
                choice.prompt_token_ids,
                choice.params,
                cache_salt=self._salt,
                tenant=self._tenant,
                priority=self._priority,
            )
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
                *(self._engine.abort(self.choices[i].request_id) for i in live),
                return_exceptions=True,
            )
            for i, res in zip(live, results, strict=True):
                if isinstance(res, Exception) and not isinstance(res, ValueError | KeyError):
                    logger.error("abort of %s failed: %r", self.choices[i].request_id, res)
        for task in self._tasks:
            if not task.done():
                task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
