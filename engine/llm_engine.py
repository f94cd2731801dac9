"""LLMEngine: the synchronous engine loop (vLLM v1's ``LLMEngine`` / ``EngineCore`` in one).

``add_request`` validates and queues; each ``step()`` schedules (continuous batching, chunked
prefill, preemption), runs the model runner once, updates the scheduler with the sampled tokens,
detokenizes and returns the ``RequestOutput`` of every request that produced a token (or
finished) in that step. Nothing here is thread-safe: ``AsyncEngine`` drives it from one thread.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.detokenizer import IncrementalDetokenizer
from prefixgate.engine.engine_pins import PIN_REQUEST_PREFIX, PinJob, PrefixPinsMixin
from prefixgate.engine.input_processor import InputProcessor, PreparedRequest
from prefixgate.engine.kv_cache import KVCacheSpec, allocate_kv_caches, resolve_num_blocks
from prefixgate.engine.kv_cache_manager import KVCacheManager
from prefixgate.engine.model_runner import ModelRunner
from prefixgate.engine.models.config import ModelConfig
from prefixgate.engine.models.loader import load_model
from prefixgate.engine.output_processor import OutputProcessor
from prefixgate.engine.outputs import RequestOutput
from prefixgate.engine.request import Request, RequestStatus
from prefixgate.engine.sampler import Sampler, SamplingState
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.scheduler import Scheduler
from prefixgate.engine.structured_output import StructuredOutputManager
from prefixgate.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine(PrefixPinsMixin):
    """The engine: tokenizer, scheduler + KV cache manager, model runner, output processor.

    Args:
        config: the ``EngineConfig``.

    Raises:
        ValueError / FileNotFoundError: bad config or model files (from the model loader).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = mc = ModelConfig.from_engine_config(config)
        self.tokenizer = _load_tokenizer(mc)
        self.max_model_len: int = mc.max_model_len
        self.device = torch.device(mc.device)
        model = load_model(mc, config)
        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, mc.dtype)
        num_blocks = resolve_num_blocks(
            spec, config.num_kv_blocks, config.kv_cache_memory, self.device
        )
        self.num_kv_blocks = num_blocks
        self._fit_max_model_len(num_blocks * config.block_size)
        kv_caches = allocate_kv_caches(spec, num_blocks, self.device)
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            max_pinned_blocks=int(num_blocks * config.max_pinned_fraction),
        )
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.max_model_len)
        self.eos_token_ids: set[int] = set(mc.eos_token_ids) | set(
            getattr(self.tokenizer, "eos_token_ids", set()) or set()
        )
        self.structured_output = StructuredOutputManager(
            self.tokenizer, mc.vocab_size, sorted(self.eos_token_ids)
        )
        self.runner = ModelRunner(
            model,
            kv_caches,
            Sampler(config.seed),
            SamplingState,
            config.block_size,
            self.device,
            structured_output=self.structured_output,
        )
        self.output_processor = OutputProcessor(self.tokenizer, IncrementalDetokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer, mc.vocab_size, self.max_model_len, self.structured_output
        )
        # (request id, error) of requests failed outside a step's batch (a grammar that did
        # not compile, a sampled token the grammar rejected); AsyncEngine delivers them
        self.failed: list[tuple[str, BaseException]] = []
        self._requests: dict[str, Request] = {}
        self._pin_jobs: dict[str, PinJob] = {}
        self._pin_counter = itertools.count()
        self._stashed: list[RequestOutput] = []
        self.current_step_ids: list[str] = []
        self._prompt_tokens_prefilled = 0
        self._tokens_decoded = 0
        # cumulative host wall-clock seconds per phase of step() (benchmarks read it)
        self.timing: dict[str, float] = dict.fromkeys(
            ("steps", "step_s", "schedule_s", "prepare_s", "forward_s", "sample_s", "output_s"), 0
        )

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

    def prepare_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """Validate and tokenize a request without queuing it (safe from any thread); see
        ``InputProcessor.prepare``."""
        return self.input_processor.prepare(prompt, params, cache_salt)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | PreparedRequest,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request.

        ``prompt + max_tokens`` beyond ``max_model_len`` caps generation at ``max_model_len``
        (vLLM's behaviour); a prompt of ``max_model_len`` tokens or more is an error.

        Raises:
            TypeError / ValueError: bad request id, prompt or params (see ``prepare_request``);
                duplicate request id; a request that can never fit in the KV cache.
        """
        if not isinstance(request_id, str) or not request_id:
            raise TypeError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if request_id.startswith(PIN_REQUEST_PREFIX):
            raise ValueError(f"request ids starting with {PIN_REQUEST_PREFIX!r} are reserved")
        prep = (
            prompt
            if isinstance(prompt, PreparedRequest)
            else self.prepare_request(prompt, params, cache_salt)
        )
        self._enqueue(request_id, prep, arrival_time or time.monotonic())

    def _enqueue(self, request_id: str, prep: PreparedRequest, arrival: float) -> None:
        req = Request(
            request_id,
            prep.prompt_token_ids,
            prep.params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=prep.max_tokens,
            cache_salt=prep.cache_salt,
            arrival_time=arrival,
        )
        if prep.params.seed is not None:
            gen = torch.Generator(device="cpu")  # the sampler draws on the generator's device
            gen.manual_seed(prep.params.seed)
            req.generator = gen
        if prep.params.structured_outputs is not None:  # compiles off the step loop
            req.structured_output = self.structured_output.request(prep.params.structured_outputs)
        self.scheduler.add_request(req)  # may raise (never fits): nothing else was touched
        self._requests[request_id] = req
        if not request_id.startswith(PIN_REQUEST_PREFIX):
            self.output_processor.add(
                request_id, prep.prompt, prep.prompt_token_ids, prep.params, arrival
            )

    def abort_request(self, request_id: str) -> RequestOutput:
        """Abort a request in flight and free its KV blocks at once.

        Returns:
            its final output (``finish_reason="abort"``).

        Raises:
            ValueError: unknown (or already finished) request id.
        """
        req = self._requests.get(request_id)
        if req is None or request_id.startswith(PIN_REQUEST_PREFIX):
            raise ValueError(f"unknown request id {request_id!r} (not in flight)")
        self.scheduler.abort_requests([request_id])
        return self._finish_output(req, "abort", None, time.monotonic())

    def has_unfinished_requests(self) -> bool:
        """True while any request (or pin job) is queued or running."""
        return bool(self._requests) or bool(self._stashed)

    @property
    def num_requests(self) -> int:
        """Requests in flight (waiting or running), internal pin requests included."""
        return len(self._requests)

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step.

        Returns:
            one ``RequestOutput`` per caller request that got a new token or finished this step
            (cumulative text / token ids + deltas).
        """
        t0 = time.perf_counter()
        self._fail_grammar_errors()
        sched_out = self.scheduler.schedule()
        if not sched_out.scheduled:
            self._wait_for_grammars()
            outputs, self._stashed = self._stashed, []
            return outputs
        # if anything below raises, these are the requests the error concerns (fail_requests)
        self.current_step_ids = [s.request.request_id for s in sched_out.scheduled]
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        op = self.output_processor
        for s in sched_out.scheduled:
            r = s.request
            op.mark_scheduled(r.request_id, now)
            c, n, p = r.num_computed_tokens, s.num_new_tokens, r.num_prompt_tokens
            if c < p:
                self._prompt_tokens_prefilled += min(c + n, p) - c
        t_run = time.perf_counter()
        run = self.runner.execute(sched_out)
        t_out = time.perf_counter()
        self.scheduler.update_from_output(sched_out, run.sampled)
        self._tokens_decoded += len(run.sampled)
        now = time.monotonic()
        for s in sched_out.scheduled:
            r = s.request
            rid = r.request_id
            token = run.sampled.get(rid)
            if token is None:
                continue
            if rid in self._pin_jobs:
                self._on_pin_request(r)
                continue
            if r.structured_output is not None and not r.is_finished():
                self._check_grammar(r)
                if rid not in self._requests:  # failed: delivered through pop_failed()
                    continue
            finished = r.is_finished()
            skip_text = finished and r.finish_reason == "stop"  # EOS / stop token id
            stop = op.on_token(rid, token, run.logprobs.get(rid), skip_text, now)
            if stop is not None and not finished:
                self._finish_stopped(r, stop)
                finished = True
            if finished:
                outputs.append(self._finish_output(r, r.finish_reason, r.stop_reason, now))
            else:
                outputs.append(
                    op.make_output(
                        rid, r.output_token_ids, max(r.num_cached_tokens, 0), None, None, now
                    )
                )
        self.current_step_ids = []
        outputs, self._stashed = self._stashed + outputs, []
        t_end = time.perf_counter()
        t = self.timing
        t["steps"] += 1
        t["step_s"] += t_end - t0
        t["schedule_s"] += t_run - t0  # schedule() + per-request bookkeeping
        t["prepare_s"] += run.prepare_s
        t["forward_s"] += run.forward_s
        t["sample_s"] += run.sample_s
        t["output_s"] += t_end - t_out  # scheduler update, detokenize, RequestOutputs
        return outputs

    # -- structured output -----------------------------------------------------------------

    def _check_grammar(self, req: Request) -> None:
        """After a sampled token: a grammar that reached its end finishes the request with
        "stop" (also with ``ignore_eos``); a token the grammar rejected fails it."""
        so = req.structured_output
        if so.terminated:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        elif so.rejected is not None:
            err = RuntimeError(
                f"request {req.request_id!r}: token {so.rejected} was sampled outside its "
                "structured_outputs grammar (no allowed token left)"
            )
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
            self._fail_later(req, err)

    def _fail_grammar_errors(self) -> None:
        """Fail waiting requests whose grammar did not compile (blocks: none held yet)."""
        for req in list(self.scheduler.waiting):
            so = req.structured_output
            if so is not None and so.matcher is None and so.error is not None:
                err = ValueError(f"structured_outputs: {so.error}")
                self.scheduler.abort_requests([req.request_id])
                self._fail_later(req, err)

    def _fail_later(self, req: Request, exc: BaseException) -> None:
        rid = req.request_id
        self._requests.pop(rid, None)
        self.output_processor.drop(rid)
        self.failed.append((rid, exc))

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

    def _finish_stopped(self, req: Request, stop: str) -> None:
        self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED, stop)

    def _finish_output(
        self, req: Request, reason: str | None, stop_reason: str | int | None, now: float
    ) -> RequestOutput:
        self._requests.pop(req.request_id, None)
        return self.output_processor.make_output(
            req.request_id,
            req.output_token_ids,
            max(req.num_cached_tokens, 0),
            reason or "stop",
            stop_reason,
            now,
        )

    def fail_requests(
        self, exc: BaseException, request_ids: list[str] | None = None
    ) -> list[tuple[str, BaseException]]:
        """Abort requests after an engine error (blocks freed): ``request_ids``, or every
        request in flight when ``None``. Pin jobs among them fail with ``exc``.

        After ``step()`` raised, ``current_step_ids`` names the requests of that step.

        Returns:
            ``(request_id, exc)`` for each caller request, so the caller can deliver the error.
        """
        ids = list(self._requests) if request_ids is None else list(request_ids)
        failed: list[tuple[str, BaseException]] = []
        for rid in ids:
            if rid not in self._requests:
                continue
            try:
                self.scheduler.abort_requests([rid])
            except ValueError:
                pass  # the scheduler finished it already
            self._requests.pop(rid, None)
            job = self._pin_jobs.pop(rid, None)
            if job is not None:
                self._resolve_pin(job, None, exc)
            else:
                self.output_processor.drop(rid)
                failed.append((rid, exc))
        gone = set(ids)
        self._stashed = [o for o in self._stashed if o.request_id not in gone]
        self.current_step_ids = []
        return failed

    def fail_all(self, exc: BaseException) -> list[tuple[str, BaseException]]:
        """``fail_requests(exc)`` for every request in flight."""
        return self.fail_requests(exc, None)

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Engine counters (DEVELOPERS.md ``stats()`` keys) — requests, KV blocks, prefix cache."""
        s: dict[str, Any] = dict(self.scheduler.stats())
        # prompt tokens actually computed (a recompute after preemption counts its prompt part
        # again; prefix-cache hits do not count), and output tokens sampled
        s["prompt_tokens_prefilled"] = self._prompt_tokens_prefilled
        s["tokens_decoded"] = self._tokens_decoded
        return s

    def check_invariants(self) -> None:
        """Raise AssertionError when a KV block is in two states or none, or the engine's
        bookkeeping disagrees with the scheduler's."""
        self.scheduler.check_invariants()
        for rid in self.output_processor.states:
            assert rid in self._requests, f"output state for {rid!r} without a request"


def _load_tokenizer(mc: Any) -> Any:
    if mc.model_path is None:
        return Tokenizer.builtin()
    return Tokenizer.from_pretrained(mc.model_path)
