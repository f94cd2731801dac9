"""AsyncEngine: the engine behind an asyncio API, stepping in a background thread.

One dedicated thread owns the ``LLMEngine``: it drains a queue of commands (add, abort, pin)
sent from event loops, runs ``engine.step()`` while there is work, and hands each output to the
request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe`` (one call per step and loop). The
event loop never waits on a step, except ``unpin_prefix`` / ``check_invariants``, which take the
engine lock for at most one step.

An engine error fails the requests of the step that raised it (blocks freed; each of their
iterators raises the error); the other requests and new ones keep being served.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixgate.engine.config import EngineConfig
from prefixgate.engine.errors import EngineDeadError
from prefixgate.engine.front_end import EngineFrontEnd
from prefixgate.engine.llm_engine import LLMEngine, PinJob
from prefixgate.engine.outputs import StepOutput
from prefixgate.engine.protocol import EngineRequest, PinRequest
from prefixgate.engine.request import Request
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.threads import release_openmp_pool

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Stream:
    """One request's delivery channel: outputs (or an exception) for its iterator."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    closed: bool = False

    def put(self, item: Any) -> None:
        """Hand one output (or exception) to the queue, unless the consumer left (runs on
        the stream's loop)."""
        if not self.closed:
            self.queue.put_nowait(item)


