"""The scheduler: which requests run each step and with how many tokens (continuous batching).

Each ``schedule()`` call (one engine step):

1. running requests first: decodes (1 token each), then their next prefill chunks, within the
   token budget ``max_num_batched_tokens``. When the KV cache has no block for one of them, the
   most recently admitted running request is preempted (blocks freed, status PREEMPTED, put at
   the front of the waiting queue, recomputed later from token 0 with its outputs kept). The
   oldest running request is never preempted for a newer one, so it always progresses: no endless
   preempt/resume cycle.
2. then, if nothing was preempted this step, waiting requests are admitted in the policy's
   order while the budget, ``max_num_seqs`` and free blocks allow; each reuses its longest
   cached prefix and prefills the rest in chunks (chunked prefill). A waiting request whose next
   prompt block is being computed by a running request (in-flight dedup) is skipped this step and
   hits that block once it is cached; requests behind it may go. A request whose grammar is
   still compiling (structured output) is skipped the same way.
   With ``scheduling="static"`` new requests are admitted only when the running batch is empty
   (and without in-flight dedup: waiting for an owner would mean waiting for the whole batch).
3. displacement (``priority`` and ``fair``, continuous scheduling): a waiting request that finds
   the seats or the blocks full may take them from running requests the policy names
   (``SchedulingPolicy.displaceable``): the fewest from the front of that list that make room
   are preempted (as in 1.; none when all of them would not make room). Under ``fair`` the
   step's token budget is first shared by tenant weight (``token_caps``), then what is left
   goes to anyone; see ``scheduling_policy.py`` for the shares and the bounds.

Speculative decoding (``EngineConfig.speculative_method="ngram"``,
``spec_decode.SpecDecoding``): a decode may carry draft tokens
(``ScheduledRequest.spec_token_ids``), its query growing to ``1 + k`` tokens; drafts get KV
slots only when blocks are free (a request that cannot have them decodes plainly: drafts never
preempt anyone) and live only in the step's ``ScheduledRequest``, so a preempted request has
none. ``update_from_output`` takes the runner's accepted drafts + bonus token per such
request, appends them one by one (each through ``Request.check_stop``: EOS, stop ids, stop
strings and ``max_tokens`` end the run at that token), keeps ``num_computed_tokens`` at the
last accepted draft and frees the blocks that only rejected drafts used.

Rates and predictions (``stats()``'s rates and seat schedule, ``predict_ttft``) are the load
model's (``load_model.py``): the scheduler feeds it each step's time, tokens and finishes.

What a step runs is ``scheduler_output.py``'s. The flow and vocabulary follow vLLM v1
(``vllm/v1/core/sched/scheduler.py``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from prefixgate.engine.anticipation import Anticipation
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.errors import CacheCapacityError
from prefixgate.engine.kv_cache_manager import KVCacheManager
from prefixgate.engine.load_model import LoadModel, estimate_ttft
from prefixgate.engine.request import Request, RequestStatus
from prefixgate.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from prefixgate.engine.scheduling_policy import Room, SchedulingPolicy, make_policy, tenant_of
from prefixgate.engine.spec_decode import NgramProposer, SpecDecoding


class Scheduler:
    """Continuous (or static) batching over a ``KVCacheManager``.

    Args:
        config: ``max_num_seqs``, ``max_num_batched_tokens``, ``scheduling`` are read.
        kv_cache_manager: the block manager.
        max_model_len: longest prompt + output (tokens).
    """

    def __init__(
        self, config: EngineConfig, kv_cache_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.static = config.scheduling == "static"
        self.policy: SchedulingPolicy = make_policy(
            config.scheduling_policy,
            config.fair_input_weight,
            config.fair_output_weight,
            config.tenant_weights,
            config.fair_first_step_alone,
        )
        # fair: a short wait for a light tenant's next request (engine/anticipation.py)
        self.anticipation = Anticipation(
            config.fair_anticipation_ms / 1000.0
            if self.policy.anticipatory and not self.static
            else 0.0
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_displacements = 0  # preemptions of running requests for waiting ones
        self.prompt_tokens_prefilled = 0
        self.tokens_decoded = 0
        self._step_started: float | None = None
        self._admitted_now: set[str] = set()
        self._held_last = False  # the last step held tenants back (FairPolicy.hold_back)
        self._first_now: list[Request] = []  # first scheduled in the step now running
        self._steps_scheduled = 0  # non-empty steps so far (``Request.arrival_step``)
        self.load = LoadModel()  # rates, finish rate, step time, seat schedule
        self.spec: SpecDecoding | None = None  # drafts, their acceptance, the counters
        if config.speculative_method == "ngram":
            proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
            self.spec = SpecDecoding(proposer, config.spec_min_acceptance)

    # ---- queue state --------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # ---- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (WAITING).

        The prompt was checked against ``max_model_len`` where the request was built
        (``InputProcessor.prepare``, the one check of a prompt).

        Raises:
            ValueError: duplicate request id.
            CacheCapacityError (ValueError): prompt + max_tokens can never fit in the KV cache,
                even with every block free.
        """
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        final_len = min(
            request.num_prompt_tokens + request.max_tokens,
            max(self.max_model_len, request.num_prompt_tokens + 1),
        )
        # the last sampled token is never fed back, so the KV holds final_len - 1 tokens
        need = self.kv.blocks_needed(max(final_len - 1, request.num_prompt_tokens))
        if need > self.kv.num_blocks:
            raise CacheCapacityError(
                f"request {rid!r}: {request.num_prompt_tokens} prompt tokens + max_tokens="
                f"{request.max_tokens} need {need} KV blocks of {self.kv.block_size} tokens, but the "
                f"cache has {self.kv.num_blocks}"
            )
        request.status = RequestStatus.WAITING
        request.arrival_step = self._steps_scheduled
        self.policy.on_arrival(request, self.waiting)
        self.load.arrivals.add(tenant_of(request), time.monotonic())
        if self.anticipation.max_wait_s > 0:
            self.anticipation.on_arrival(tenant_of(request), time.monotonic())
        self.requests[rid] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Abort requests now: blocks freed, status FINISHED_ABORTED.

        Raises:
            ValueError: an id is unknown or already finished (then nothing is aborted).
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        unknown = [i for i in ids if i not in self.requests]
        if unknown:
            raise ValueError(f"unknown request id(s): {unknown}")
        return self._finish(
            [self.requests[i] for i in dict.fromkeys(ids)], RequestStatus.FINISHED_ABORTED
        )

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus,
        stop_reason: int | str | None = None,
    ) -> list[Request]:
        """Finish requests from outside (e.g. the detokenizer matched a stop string).

        Ids that are unknown or already finished are ignored (a request may have ended in
        ``update_from_output`` the same step). Returns the requests finished now.

        Raises:
            ValueError: ``status`` is not a finished status.
        """
        if not RequestStatus(status).is_finished():
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status!r}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        reqs = [self.requests[i] for i in dict.fromkeys(ids) if i in self.requests]
        if stop_reason is not None:
            for r in reqs:
                r.stop_reason = stop_reason
        return self._finish(reqs, RequestStatus(status))

    def _finish(self, reqs: list[Request], status: RequestStatus) -> list[Request]:
        if not reqs:
            return []
        gone = {r.request_id for r in reqs}
        self.running = [r for r in self.running if r.request_id not in gone]
        if any(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in reqs):
            self.waiting = deque(r for r in self.waiting if r.request_id not in gone)
        now = time.monotonic()
        for r in reqs:
            self.kv.free(r)
            self.policy.on_finish(r)
            r.status = status
            r.finished_time = now
            del self.requests[r.request_id]
            self._finished_ids.append(r.request_id)
        if self.anticipation.max_wait_s > 0:
            left = {tenant_of(r) for r in self.requests.values()}
            for t in {tenant_of(r) for r in reqs} - left:
                self.anticipation.on_idle(t, now)
        return reqs

    def anticipation_deadline(self, now: float | None = None) -> float | None:
        """Monotonic time until which the loop may wait before the next step for an idle
        tenant's next request (``engine/anticipation.py``; the policy says who may be waited
        for), or None: step now."""
        if self.anticipation.max_wait_s <= 0 or not self.running:
            return None
        return self.anticipation.deadline(
            time.monotonic() if now is None else now,
            lambda t: self.policy.anticipates(
                t, self.running, self.max_num_seqs, self.kv.num_blocks
            ),
        )

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their KV slots."""
        self.kv.expire_pins()
        self._step_started = time.monotonic()
        self._admitted_now = set()
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []
        # fair: the first round's per-tenant token caps, and the tokens given so far
        caps = None if self.static else self.policy.token_caps(budget, self.running, self.waiting)
        used: dict[str, int] = {}

        # fair: tenants whose requests sit this step out so that a light request's first
        # step runs without them (never two steps in a row: they run at least every other)
        hold: set[str] = set()
        if not self.static and not self._held_last:
            hold = self.policy.hold_back(
                self.running, self.waiting, self.max_num_seqs, self.kv.num_blocks
            )

        # 1. running requests: decodes before prefill chunks, each in admission order
        held = [r for r in self.running if tenant_of(r) in hold] if hold else []
        budget = self._run_running(
            [r for r in self.running if tenant_of(r) not in hold] if hold else self.running,
            budget,
            scheduled,
            preempted,
            caps,
            used,
        )

        # 2. waiting requests, in the scheduling policy's order
        admits = not preempted and (not self.static or not self.running)
        if admits:
            budget = self._admit(budget, scheduled, preempted, caps, used, hold)
        if hold and not any(
            r.first_step_tokens == 0 and tenant_of(r) not in hold
            for r in (self.requests[rid] for rid in self._admitted_now)
        ):  # no first step came of holding back: the held requests run in this step
            hold = set()
            budget = self._run_running(held, budget, scheduled, preempted, caps, used)
        self._held_last = bool(hold)
        if caps is not None and budget > 0:  # second round: what is left, to anyone
            budget = self._extend(budget, scheduled, hold)
            if admits:
                budget = self._admit(budget, scheduled, preempted, hold=hold)

        out = list(scheduled.values())
        out.sort(key=lambda s: not s.is_decode)  # stable: decodes first
        finished, self._finished_ids = self._finished_ids, []
        result = SchedulerOutput(out, sum(s.num_new_tokens for s in out), preempted, finished)
        self._note_first_steps(result)
        return result

    def _run_running(
        self,
        reqs: list[Request],
        budget: int,
        scheduled: dict[str, ScheduledRequest],
        preempted: list[str],
        caps: dict[str, int] | None,
        used: dict[str, int],
    ) -> int:
        """Schedule the running ``reqs`` (decodes before prefill chunks, each in admission
        order), preempting the policy's victim when KV blocks run out; returns the budget
        left."""
        decodes = [r for r in reqs if r.num_tokens - r.num_computed_tokens == 1]
        chunks = [r for r in reqs if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + chunks:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if caps is not None and num_new > 1:
                num_new = min(num_new, self._cap_left(req, caps, used, budget))
                if num_new <= 0:
                    continue  # over its share this round: the second round may serve it
            drafts = self._propose(req, budget - num_new, caps, used) if num_new == 1 else []
            if drafts and self.kv.allocate_slots(req, 1 + len(drafts)):
                scheduled[req.request_id] = self._schedule(req, 1 + len(drafts), drafts)
                budget -= 1 + len(drafts)
                used[tenant_of(req)] = used.get(tenant_of(req), 0) + 1 + len(drafts)
                continue
            while not self._allocate(req, num_new):
                victim = self.policy.victim(self.running)
                budget += self._preempt(victim, scheduled, used)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = self._schedule(req, num_new)
                budget -= num_new
                used[tenant_of(req)] = used.get(tenant_of(req), 0) + num_new
        return budget

    def _note_first_steps(self, out: SchedulerOutput) -> None:
        """The timeline of first admissions (``Request.steps_waited``, ``first_step_tokens``,
        ``first_chunk_tokens``): the step a request first runs in, and the steps it waited
        (the non-empty steps scheduled since its arrival; derived, no pass over the queue)."""
        if out.is_empty:
            return
        self._first_now = []
        for s in out.scheduled:
            r = s.request
            if r.first_step_tokens == 0:
                r.first_step_tokens = out.num_scheduled_tokens
                r.first_chunk_tokens = s.num_new_tokens
                r.steps_waited = self._steps_scheduled - r.arrival_step
                self._first_now.append(r)
        self._steps_scheduled += 1

    def _schedule(
        self, req: Request, num_new: int, drafts: list[int] | None = None
    ) -> ScheduledRequest:
        return ScheduledRequest(
            req,
            num_new,
            self.kv.get_block_ids(req.request_id),
            req.num_computed_tokens,
            drafts if drafts is not None else [],
        )

    def _propose(
        self,
        req: Request,
        room: int,
        caps: dict[str, int] | None,
        used: dict[str, int],
    ) -> list[int]:
        """Draft tokens for a decode of ``req`` within ``room`` budget tokens and its tenant's
        cap (``SpecDecoding.propose``; ``[]`` without speculation)."""
        if self.spec is None:
            return []
        cap = None if caps is None else self._cap_left(req, caps, used, room + 1) - 1
        return self.spec.propose(req, room, self.max_model_len, cap)

    @staticmethod
    def _cap_left(req: Request, caps: dict[str, int], used: dict[str, int], budget: int) -> int:
        t = tenant_of(req)
        return caps.get(t, budget) - used.get(t, 0)

    def _extend(
        self,
        budget: int,
        scheduled: dict[str, ScheduledRequest],
        hold: AbstractSet[str] = frozenset(),
    ) -> int:
        """Second round: running prefills (but ``hold``'s tenants') get more of the budget
        left (admission order); returns the budget left. Never preempts: a chunk that does
        not fit stays as it is."""
        for req in self.running:
            if budget <= 0:
                break
            if hold and tenant_of(req) in hold:
                continue
            s = scheduled.get(req.request_id)
            have = s.num_new_tokens if s is not None else 0
            extra = min(req.num_tokens - req.num_computed_tokens - have, budget)
            if extra <= 0 or not self.kv.allocate_slots(req, have + extra):
                continue
            scheduled[req.request_id] = self._schedule(req, have + extra)
            budget -= extra
        return budget

    def _admit(
        self,
        budget: int,
        scheduled: dict[str, ScheduledRequest],
        preempted: list[str],
        caps: dict[str, int] | None = None,
        used: dict[str, int] | None = None,
        hold: AbstractSet[str] = frozenset(),
    ) -> int:
        """Admit waiting requests into ``scheduled`` in the policy's order (``pick``), with
        displacement where the policy has it, none of ``hold``'s tenants; returns the budget
        left."""
        skipped: set[str] = (
            {r.request_id for r in self.waiting if tenant_of(r) in hold} if hold else set()
        )
        now = time.monotonic()
        bs = self.kv.block_size
        displaces = self.policy.displaces and not self.static
        used = {} if used is None else used
        while budget > 0:
            full = len(self.running) >= self.max_num_seqs
            if full and not displaces:
                break
            req = self.policy.pick(self.waiting, skipped)
            if req is None:
                break
            if req.waits_for_grammar:  # structured output: its grammar is still compiling
                skipped.add(req.request_id)
                continue
            if full:  # the policy's seat decision first: no prefix lookup for a refusal
                verdict = self.policy.seat_verdict(
                    req, self.running, self.waiting, self.max_num_seqs, self.kv.num_blocks
                )
                if verdict == "skip":
                    self._skip_tenant(req, skipped)
                    continue
                if verdict == "stop":
                    break
            num_new = req.num_tokens
            if caps is not None:
                num_new = self._cap_left(req, caps, used, budget)
                if num_new <= 0:  # its tenant had its share of this round
                    self._skip_tenant(req, skipped)
                    continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            if (
                not self.static  # static: waiting for the owner would mean waiting for the drain
                and len(hits) < (req.num_tokens - 1) // bs
                and self.kv.pending_owner(req, len(hits))
            ):
                skipped.add(req.request_id)  # in-flight dedup: wait for the owner
                continue
            num_new = min(req.num_tokens - num_hit, budget, num_new)
            if full or not self._allocate(req, num_new, num_hit, hits):
                if not displaces:
                    break  # nothing overtakes (in policy order) a request that does not fit
                room = self._room(req, num_new, num_hit, hits, full)
                fits, back = self._displace(req, room, num_new, num_hit, hits, scheduled, used)
                preempted.extend(
                    r.request_id for r in room.running if r.status != RequestStatus.RUNNING
                )
                budget += back
                if not fits:
                    if self.policy.may_overtake(req, room):
                        self._skip_tenant(req, skipped)
                        continue
                    break
            self._start(req, num_hit, now)
            self._admitted_now.add(req.request_id)
            scheduled[req.request_id] = self._schedule(req, num_new)
            budget -= num_new
            used[tenant_of(req)] = used.get(tenant_of(req), 0) + num_new
        return budget

    def _skip_tenant(self, req: Request, skipped: set[str]) -> None:
        t = tenant_of(req)
        skipped.update(r.request_id for r in self.waiting if tenant_of(r) == t)

    def _room(
        self,
        req: Request,
        num_new: int,
        num_hit: int,
        hits: list,
        full: bool,
    ) -> Room:
        grow, short = self.kv.num_blocks_short(req, num_new, num_hit, hits)
        return Room(
            running=list(self.running),
            waiting=self.waiting,
            need_seat=full,
            need_blocks=grow,
            short_blocks=short,
            blocks_held=lambda r: self.kv.num_request_blocks(r.request_id),
            freeable=lambda r: self.kv.num_freeable_blocks(r.request_id),
            recompute=self._recompute_tokens,
            max_num_seqs=self.max_num_seqs,
            num_blocks=self.kv.num_blocks,
            pinned_blocks=self.kv.pinned_blocks_by_tenant(),
            exempt=set(self._admitted_now),  # (the policy adds its own)
        )

    def _recompute_tokens(self, req: Request) -> int:
        """Tokens preempting running ``req`` now would make it compute again: its computed
        tokens past the last full block (full blocks stay in the prefix cache, unless evicted
        before it resumes), or all of them without prefix caching."""
        if not self.kv.enable_prefix_caching:
            return req.num_computed_tokens
        return req.num_computed_tokens % self.kv.block_size

    def _displace(
        self,
        req: Request,
        room: Room,
        num_new: int,
        num_hit: int,
        hits: list,
        scheduled: dict[str, ScheduledRequest],
        used: dict[str, int],
    ) -> tuple[bool, int]:
        """Preempt the fewest of the policy's candidates that make room for ``req`` and
        allocate its slots. Returns ``(fits, budget given back by the victims)``; nothing is
        preempted when the candidates cannot make room (by the freeable-block count)."""
        victims = self.policy.displaceable(req, room)
        seats, freed, n = 0, 0, 0
        for v in victims:
            if (not room.need_seat or seats >= 1) and freed >= room.short_blocks:
                break
            seats += 1
            freed += room.freeable(v)
            n += 1
        if n == 0 or freed < room.short_blocks:
            return False, 0
        back = 0
        for i, v in enumerate(victims):
            if i >= n and self._allocate(req, num_new, num_hit, hits):
                return True, back
            back += self._preempt(v, scheduled, used)
            self.num_displacements += 1
            self.policy.on_displace(v)
        return self._allocate(req, num_new, num_hit, hits), back

    def _allocate(
        self, req: Request, num_new: int, num_hit: int = 0, hits: list | None = None
    ) -> bool:
        """``allocate_slots``; when ``req`` would run alone, prefix pins yield (oldest first).

        add_request guarantees a lone request fits the whole cache; pins may not keep it out
        forever (that would be an endless preempt/resume cycle), so they are revoked.
        """
        while not self.kv.allocate_slots(req, num_new, num_hit, hits or ()):
            if any(r is not req for r in self.running) or not self.kv.revoke_oldest_pin():
                return False
        return True

    def _start(self, req: Request, num_hit: int, now: float) -> None:
        """Move ``req`` from the waiting queue to running with ``num_hit`` cached tokens."""
        if self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        req.num_computed_tokens = num_hit
        if req.first_scheduled_time is None:  # first admission
            req.num_cached_tokens = num_hit
            req.first_scheduled_time = now
            self.policy.on_first_admission(req, self.waiting)
            self.kv.record_query(req.num_prompt_tokens, num_hit)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.kv.mark_pending(req)

    def _preempt(
        self,
        req: Request,
        scheduled: dict[str, ScheduledRequest],
        used: dict[str, int] | None = None,
    ) -> int:
        """Preempt ``req`` (recompute later); returns the budget its schedule gave back (and
        takes it off its tenant's ``used`` tokens)."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        s = scheduled.pop(req.request_id, None)
        if s is None:
            return 0
        if used is not None:
            used[tenant_of(req)] = used.get(tenant_of(req), 0) - s.num_new_tokens
        return s.num_new_tokens

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: Mapping[str, int | Sequence[int]],
    ) -> list[Request]:
        """Advance the step's requests, append sampled tokens, and finish the done ones.

        Args:
            scheduler_output: what ``schedule()`` returned for this step.
            sampled_token_ids: request id → sampled token, for each scheduled request that
                samples (``ScheduledRequest.samples``); tokens for others are ignored. For a
                request with drafts: the list of its accepted drafts then one more token (the
                correction or bonus), 1 to ``len(spec_token_ids) + 1`` ids.

        Returns:
            Requests finished this step, as ``Request.check_stop`` decided (EOS unless
            ``ignore_eos``, a stop token id, a stop string, ``max_tokens`` or
            ``max_model_len``); their blocks are freed already.

        Raises:
            ValueError: a sampling request has no token in ``sampled_token_ids``, or a
                request with drafts got more than ``len(spec_token_ids) + 1`` or no token.
        """
        live = [
            s
            for s in scheduler_output.scheduled
            if s.request.status == RequestStatus.RUNNING
            and self.requests.get(s.request.request_id) is s.request
        ]  # skips requests aborted / finished since schedule()
        missing = [
            s.request.request_id
            for s in live
            if s.samples and s.request.request_id not in sampled_token_ids
        ]
        if missing:  # checked before anything changes
            raise ValueError(f"no sampled token for request(s) {missing}")
        for s in live:
            got = sampled_token_ids.get(s.request.request_id)
            if s.samples and not isinstance(got, int):
                if got is None or not 1 <= len(got) <= len(s.spec_token_ids) + 1:
                    raise ValueError(
                        f"request {s.request.request_id!r}: {got!r} is not 1 to "
                        f"{len(s.spec_token_ids) + 1} sampled tokens"
                    )
        finished: list[Request] = []
        now = time.monotonic()
        prefill_before = self.prompt_tokens_prefilled
        for s in live:
            req = s.request
            c, samples = s.num_computed_tokens, s.samples  # (samples reads num_tokens)
            if s.spec_token_ids:
                if samples:
                    status = self._accept_run(s, sampled_token_ids[req.request_id], now)
                    if status is not None:
                        finished.extend(self._finish([req], status))
                continue
            if c < req.num_prompt_tokens:  # prompt tokens computed (a recompute counts again)
                self.prompt_tokens_prefilled += min(c + s.num_new_tokens, req.num_prompt_tokens) - c
            req.num_computed_tokens = c + s.num_new_tokens
            status = None
            if samples:
                token = sampled_token_ids[req.request_id]
                req.append_output_token(token if isinstance(token, int) else token[0], now)
                self._on_token(req)
            self.kv.cache_blocks(req, req.num_computed_tokens)
            status = req.check_stop(self.max_model_len) if samples else None
            if status is not None:
                finished.extend(self._finish([req], status))
        self.load.on_finished(finished)
        self._measure(
            scheduler_output, self.prompt_tokens_prefilled - prefill_before, len(finished), now
        )
        return finished

    def _accept_run(
        self, s: ScheduledRequest, tokens: int | Sequence[int], now: float
    ) -> RequestStatus | None:
        """Apply one verify step of ``s`` (drafts ``d_1..d_k`` at positions ``c+1..c+k``;
        ``SpecDecoding.accept`` appends the run): ``num_computed_tokens`` becomes ``c + 1 +``
        the accepted drafts kept, and blocks beyond it (written only by rejected drafts) go
        back to the pool. Returns the finished status or ``None``."""
        req, spec = s.request, self.spec
        assert spec is not None  # drafts come only from it
        c, k = s.num_computed_tokens, len(s.spec_token_ids)
        num_plain = s.num_new_tokens - k  # the query's tokens before the drafts (1)
        if c < req.num_prompt_tokens:  # a one-token prompt tail carried drafts
            self.prompt_tokens_prefilled += min(c + num_plain, req.num_prompt_tokens) - c
        kept, status = spec.accept(req, tokens, k, now, self.max_model_len, self._on_token)
        # KV is valid through the last accepted draft the request kept
        req.num_computed_tokens = c + num_plain + kept
        self.kv.cache_blocks(req, req.num_computed_tokens)
        if status is None:
            self.kv.trim(req, req.num_computed_tokens)
        return status

    def _on_token(self, req: Request) -> None:
        """Count one sampled token of ``req`` (the scheduler's and the policy's counters)."""
        self.tokens_decoded += 1
        self.policy.on_output_token(req)

    def _measure(
        self, out: SchedulerOutput, num_prefill: int, num_finished: int, now: float
    ) -> None:
        """Time one step (model time: ``schedule()`` to now) for its first-scheduled requests'
        ``first_step_s`` and fold it into the load model."""
        started, self._step_started = self._step_started, None
        first, self._first_now = self._first_now, []
        if started is None or out.is_empty:
            return
        dt = now - started
        for r in first:
            r.first_step_s = dt
        self.load.on_step(
            dt,
            now,
            num_prefill,
            out.num_scheduled_tokens - num_prefill,
            num_finished,
            self.has_unfinished_requests(),
        )

    def queued_prefill_tokens(self, net_of_cache: bool = False) -> int:
        """Prompt (and, for preempted requests, recompute) tokens still to prefill: waiting
        requests' whole contexts (with ``net_of_cache``, less what the prefix cache holds of
        each now: one lookup per waiting request) and running requests' uncomputed tokens
        beyond one."""
        if net_of_cache:
            waiting = sum(r.num_tokens - self.kv.get_computed_blocks(r)[1] for r in self.waiting)
        else:
            waiting = sum(r.num_tokens for r in self.waiting)
        running = sum(
            r.num_tokens - r.num_computed_tokens
            for r in self.running
            if r.num_tokens - r.num_computed_tokens > 1
        )
        return waiting + running

    def predict_ttft(
        self,
        num_prompt_tokens: int,
        num_cached_tokens: int = 0,
        stats: Mapping[str, Any] | None = None,
    ) -> float | None:
        """Predicted seconds until a request of ``num_prompt_tokens`` (``num_cached_tokens`` of
        them prefix-cache hits) arriving now would get its first token; ``estimate_ttft`` on
        ``stats`` (a caller's ``load_stats()``/``stats()`` snapshot, read only with this
        scheduler's bounds: safe from another thread) or, when None, ``load_stats()`` now.
        ``None`` before the rates are measured.

        Raises:
            ValueError / TypeError: see ``estimate_ttft``.
        """
        return estimate_ttft(
            self.load_stats() if stats is None else stats,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            num_prompt_tokens,
            num_cached_tokens,
        )

    # ---- stats and checks ---------------------------------------------------------------
    def load_stats(self) -> dict[str, Any]:
        """The part of ``stats()`` a first-token prediction reads (``estimate_ttft``, the
        gateway's ``EngineWait``): the queues (``num_running``, ``num_waiting``,
        ``queued_prefill_tokens``, ``running_decodes``) and the load model's rates and seat
        schedule, the same values as ``stats()``'s; O(running + waiting), without the
        per-tenant table or the KV counters. ``overtake_per_s``: for each tenant the policy
        serves after the others' new requests (``SchedulingPolicy.over_share``), the others'
        arrivals per second that go before its waiting requests (``LoadModel.overtake_per_s``;
        ``estimate_ttft``'s argument of that name)."""
        over = self.policy.over_share(
            self.running, self.waiting, self.max_num_seqs, self.kv.num_blocks
        )
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "queued_prefill_tokens": self.queued_prefill_tokens(),
            "running_decodes": sum(
                1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1
            ),
            **self.load.stats(
                self.running,
                self.max_num_batched_tokens,
                self.max_model_len,
                self.waiting,
                self.max_num_seqs,
            ),
            "overtake_per_s": self.load.overtake_per_s(over, time.monotonic()),
        }

    def stats(self) -> dict[str, Any]:
        """Queue, token and KV counters (keys as docs/architecture.md ``stats()``), the
        policy's name and per-tenant service (``tenants``)."""
        return {
            **self.load_stats(),
            "num_preemptions": self.num_preemptions,
            "num_displacements": self.num_displacements,
            "prompt_tokens_prefilled": self.prompt_tokens_prefilled,
            "tokens_decoded": self.tokens_decoded,
            **(self.spec.stats() if self.spec is not None else {}),
            **(self.anticipation.stats() if self.anticipation.max_wait_s > 0 else {}),
            "scheduling_policy": self.policy.name,
            "tenants": self.policy.tenant_stats(self.waiting, self.running),
            **self.kv.stats(),
        }

    def check_invariants(self) -> None:
        """Raise AssertionError on inconsistent queues or a block in two states or none."""
        self.kv.check_invariants()
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert len(ids) == len(set(ids)), "request both running and waiting"
        assert set(ids) == set(self.requests), "request table and queues disagree"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, r
            need = self.kv.blocks_needed(r.num_computed_tokens)
            assert self.kv.num_request_blocks(r.request_id) >= need, r
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r
            assert self.kv.num_request_blocks(r.request_id) == 0, r
