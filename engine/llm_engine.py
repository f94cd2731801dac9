"""LLMEngine: the synchronous engine loop (vLLM v1's ``LLMEngine`` / ``EngineCore`` in one).

``add_request`` validates and queues; each ``step()`` schedules (continuous batching, chunked
prefill, preemption), runs the model runner once, updates the scheduler with the sampled tokens
(``Scheduler.update_from_output``: the request appends its token and ``Request.check_stop``
decides, detokenizing, whether it ended) and returns the ``StepOutput`` of every request that
produced a token (or finished) in that step. The ``Request`` object holds all of a request's
state; the scheduler's table of requests is the only one. Nothing here is thread-safe:
``AsyncEngine`` drives it from one thread.

Prefix pins: a pin job queues an internal request (``max_tokens=1``, greedy) for the prefix;
when it finishes, the prefix's full blocks are in the prefix cache and ``KVCacheManager.pin``
holds them (reference + 1) until unpinned or expired (the manager owns the TTL).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.detokenizer import IncrementalDetokenizer
from prefixgate.engine.errors import UnsupportedFieldError
from prefixgate.engine.input_processor import InputProcessor
from prefixgate.engine.kv_cache import (
    KVCacheSpec,
    allocate_kv_caches,
    check_gpu_memory_utilization,
    resolve_num_blocks,
)
from prefixgate.engine.kv_cache_manager import KVCacheManager, PrefixPin
from prefixgate.engine.logits_processors import LogitsPipeline
from prefixgate.engine.malloc import keep_freed_memory
from prefixgate.engine.model_runner import ModelRunner
from prefixgate.engine.models.config import ModelConfig
from prefixgate.engine.models.loader import load_model
from prefixgate.engine.output_processor import OutputProcessor
from prefixgate.engine.outputs import StepOutput
from prefixgate.engine.protocol import EngineRequest, PinRequest
from prefixgate.engine.request import Request, RequestStatus
from prefixgate.engine.sampler import Sampler
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.scheduler import Scheduler
from prefixgate.engine.structured_output import StructuredOutputManager
from prefixgate.engine.thread_governor import ThreadGovernor, make_governor
from prefixgate.engine.threads import apply_threads
from prefixgate.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


PIN_REQUEST_PREFIX = "__pin-"
"""Request ids of the internal prefill requests that compute a prefix before it is pinned."""


@dataclass(slots=True)
class PinJob:
    """A prefix pin in progress: an internal prefill request, then ``kv_cache_manager.pin``.

    ``callback(job)`` runs (on the engine's thread) once ``done``; then ``result`` holds the
    ``PrefixPin`` or ``error`` the exception.
    """

    request_id: str
    token_ids: list[int]
    ttl_s: float
    cache_salt: str | None
    callback: Callable[[PinJob], None] | None = None
    tenant: str | None = None
    result: Any = None
    error: BaseException | None = None
    done: bool = False

    def resolve(self, result: Any, error: BaseException | None) -> None:
        """Complete the job (once) and run its callback."""
        if self.done:
            return
        self.result, self.error, self.done = result, error, True
        if self.callback is not None:
            self.callback(self)


class LLMEngine:
    """The engine: tokenizer, scheduler + KV cache manager, model runner, output processor.

    Args:
        config: the ``EngineConfig``.
        sim_clock: under ``runner="sim"``, the runner's clock (``sim_runner.VirtualClock`` for
            ``prefixgate sim``); ``None``: wall time (steps sleep their modelled time).

    Raises:
        ValueError / FileNotFoundError: bad config or model files (from the model loader).
    """

    def __init__(self, config: EngineConfig, sim_clock: Any = None) -> None:
        self.config = config
        apply_threads(config.threads)  # once, before the model is built
        self.model_config = mc = ModelConfig.from_engine_config(config)
        if torch.device(mc.device).type == "cpu":
            keep_freed_memory()  # steps reuse freed activations, no page faults (malloc.py)
        self.tokenizer = _load_tokenizer(mc)
        self.max_model_len: int = mc.max_model_len
        self.device = torch.device(mc.device)
        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, mc.dtype)
        self.eos_token_ids: set[int] = set(mc.eos_token_ids) | set(
            getattr(self.tokenizer, "eos_token_ids", set()) or set()
        )
        self.structured_output = StructuredOutputManager(
            self.tokenizer, mc.vocab_size, sorted(self.eos_token_ids)
        )
        self.runner: Any
        self._governor: ThreadGovernor | None = None
        if config.runner == "sim":  # no model, no KV tensors: modelled step times
            num_blocks = _sim_num_blocks(config, spec, self.device)
            self.num_kv_blocks = num_blocks
            self._fit_max_model_len(num_blocks * config.block_size)
            self.runner = _sim_runner(config, mc.vocab_size, sim_clock)
        else:
            check_gpu_memory_utilization(config.gpu_memory_utilization, self.device)
            model = load_model(mc, config)
            num_blocks = resolve_num_blocks(
                spec,
                config.num_kv_blocks,
                config.kv_cache_memory,
                self.device,
                config.gpu_memory_utilization,
            )
            self.num_kv_blocks = num_blocks
            self._fit_max_model_len(num_blocks * config.block_size)
            kv_caches = allocate_kv_caches(spec, num_blocks, self.device)
            # fewer threads while other processes keep the CPUs busy (thread_governor.py)
            if self.device.type == "cpu":
                self._governor = make_governor(torch.get_num_threads())
            self.runner = ModelRunner(
                model,
                kv_caches,
                Sampler(config.seed, LogitsPipeline(self.structured_output)),
                config.block_size,
                self.device,
                structured_output=self.structured_output,
                cuda_graphs=_decode_graphs(
                    config, model, kv_caches, self.max_model_len, self.device
                ),
            )
        self.kv_cache_manager = KVCacheManager.from_config(config, num_blocks)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, IncrementalDetokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer,
            mc.vocab_size,
            self.max_model_len,
            self.structured_output,
            self.eos_token_ids,
        )
        # (request id, error) of requests failed outside a step's batch (a grammar that did
        # not compile, a sampled token the grammar rejected); AsyncEngine delivers them
        self.failed: list[tuple[str, BaseException]] = []
        self._pin_counter = itertools.count()
        self._stashed: list[StepOutput] = []
        self._step_requests: list[Request] = []  # the step in progress (for fail_requests)
        # cumulative host wall-clock seconds per phase of step() (benchmarks read it)
        self.timing: dict[str, float] = dict.fromkeys(
            ("steps", "step_s", "schedule_s", "prepare_s", "forward_s", "sample_s", "output_s"), 0
        )
        self._load_last: tuple[float, tuple[int, int]] | None = None  # (when, counts) reported
        self._load_n = 0
        # last: nothing above can fail with its sockets bound
        self.kv_events = _start_kv_events(config, self.kv_cache_manager)

    def _fit_max_model_len(self, capacity: int) -> None:
        """Keep ``max_model_len`` within the KV cache (``capacity`` tokens), so that every
        admitted request can finish: a default (the model's context) is lowered with a warning;
        an explicit ``EngineConfig.max_model_len`` over capacity is an error (as in vLLM)."""
        if capacity >= self.max_model_len:
            return
        if self.config.max_model_len is not None:
            raise ValueError(
                f"max_model_len={self.config.max_model_len} tokens does not fit the KV cache "
                f"({capacity} tokens); raise kv_cache_memory / num_kv_blocks or lower max_model_len"
            )
        logger.warning(
            "the KV cache holds %d tokens, less than the model's context of %d: "
            "max_model_len lowered to %d",
            capacity,
            self.max_model_len,
            capacity,
        )
        self.max_model_len = capacity

    # -- requests ------------------------------------------------------------------------

    def prepare_request(self, request: EngineRequest) -> Request:
        """Validate and tokenize a request into its ``Request`` without queuing it (safe from
        any thread); see ``InputProcessor.prepare``. Under ``runner="sim"`` the sampling
        fields that constrain the tokens (which pseudo tokens ignore) are refused by name
        (ValueError)."""
        req = self.input_processor.prepare(request)
        if self.config.runner == "sim" and req.sampling_params is not None:
            _check_sim_params(req.sampling_params)
        return req

    def add_request(
        self,
        request: EngineRequest | Request | str,
        prompt: str | Sequence[int] | None = None,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request: an ``EngineRequest`` (or the ``Request``
        ``prepare_request`` made of one), or vLLM's loose form
        ``add_request(request_id, prompt, params, ...)``, which builds the ``EngineRequest``
        of its arguments (``arrival_time`` given here wins over the request's own).

        ``tenant`` / ``priority`` are read by the ``fair`` / ``priority`` scheduling policies
        (vLLM's ``priority``: lower first).

        ``prompt + max_tokens`` beyond ``max_model_len`` caps generation at ``max_model_len``
        (vLLM's behaviour); a prompt of ``max_model_len`` tokens or more is an error.

        Raises:
            TypeError / ValueError: bad request id, prompt or params (see ``prepare_request``);
                duplicate request id; a request that can never fit in the KV cache.
        """
        if isinstance(request, Request):
            req = request
            self._check_id(req.request_id)
        else:
            if not isinstance(request, EngineRequest):
                if not isinstance(request, str) or not request:
                    raise TypeError("request_id must be a non-empty string")
                if prompt is None:
                    raise TypeError("add_request(request_id, prompt, ...) needs a prompt")
                request = EngineRequest(
                    request, prompt, params or SamplingParams(), cache_salt, tenant, priority
                )
            self._check_id(request.request_id)
            req = self.prepare_request(request)
        if arrival_time:
            req.arrival_time = arrival_time
        self._enqueue(req)

    def _check_id(self, request_id: str) -> None:
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if request_id.startswith(PIN_REQUEST_PREFIX):
            raise ValueError(f"request ids starting with {PIN_REQUEST_PREFIX!r} are reserved")

    def _enqueue(self, req: Request, pin_job: PinJob | None = None) -> Request:
        params = req.sampling_params
        assert params is not None  # prepare_request made it
        if params.seed is not None:
            gen = torch.Generator(device="cpu")  # the sampler draws on the generator's device
            gen.manual_seed(params.seed)
            req.generator = gen
        if params.structured_outputs is not None:  # compiles off the step loop
            req.structured_output = self.structured_output.request(params.structured_outputs)
        if pin_job is None:
            self.output_processor.attach(req)
        req.pin_job = pin_job
        self.scheduler.add_request(req)  # may raise (never fits): nothing else was touched
        return req

    def abort_request(self, request_id: str) -> StepOutput:
        """Abort a request in flight and free its KV blocks at once.

        Returns:
            its final output (``finish_reason="abort"``).

        Raises:
            ValueError: unknown (or already finished) request id.
        """
        req = self.scheduler.requests.get(request_id)
        if req is None or req.pin_job is not None:
            raise ValueError(f"unknown request id {request_id!r} (not in flight)")
        self.scheduler.abort_requests([request_id])
        return self.output_processor.make_output(req)

    def has_unfinished_requests(self) -> bool:
        """True while any request (or pin job) is queued or running."""
        return self.scheduler.has_unfinished_requests() or bool(self._stashed)

    @property
    def num_requests(self) -> int:
        """Requests in flight (waiting or running), internal pin requests included."""
        return len(self.scheduler.requests)

    @property
    def current_step_ids(self) -> list[str]:
        """Ids of the requests of the step in progress (after ``step()`` raised: of that step)."""
        return [r.request_id for r in self._step_requests]

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one engine step.

        Returns:
            one ``StepOutput`` per caller request that got a new token or finished this step
            (what it added this step).
        """
        t0 = time.perf_counter()
        if self._governor is not None:
            self._governor.tick()
        self._fail_grammar_errors()
        sched_out = self.scheduler.schedule()
        if not sched_out.scheduled:
            self._flush_kv_events()
            self._wait_for_grammars()
            stashed, self._stashed = self._stashed, []
            return stashed
        # if anything below raises, these are the requests the error concerns (fail_requests)
        self._step_requests = [s.request for s in sched_out.scheduled]
        t_run = time.perf_counter()
        run = self.runner.execute(sched_out)
        t_out = time.perf_counter()
        self.scheduler.update_from_output(sched_out, run.sampled)
        outputs: list[StepOutput] = []
        op = self.output_processor
        for s in sched_out.scheduled:
            r = s.request
            if r.request_id not in run.sampled:
                continue
            if r.pin_job is not None:
                self._on_pin_request(r)
                continue
            if r.error is not None:  # its grammar rejected the token: delivered by pop_failed()
                self.failed.append((r.request_id, r.error))
                continue
            if r.status == RequestStatus.FINISHED_ABORTED:
                continue  # aborted since schedule(): its output was made then
            op.add_logprobs(r, run.logprobs.get(r.request_id))
            outputs.append(op.make_output(r))
        self._step_requests = []
        outputs, self._stashed = self._stashed + outputs, []
        self._flush_kv_events()
        t_end = time.perf_counter()
        t = self.timing
        t["steps"] += 1
        t["step_s"] += t_end - t0
        t["schedule_s"] += t_run - t0
        t["prepare_s"] += run.prepare_s
        t["forward_s"] += run.forward_s
        t["sample_s"] += run.sample_s
        t["output_s"] += t_end - t_out  # scheduler update, detokenize, RequestOutputs
        return outputs

    def _flush_kv_events(self) -> None:
        """Hand the step's KV cache changes to the event publisher (one batch; never blocks),
        and a load report when due (``_report_load``)."""
        if self.kv_events is not None:
            self.kv_events.collector.flush()
            if self.config.kv_events_load_interval_s > 0:
                self._report_load()

    def _report_load(self) -> None:
        """A load report (``kv_events.EngineLoad``) to the publisher when the numbers of
        running or waiting requests changed since the last report, else when
        ``kv_events_load_interval_s`` has passed since it and requests are in flight."""
        s = self.scheduler
        counts = (s.num_running, s.num_waiting)
        now = time.monotonic()
        last = self._load_last
        if last is not None and counts == last[1]:
            if counts == (0, 0) or now - last[0] < self.config.kv_events_load_interval_s:
                return
        from prefixgate.engine.kv_events import EngineLoad  # torch-free, loaded with kv_events

        kv = self.kv_cache_manager
        decodes = sum(1 for r in s.running if r.num_tokens - r.num_computed_tokens == 1)
        collector = self.kv_events.collector
        self._load_last = (now, counts)
        self._load_n += 1
        collector.report_load(
            EngineLoad(
                ts=time.time(),
                n=self._load_n,
                num_running=counts[0],
                num_waiting=counts[1],
                queued_prefill_tokens=s.queued_prefill_tokens(net_of_cache=True),
                running_decodes=decodes,
                kv_blocks_used=kv.pool.num_used,
                kv_blocks_total=kv.pool.num_blocks,
                prefill_tokens_per_s=s.load.prefill_tokens_per_s,
                decode_tokens_per_s=s.load.decode_tokens_per_s,
                last_seq=collector.last_seq,
            )
        )

    def shutdown(self) -> None:
        """Stop the KV event publisher (what is queued is sent first, within a second) and
        unbind its sockets. The engine itself holds nothing else to release."""
        if self.kv_events is not None:
            self._flush_kv_events()
            self.kv_events.close()

    # -- structured output -----------------------------------------------------------------

    def _fail_grammar_errors(self) -> None:
        """Fail waiting requests whose grammar did not compile (blocks: none held yet)."""
        for req in list(self.scheduler.waiting):
            so = req.structured_output
            if so is not None and so.matcher is None and so.error is not None:
                self.scheduler.abort_requests([req.request_id])
                self.failed.append((req.request_id, ValueError(f"structured_outputs: {so.error}")))

    def _wait_for_grammars(self) -> None:
        """Nothing ran: sleep until a compiling grammar is ready (at most 5 ms) rather than
        spin the step loop."""
        pending = [
            r.structured_output.future
            for r in self.scheduler.waiting
            if r.structured_output is not None and not r.structured_output.future.done()
        ]
        if pending:
            concurrent.futures.wait(pending, timeout=0.005, return_when="FIRST_COMPLETED")

    def pop_failed(self) -> list[tuple[str, BaseException]]:
        """``(request_id, error)`` of requests failed outside a step batch since the last call
        (their blocks are freed; no output was or will be made for them)."""
        failed, self.failed = self.failed, []
        return failed

    def fail_requests(
        self, exc: BaseException, request_ids: list[str] | None = None
    ) -> list[tuple[str, BaseException]]:
        """Abort requests after an engine error (blocks freed): ``request_ids``, or every
        request in flight when ``None``. Pin jobs among them fail with ``exc``.

        After ``step()`` raised, ``current_step_ids`` names the requests of that step (a
        request that step finished is reported failed too: its output was never returned).

        Returns:
            ``(request_id, exc)`` for each caller request, so the caller can deliver the error.
        """
        known = {r.request_id: r for r in self._step_requests}
        known.update(self.scheduler.requests)
        ids = list(known) if request_ids is None else list(dict.fromkeys(request_ids))
        failed: list[tuple[str, BaseException]] = []
        for rid in ids:
            req = known.get(rid)
            if req is None:
                continue
            if not req.is_finished():
                self.scheduler.abort_requests([rid])
            if req.pin_job is not None:
                req.pin_job.resolve(None, exc)
            else:
                failed.append((rid, exc))
        gone = set(ids)
        self._stashed = [o for o in self._stashed if o.request_id not in gone]
        self._step_requests = []
        return failed

    def fail_all(self, exc: BaseException) -> list[tuple[str, BaseException]]:
        """``fail_requests(exc)`` for every request in flight."""
        return self.fail_requests(exc, None)

    # -- prefix pins ---------------------------------------------------------------------

    def start_pin(
        self, pin: PinRequest, callback: Callable[[PinJob], None] | None = None
    ) -> PinJob:
        """Start pinning a prefix: queue an internal prefill of ``pin.token_ids`` (one greedy
        token); when it finishes, its full blocks (now in the prefix cache) are pinned for
        ``pin.ttl_s`` seconds and ``callback(job)`` runs. ``pin.tenant``: who the prefill and
        the pinned blocks are charged to (under ``fair`` they count against its share).

        Raises:
            ValueError: prefix caching disabled, or a bad prefix (see ``prepare_request``;
                shorter than one block); TypeError: ``pin`` is not a ``PinRequest`` (its own
                fields are checked when it is built).
        """
        if not isinstance(pin, PinRequest):
            raise TypeError(f"pin_prefix takes a PinRequest, got {type(pin).__name__}")
        if not self.config.enable_prefix_caching:
            raise ValueError("prefix pins need enable_prefix_caching=True")
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        rid = f"{PIN_REQUEST_PREFIX}{next(self._pin_counter)}"
        req = self.prepare_request(
            EngineRequest(rid, list(pin.token_ids), params, pin.cache_salt, tenant=pin.tenant)
        )
        if len(req.prompt_token_ids) < self.config.block_size:
            raise ValueError(
                f"a pinned prefix needs at least one full block ({self.config.block_size} tokens)"
            )
        job = PinJob(rid, req.prompt_token_ids, pin.ttl_s, pin.cache_salt, callback, pin.tenant)
        self._enqueue(req, pin_job=job)
        return job

    def _on_pin_request(self, req: Request) -> None:
        job = req.pin_job
        if not req.is_finished():  # cannot happen with max_tokens=1; be safe
            self.scheduler.abort_requests([req.request_id])
        try:
            pin = self.kv_cache_manager.pin(
                job.token_ids, job.cache_salt, job.ttl_s, tenant=job.tenant
            )
        except Exception as exc:  # noqa: BLE001 - delivered to the caller
            job.resolve(None, exc)
        else:
            job.resolve(pin, None)

    def pin_prefix(self, pin: PinRequest) -> PrefixPin:
        """Compute ``pin.token_ids`` (if not cached) and pin its full blocks for ``pin.ttl_s``
        seconds (charged to ``pin.tenant``, see ``start_pin``).

        Steps the engine until done; outputs of other requests produced meanwhile are returned
        by the next ``step()``.

        Returns:
            ``PrefixPin(id, num_tokens, expires_at, ...)``.

        Raises:
            PinLimitError: pins would exceed ``max_pinned_fraction`` of the cache.
            ValueError / TypeError: see ``start_pin``.
        """
        job = self.start_pin(pin)
        pending: list[StepOutput] = []
        while not job.done:
            pending.extend(self.step())
        self._stashed = pending + self._stashed
        if job.error is not None:
            raise job.error
        return job.result

    def get_pin(self, pin_id: str) -> PrefixPin:
        """The live pin ``pin_id`` (KeyError once released, revoked or past its TTL)."""
        return self.kv_cache_manager.get_pin(pin_id)

    def expire_pins(self, now: float | None = None) -> list[str]:
        """Release pins whose TTL has passed (``schedule()`` does this every step; call it when
        idle). Returns the released pin ids."""
        return self.kv_cache_manager.expire_pins(now)

    def anticipation_deadline(self) -> float | None:
        """Monotonic time until which a serving loop may wait before the next step for an
        idle tenant's next request (``Scheduler.anticipation_deadline``), or None."""
        return self.scheduler.anticipation_deadline()

    def note_anticipated(self, seconds: float) -> None:
        """A serving loop waited ``seconds`` on ``anticipation_deadline`` (stats)."""
        self.scheduler.anticipation.note_waited(seconds)

    def next_pin_expiry(self) -> float | None:
        """Earliest ``expires_at`` (``time.monotonic()`` seconds) of the live pins, or None."""
        return self.kv_cache_manager.next_pin_expiry()

    def unpin_prefix(self, pin_id: str) -> None:
        """Release a pin (its blocks become evictable once no request uses them).

        Raises:
            KeyError: unknown pin id.
        """
        self.kv_cache_manager.unpin(pin_id)

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Engine counters (docs/architecture.md ``stats()`` keys): requests, KV blocks, prefix
        cache.

        ``prompt_tokens_prefilled``: prompt tokens actually computed (a recompute after
        preemption counts its prompt part again; prefix-cache hits do not count);
        ``tokens_decoded``: output tokens sampled. Both are the scheduler's counters.
        With ``kv_events`` on, also the publisher's counters (``ZmqEventPublisher.stats``)."""
        stats = dict(self.scheduler.stats())
        if self.kv_events is not None:
            stats.update(self.kv_events.stats())
        return stats

    def load_stats(self) -> dict[str, Any]:
        """The queues, rates and seat schedule a first-token prediction reads
        (``Scheduler.load_stats``: the same values as ``stats()``'s keys, without the
        per-tenant table, KV and publisher counters)."""
        return self.scheduler.load_stats()

    def predict_ttft(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float | None:
        """Seconds until a new request of ``num_prompt_tokens`` would get its first token
        (``Scheduler.predict_ttft``; formula: ``load_model.estimate_ttft``), ``None`` before
        the rates are measured.

        Raises:
            ValueError / TypeError: bad token counts.
        """
        return self.scheduler.predict_ttft(num_prompt_tokens, num_cached_tokens)

    def check_invariants(self) -> None:
        """Raise AssertionError when a KV block is in two states or none, or the queues and
        the request table disagree."""
        self.scheduler.check_invariants()


def _start_kv_events(config: EngineConfig, manager: KVCacheManager) -> Any:
    """The KV event publisher of ``config.kv_events`` (installed on the block pool), or None.

    Raises:
        ValueError: an endpoint that cannot be bound.
    """
    if config.kv_events is None:
        return None
    from prefixgate.engine.kv_events import KVEventCollector, ZmqEventPublisher

    collector = KVEventCollector(config.block_size, config.kv_events_queue_size)
    publisher = ZmqEventPublisher(
        collector,
        config.kv_events,
        config.kv_events_replay,
        buffer_steps=config.kv_events_buffer_steps,
        topic=config.kv_events_topic,
    )
    manager.pool.events = collector
    return publisher


SIM_REFUSED_FIELDS = (
    "structured_outputs",
    "logprobs",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
)
"""Sampling fields the simulated runner cannot honour (its tokens are pseudo tokens)."""


WIRE_NAMES = {"structured_outputs": "response_format"}
"""A sampling field's name in the OpenAI API where it differs (an error's ``param``)."""


def _check_sim_params(params: SamplingParams) -> None:
    """Raise :class:`UnsupportedFieldError` naming the first field of ``SIM_REFUSED_FIELDS``
    that is set."""
    for name in SIM_REFUSED_FIELDS:
        if getattr(params, name, None) not in (None, [], {}):
            raise UnsupportedFieldError(
                f"{name} is not supported by runner='sim' (it computes no model)",
                WIRE_NAMES.get(name, name),
            )
    if params.bad_words_token_ids:
        raise UnsupportedFieldError(
            "bad_words is not supported by runner='sim' (it computes no model)", "bad_words"
        )


def _sim_num_blocks(config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    """KV blocks of a simulated replica: ``num_kv_blocks`` when given, else the profile's
    (rescaled to ``config.block_size``), else what ``kv_cache_memory`` (or the default
    budget) holds for the model's shape."""
    from prefixgate.engine.cost_model import load_profile

    profile = load_profile(config.sim_profile)
    if config.num_kv_blocks is None and profile.num_kv_blocks is not None:
        if config.kv_cache_memory is None:
            return max(1, profile.num_kv_blocks * profile.block_size // config.block_size)
    return resolve_num_blocks(spec, config.num_kv_blocks, config.kv_cache_memory, device)


def _sim_runner(config: EngineConfig, vocab_size: int, clock: Any) -> Any:
    from prefixgate.engine.cost_model import load_profile
    from prefixgate.engine.sim_runner import SimRunner

    return SimRunner(
        load_profile(config.sim_profile),
        vocab_size,
        seed=config.seed,
        eos_probability=config.sim_eos_probability,
        clock=clock,
    )


def _load_tokenizer(mc: Any) -> Any:
    if mc.model_path is None:
        return Tokenizer.builtin()
    return Tokenizer.from_pretrained(mc.model_path)


def _decode_graphs(config: EngineConfig, model, kv_caches, max_model_len: int, device):
    """``DecodeCudaGraphs`` when ``config.cuda_graphs`` (checked at model load), else None."""
    if not config.cuda_graphs:
        return None
    from prefixgate.engine.cuda_graphs import DecodeCudaGraphs

    width = -(-max_model_len // config.block_size)
    return DecodeCudaGraphs(
        model, kv_caches, config.max_num_seqs, width, config.block_size, torch.device(device)
    )