class AsyncEngine(EngineFrontEnd):
    """Asynchronous engine in vLLM's ``AsyncLLM`` shape.

    Args:
        config: the ``EngineConfig`` (``None``: defaults, i.e. the built-in preset);
            keyword arguments build one when ``config`` is not given.

    Usage::

        engine = AsyncEngine(EngineConfig(model=path))
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.delta_text, end="")
        await engine.shutdown()
    """

    def __init__(self, config: EngineConfig | None = None, **engine_args: Any) -> None:
        if config is None:
            config = EngineConfig(**engine_args)
        elif engine_args:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        self.engine = LLMEngine(config)
        if self.engine.device.type == "cpu" and config.runner != "sim":
            # the engine thread steps it: this thread's OpenMP pool would make libgomp stop
            # spinning (too many OpenMP threads for the CPUs; threads.release_openmp_pool)
            release_openmp_pool()
        self._lock = threading.Lock()
        self._commands: deque[tuple[Any, ...]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # event-loop side: ids with a live iterator
        self._active: dict[str, _Stream] = {}  # engine-thread side: ids queued in the engine
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._snapshot: dict[str, Any] = self.engine.stats()
        # event-loop calls (loop, function, argument) produced under the lock, posted after
        # the stats snapshot is fresh (so a caller woken by them sees stats that include what
        # woke it)
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Callable[[Any], None], Any]] = []

    # -- requests ------------------------------------------------------------------------

    async def generate(
        self,
        request: EngineRequest | str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        """Submit a request and iterate over its outputs as tokens are produced.

        ``request`` is an ``EngineRequest`` (``EngineClient.generate``: every per-request
        argument, tenant and priority included, is one of its fields), or vLLM's loose form
        ``generate(prompt, params, request_id=None, cache_salt=None)`` (a random id when
        ``None``), which builds one. It yields per-step deltas (vLLM's
        ``RequestOutputKind.DELTA``), not ``LLM.generate``'s finished ``RequestOutput``: each
        ``StepOutput`` carries only what is new (``delta_text`` / ``delta_token_ids`` /
        ``logprobs``; ``CompletionOutput.add`` accumulates them); the last has
        ``finished=True``. Leaving the loop early (break, ``aclose``, task cancellation, client
        disconnect) aborts the request and frees its KV blocks.

        Raises (from the first iteration):
            ValueError / TypeError: bad prompt or params, duplicate ``request_id``.
            EngineDeadError: the engine shut down; any engine error of a step that ran it.
        """
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        if not isinstance(request, EngineRequest):
            rid = uuid.uuid4().hex if request_id is None else request_id
            request = EngineRequest(rid, request, params or SamplingParams(), cache_salt)
        elif params is not None or request_id is not None or cache_salt is not None:
            raise TypeError("generate(EngineRequest) takes no other argument")
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        req = self.engine.prepare_request(request)  # its arrival: now, unless the caller's
        stream = _Stream(request_id, asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._submit("add", stream, req)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            stream.closed = True
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self._submit("abort", stream, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request in flight: its blocks are freed and its iterator ends with a
        ``finish_reason="abort"`` output.

        Raises:
            ValueError: unknown (or already finished) request id.
        """
        stream = self._streams.get(request_id)
        if stream is None:
            raise ValueError(f"unknown request id {request_id!r} (not in flight)")
        fut = asyncio.get_running_loop().create_future()
        self._submit("abort", stream, fut)
        await fut

    # -- prefix pins ---------------------------------------------------------------------

    async def pin_prefix(self, pin: PinRequest) -> Any:
        """Compute (if not cached) and pin ``pin.token_ids``' full blocks for ``pin.ttl_s``
        seconds (charged to ``pin.tenant``: under ``fair`` the pinned blocks count against its
        share).

        Returns:
            ``PrefixPin(id, num_tokens, expires_at, ...)``.

        Raises:
            PinLimitError: over ``max_pinned_fraction``; ValueError / TypeError: bad input.
        """
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._submit("pin", pin, loop, fut)
        return await fut

    def get_pin(self, pin_id: str) -> Any:
        """The live ``PrefixPin`` ``pin_id`` (never blocks: one dict read).

        The engine owns a pin's TTL; callers (the gateway's prefix registry) ask here whether
        a pin is still held instead of keeping their own clock.

        Raises:
            KeyError: unknown, released, revoked, or past its ``expires_at``.
        """
        return self.engine.get_pin(pin_id)

    def unpin_prefix(self, pin_id: str) -> None:
        """Release a pin (waits for at most the step in progress).

        Raises:
            ValueError / KeyError: unknown pin id.
        """
        with self._lock:
            self.engine.unpin_prefix(pin_id)

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Engine counters (``LLMEngine.stats``): fresh when no step is running, else the
        snapshot taken after the last step (never blocks the event loop)."""
        if self._lock.acquire(blocking=False):
            try:
                self._snapshot = self.engine.stats()
            finally:
                self._lock.release()
        return dict(self._snapshot)

    def predict_ttft(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float | None:
        """Seconds until a new request of ``num_prompt_tokens`` would get its first token,
        from the ``stats()`` snapshot (never blocks; formula: ``load_model.estimate_ttft``);
        ``None`` before the rates are measured.

        Raises:
            ValueError / TypeError: bad token counts.
        """
        return self.engine.scheduler.predict_ttft(
            num_prompt_tokens, num_cached_tokens, stats=self.stats()
        )

    def check_invariants(self) -> None:
        """Raise AssertionError on broken KV block bookkeeping (waits for the step in progress)."""
        with self._lock:
            self.engine.check_invariants()

    async def shutdown(self) -> None:
        """Stop the step loop; requests still in flight fail with ``EngineDeadError``."""
        self._stopped = True
        self._wake.set()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)
        with self._lock:
            self._fail_all(EngineDeadError("the engine shut down"))
            self._drain_commands()
            self._snapshot = self.engine.stats()
            self.engine.shutdown()  # the KV event publisher, when on
        self._flush_outbox()

    # -- engine thread -------------------------------------------------------------------

    def _submit(self, *command: Any) -> None:
        self._commands.append(command)
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="prefixgate-engine", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            with self._lock:
                self._drain_commands()
                busy = engine.has_unfinished_requests()
                until = engine.anticipation_deadline() if busy else None
                if busy and until is None:
                    try:
                        self._deliver_outputs(engine.step())
                        self._deliver_failed(engine.pop_failed())
                    except Exception as exc:  # noqa: BLE001 - delivered to the requests
                        ids = engine.current_step_ids or None  # None: all (error outside a batch)
                        logger.exception(
                            "engine step failed; failing %s",
                            f"{len(ids)} request(s) of the step" if ids else "all requests",
                        )
                        self._fail(exc, ids)
                try:
                    self._snapshot = engine.stats()
                except Exception:  # noqa: BLE001 - keep serving; stats() will show the error
                    logger.exception("engine stats failed")
            self._flush_outbox()
            if not busy:
                self._idle_wait()
            elif until is not None:
                self._anticipate(until)

    def _anticipate(self, until: float) -> None:
        """Wait until ``until`` (monotonic seconds) or the next command, whichever comes
        first, instead of a step that an idle tenant's next request would just miss
        (``engine/anticipation.py``); the loop then looks again."""
        t0 = time.monotonic()
        self._wake.wait(max(0.0, until - t0))
        self._wake.clear()
        with self._lock:
            self.engine.note_anticipated(time.monotonic() - t0)

    def _idle_wait(self) -> None:
        """Sleep until a command arrives, or until the next prefix pin expires (then release
        it, so pins lapse at their TTL even when no request is running)."""
        expiry = self.engine.next_pin_expiry()
        timeout = None if expiry is None else max(0.0, expiry - time.monotonic()) + 1e-3
        if not self._wake.wait(timeout):
            with self._lock:
                self.engine.expire_pins()
                self._snapshot = self.engine.stats()
        self._wake.clear()

    def _drain_commands(self) -> None:
        while self._commands:
            kind, *args = self._commands.popleft()
            try:
                getattr(self, f"_cmd_{kind}")(*args)
            except Exception:  # noqa: BLE001 - a command must never kill the loop
                logger.exception("engine command %s failed", kind)

    def _cmd_add(self, stream: _Stream, req: Request) -> None:
        if stream.closed:
            return
        if self._stopped:
            self._deliver([(stream, EngineDeadError("the engine shut down"))])
            return
        try:
            self.engine.add_request(req)
        except Exception as exc:  # noqa: BLE001 - delivered to the request's iterator
            self._deliver([(stream, exc)])
            return
        self._active[stream.request_id] = stream

    def _cmd_abort(self, stream: _Stream, fut: asyncio.Future | None) -> None:
        rid = stream.request_id
        if self._active.get(rid) is not stream:
            if fut is not None:
                self._resolve(
                    stream.loop, fut, None, ValueError(f"request {rid!r} already finished")
                )
            return
        del self._active[rid]
        out = self.engine.abort_request(rid)
        self._deliver([(stream, out)])
        if fut is not None:
            self._resolve(stream.loop, fut, None, None)

    def _cmd_pin(
        self, pin: PinRequest, loop: asyncio.AbstractEventLoop, fut: asyncio.Future
    ) -> None:
        def done(job: PinJob) -> None:
            self._resolve(loop, fut, job.result, job.error, orphan=self._release_orphan_pin)

        try:
            self.engine.start_pin(pin, callback=done)
        except Exception as exc:  # noqa: BLE001 - delivered to the caller
            self._resolve(loop, fut, None, exc)

    def _deliver_outputs(self, outputs: list[StepOutput]) -> None:
        items: list[tuple[_Stream, Any]] = []
        for out in outputs:
            stream = self._active.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._active[out.request_id]
            items.append((stream, out))
        self._deliver(items)

    def _deliver_failed(self, failed: list[tuple[str, BaseException]]) -> None:
        """Requests the engine failed outside a step's batch (e.g. a grammar that did not
        compile): their iterators raise the error."""
        self._deliver([(self._active.pop(rid), exc) for rid, exc in failed if rid in self._active])

    def _fail_all(self, exc: BaseException) -> None:
        self._fail(exc, None)

    def _fail(self, exc: BaseException, request_ids: list[str] | None) -> None:
        failed = self.engine.fail_requests(exc, request_ids)
        items = [(self._active.pop(rid), exc) for rid, _ in failed if rid in self._active]
        self._deliver(items)

    def _deliver(self, items: list[tuple[_Stream, Any]]) -> None:
        for stream, item in items:
            if not stream.closed:
                self._outbox.append((stream.loop, stream.put, item))

    def _resolve(
        self,
        loop: asyncio.AbstractEventLoop,
        fut: asyncio.Future,
        result: Any,
        error: BaseException | None,
        orphan: Callable[[Any], None] | None = None,
    ) -> None:
        self._outbox.append((loop, _SetFuture(fut, result, error, orphan), None))

    def _release_orphan_pin(self, pin: Any) -> None:
        """A pin whose caller was cancelled before it landed: nobody can learn its id, so it
        is released now rather than held for its whole TTL (runs on the caller's loop)."""
        try:
            self.unpin_prefix(pin.id)
        except (KeyError, ValueError):
            pass  # already released

    def _flush_outbox(self) -> None:
        """Post queued callbacks: one ``call_soon_threadsafe`` per event loop, in order."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Any], None], Any]]] = {}
        for loop, fn, arg in self._outbox:
            by_loop.setdefault(loop, []).append((fn, arg))
        self._outbox = []
        for loop, fns in by_loop.items():
            try:
                loop.call_soon_threadsafe(_run_all, fns)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass


@dataclass(slots=True)
class _SetFuture:
    """Complete a caller's future with a result or an exception (once); a result nobody
    awaits any more (the caller was cancelled) goes to ``orphan`` when given."""

    fut: asyncio.Future
    result: Any
    error: BaseException | None
    orphan: Callable[[Any], None] | None = None

    def __call__(self, _: Any = None) -> None:
        if self.fut.done():
            if self.orphan is not None and self.error is None and self.result is not None:
                self.orphan(self.result)
            return
        if self.error is not None:
            self.fut.set_exception(self.error)
        else:
            self.fut.set_result(self.result)


def _run_all(calls: list[tuple[Callable[[Any], None], Any]]) -> None:
    for fn, arg in calls:
        fn(arg)
