"""Scheduling policies: which waiting request is admitted next, and which running one yields.

``EngineConfig.scheduling_policy``:

- ``"fcfs"``: first come first served (the waiting queue's order; preempted requests go back
  to its front); the preemption victim is the most recently admitted running request.
- ``"priority"``: as vLLM's ``priority`` policy — each request has an int ``priority``, lower
  runs first, ties by arrival time; the victim is the running request with the largest
  ``(priority, arrival_time)``.
- ``"fair"``: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving Large
  Language Models" (OSDI 2024). Each tenant has a counter of the service it received:
  ``(w_in * input tokens + w_out * output tokens) / weight(tenant)`` (input tokens charged at
  first admission, output tokens as they are sampled). The backlogged tenant (one with waiting
  requests) with the least counter is admitted next (its earliest request); a tenant that
  returns from idle has its counter lifted to the least counter of the backlogged tenants (or,
  when none is backlogged, to the current counter of the last tenant that left the queue), so idling
  earns no credit. Admission stays work-conserving (any tenant with a fitting request runs
  while capacity is left) and the service difference between two backlogged tenants stays
  within the paper's bound of ``2 * max(w_in * L_in + w_out * L_out)`` (Theorem 4.4). The
  victim is the running request of the tenant with the largest counter (latest admitted first).

Displacement (a waiting request takes a running one's place when seats or KV blocks are full;
the displaced request is preempted: blocks freed, recomputed later with its outputs kept, so
greedy outputs do not change):

- ``priority``: a waiting request displaces running requests of a strictly larger ``priority``
  value (largest ``(priority, arrival)`` first) when ``max_num_seqs`` seats or KV blocks are
  full (vllm#40004's case). Never a loop: a request only displaces strictly lower priorities,
  and the displaced one can never displace back.
- ``fair`` (fair running slots): when several tenants are active (running or waiting), tenant
  ``t`` is entitled to ``seats(t) = max(1, floor(max_num_seqs * w_t / W))`` running sequences
  and ``blocks(t) = floor(num_blocks * w_t / W)`` KV blocks (``W``: the weights of the active
  tenants; the blocks a tenant holds count its running requests' tables and its prefix pins).
  A waiting request whose tenant is within its shares (counting the request) displaces the
  cheapest running requests to recompute (``Room.recompute``: the tokens past their last
  full block, which the prefix cache keeps) of tenants over theirs whose VTC counter is no
  less than its own
  tenant's (VTC's order decides who goes first; the seats follow it), never taking a tenant
  below its share, so the VTC service bound above still holds. A
  tenant at or over its share does not hold back the tenants behind it in VTC order (they are
  tried next). Seats that free up follow VTC's order: the tenant VTC ranks first (the least
  served) may take more than its share of them; the shares bound what displacement takes,
  not VTC's own admissions. Each step's token budget is shared too: while two or more tenants want tokens,
  a first round gives each at most ``floor(max_num_batched_tokens * w_t / W)`` (decodes
  included), then what is left goes to anyone (work-conserving). A light request's first
  step runs alone (``FairPolicy.hold_back``): while a request that never ran waits and its
  tenant is within its seat share, the tenants over their seat shares sit that step out, so
  its time to first token is one short step rather than a step carrying every heavy decode;
  the scheduler never holds back two steps in a row.

  Bounds (tests hold each): (1) hysteresis, no preemption loop: a request preempted for
  fairness samples at least ``fair_min_progress`` (16) output tokens before it may be
  preempted for fairness again, so a request of ``max_tokens`` output tokens is preempted for
  fairness at most ``1 + max_tokens // 16`` times; among the candidates of a tenant the
  cheapest to recompute go first, then the least often preempted (spreading the cost), then
  the newest; (2) displacement only
  moves a seat from a tenant over its share to one under it, so ``sum_t max(0, held(t) -
  share(t))`` drops with each one and only admissions into free seats raise it; (3) a waiting
  request of a tenant under its shares whose counter is no larger than an over-share tenant's
  is admitted in the first step whose decode phase preempts nothing, as long as that tenant
  has a running request outside the hysteresis; (4) the heavy tenant's starvation bound: it
  keeps at least ``seats(heavy)`` running sequences whenever it has that many requests (it is
  never displaced below its share), and a request preempted for fairness is older than every
  waiting request of its tenant that never ran (VTC is first come first served within a
  tenant), so it takes the first of its tenant's seats that frees up unless an older
  preempted one is waiting too; in the tests' flood it resumes within the steps one heavy
  request takes alone (prefill steps + ``max_tokens``); the first step alone delays a held
  tenant's requests by at most one step in two (never two held steps in a row), so each of
  its running requests samples a token at least every other step.

Every policy keeps per-tenant statistics (served input / output tokens, queue lengths).
Requests without a tenant belong to tenant ``"default"``. A policy class declares what it
reads: ``uses_priority`` (request priority) and ``uses_tenant_weights`` (tenant weights), so
the gateway asks the policy (``policy_class(name)``) instead of naming policies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from prefixgate.engine.request import Request

DEFAULT_TENANT = "default"


@dataclass(slots=True)
class TenantStats:
    """Service one tenant received (tokens) and its fair-share counter."""

    served_input_tokens: int = 0
    served_output_tokens: int = 0
    counter: float = 0.0


def tenant_of(req: Request) -> str:
    """The tenant a request is charged to (``"default"`` when it has none)."""
    return req.tenant or DEFAULT_TENANT


@dataclass(slots=True)
class Room:
    """What a waiting request lacks to be admitted, and what it could take it from.

    Attributes:
        running: the running requests, admission order (the last admitted last).
        waiting: the waiting queue (the request itself included).
        need_seat: True when all ``max_num_seqs`` seats are taken.
        need_blocks: KV blocks this admission allocates (its new blocks).
        short_blocks: blocks missing from the free pool for it (0: enough).
        blocks_held: KV blocks of a running request (its block table).
        freeable: blocks that preempting a running request would return to the free pool.
        recompute: tokens a running request would compute again if preempted now (its
            computed tokens beyond the full blocks the prefix cache keeps; all of them
            without prefix caching).
        pinned_blocks: tenant → blocks its prefix pins hold.
        max_num_seqs, num_blocks: the engine's seats and KV blocks.
        exempt: ids of requests not to preempt now (admitted this step; the fair policy adds
            its own: preempted for fairness and not yet ``fair_min_progress`` tokens further
            since).
    """

    running: Sequence[Request]
    waiting: Sequence[Request]
    need_seat: bool
    need_blocks: int
    short_blocks: int
    blocks_held: Callable[[Request], int]
    freeable: Callable[[Request], int]
    max_num_seqs: int
    num_blocks: int
    recompute: Callable[[Request], int] = lambda r: r.num_computed_tokens
    pinned_blocks: dict[str, int] = field(default_factory=dict)
    exempt: set[str] = field(default_factory=set)


class SchedulingPolicy:
    """First come first served; the base of the other policies (tenant accounting included).

    Args:
        input_weight, output_weight: VTC's ``w_in`` / ``w_out`` (cost of one input / output
            token in the counters).
        tenant_weights: tenant → share weight (> 0; absent tenants weigh 1.0).
    """

    name = "fcfs"
    uses_priority: ClassVar[bool] = False
    """True when the policy reads ``Request.priority`` (a request's priority changes something)."""
    uses_tenant_weights: ClassVar[bool] = False
    """True when the policy reads the tenant weights (a key's ``weight`` shares the engine)."""
    displaces: ClassVar[bool] = False
    """True when a waiting request may displace running ones (``displaceable``)."""
    anticipatory: ClassVar[bool] = False
    """True when the loop may wait for an idle tenant's next request (``anticipates``)."""
    fair_min_progress: ClassVar[int] = 16
    """Output tokens a request preempted for fairness samples before it may be again."""

    def __init__(
        self,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        tenant_weights: dict[str, float] | None = None,
        first_step_alone: bool = True,
    ) -> None:
        self.input_weight = float(input_weight)
        self.output_weight = float(output_weight)
        self.tenant_weights: dict[str, float] = dict(tenant_weights or {})
        # read by FairPolicy.hold_back (EngineConfig.fair_first_step_alone), as the weights
        # above are by the fair policy only
        self.first_step_alone = bool(first_step_alone)
        self.tenants: dict[str, TenantStats] = {}

    # ---- accounting ---------------------------------------------------------------------
    def _stats(self, tenant: str) -> TenantStats:
        st = self.tenants.get(tenant)
        if st is None:
            st = self.tenants[tenant] = TenantStats()
        return st

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)

    def on_arrival(self, req: Request, waiting: Iterable[Request]) -> None:
        """A request joins the waiting queue (before it is appended)."""
        self._stats(tenant_of(req))

    def on_first_admission(self, req: Request, waiting: Sequence[Request]) -> None:
        """Charge the prompt when a request is admitted the first time (``waiting`` is the
        queue without it)."""
        t = tenant_of(req)
        st = self._stats(t)
        st.served_input_tokens += req.num_prompt_tokens
        st.counter += self.input_weight * req.num_prompt_tokens / self.weight(t)

    def on_output_token(self, req: Request) -> None:
        """Charge one sampled token."""
        t = tenant_of(req)
        st = self._stats(t)
        st.served_output_tokens += 1
        st.counter += self.output_weight / self.weight(t)

    def on_displace(self, req: Request) -> None:
        """The running ``req`` was preempted to make room for a waiting request
        (``displaceable`` named it)."""

    def on_finish(self, req: Request) -> None:
        """``req`` finished (or was aborted): the policy forgets it."""

    # ---- decisions ----------------------------------------------------------------------
    def pick(self, waiting: Sequence[Request], skip: set[str]) -> Request | None:
        """The next waiting request to try to admit (``skip``: ids passed over this step)."""
        for req in waiting:
            if req.request_id not in skip:
                return req
        return None

    def victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when the KV cache is out of blocks."""
        return running[-1]

    def displaceable(self, req: Request, room: Room) -> list[Request]:
        """Running requests the waiting ``req`` may displace, in preemption order (the
        scheduler preempts the fewest from the front that make room, and none when all of
        them would not). ``[]``: ``req`` waits (the base policy never displaces)."""
        return []

    def may_overtake(self, req: Request, room: Room) -> bool:
        """True when requests behind ``req`` (in ``pick`` order) may be tried although ``req``
        does not fit and displaces nothing this step; else admission stops at ``req``."""
        return False

    def seat_verdict(
        self,
        req: Request,
        running: Sequence[Request],
        waiting: Sequence[Request],
        max_num_seqs: int,
        num_blocks: int,
    ) -> str | None:
        """While every seat is taken, what ``displaceable`` and ``may_overtake`` would decide
        for ``req`` whatever its blocks, told before the scheduler looks up its prefix and
        measures its room: ``"skip"`` (it waits, the requests behind it are tried),
        ``"stop"`` (it waits and so does admission) or ``None`` (ask them)."""
        return None

    def token_caps(
        self, budget: int, running: Sequence[Request], waiting: Sequence[Request]
    ) -> dict[str, int] | None:
        """Tenant → most tokens it gets in the step's first round (``None``: no caps)."""
        return None

    def hold_back(
        self,
        running: Sequence[Request],
        waiting: Sequence[Request],
        max_num_seqs: int,
        num_blocks: int,
    ) -> set[str]:
        """Tenants whose running requests sit out this step so that a waiting request's
        first step runs without them (``set()``: none; the base policy never holds back)."""
        return set()

    def over_share(
        self,
        running: Sequence[Request],
        waiting: Sequence[Request],
        max_num_seqs: int,
        num_blocks: int,
    ) -> dict[str, float]:
        """Tenants the policy serves after the others' new requests, each with its place in
        the policy's order (a tenant of a lower place goes before it): a new request of
        another tenant arriving now, other than those of such tenants at a place no lower,
        is admitted before their waiting ones (``{}``: none; first come first served has
        no such tenant)."""
        return {}

    def anticipates(
        self, tenant: str, running: Sequence[Request], max_num_seqs: int, num_blocks: int
    ) -> bool:
        """Whether the loop may wait a moment for the idle ``tenant``'s next request before
        a step of the ``running`` requests (``engine/anticipation.py``; the base policy is
        work-conserving: never)."""
        return False

    def tenant_stats(
        self, waiting: Iterable[Request], running: Iterable[Request]
    ) -> dict[str, dict[str, float | int]]:
        """Per tenant: served tokens, fair-share counter, waiting / running requests."""
        out: dict[str, dict[str, float | int]] = {
            t: {
                "served_input_tokens": st.served_input_tokens,
                "served_output_tokens": st.served_output_tokens,
                "virtual_counter": st.counter,
                "num_waiting": 0,
                "num_running": 0,
            }
            for t, st in self.tenants.items()
        }
        for key, reqs in (("num_waiting", waiting), ("num_running", running)):
            for r in reqs:
                row = out.get(tenant_of(r))
                if row is not None:
                    row[key] += 1
        return out


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first, ties by arrival; victim: largest ``(priority, arrival)``."""

    name = "priority"
    uses_priority = True
    displaces = True

    def pick(self, waiting: Sequence[Request], skip: set[str]) -> Request | None:
        best: Request | None = None
        for req in waiting:
            if req.request_id in skip:
                continue
            if best is None or (req.priority, req.arrival_time) < (
                best.priority,
                best.arrival_time,
            ):
                best = req
        return best

    def victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    def displaceable(self, req: Request, room: Room) -> list[Request]:
        """Running requests of a strictly larger ``priority`` value, the largest
        ``(priority, arrival)`` first."""
        lower = [r for r in room.running if r.priority > req.priority]
        return sorted(lower, key=lambda r: (r.priority, r.arrival_time), reverse=True)


class FairPolicy(SchedulingPolicy):
    """Virtual Token Counter fair share across tenants (see the module docstring)."""

    name = "fair"
    uses_tenant_weights = True
    displaces = True
    anticipatory = True
    _last_left: str | None = None
    """The last tenant whose queue emptied (None until one did; set on the instance)."""

    def __init__(
        self,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        tenant_weights: dict[str, float] | None = None,
        first_step_alone: bool = True,
    ) -> None:
        super().__init__(input_weight, output_weight, tenant_weights, first_step_alone)
        # id -> (request, fairness preemptions, output tokens at the last one): the hysteresis
        self._fair_preempted: dict[str, tuple[Request, int, int]] = {}

    def on_displace(self, req: Request) -> None:
        _, n, _ = self._fair_preempted.get(req.request_id, (req, 0, 0))
        self._fair_preempted[req.request_id] = (req, n + 1, req.num_output_tokens)

    def on_finish(self, req: Request) -> None:
        self._fair_preempted.pop(req.request_id, None)

    def _exempt(self) -> set[str]:
        """Requests preempted for fairness that have not yet sampled ``fair_min_progress``
        tokens since: not to be preempted for fairness again."""
        p = self.fair_min_progress
        return {
            rid for rid, (r, _, at) in self._fair_preempted.items() if r.num_output_tokens - at < p
        }

    def on_arrival(self, req: Request, waiting: Iterable[Request]) -> None:
        t = tenant_of(req)
        st = self._stats(t)
        backlogged = {tenant_of(r) for r in waiting}
        if t in backlogged:
            return
        if backlogged:  # lift to the least backlogged counter: idling earns no credit
            st.counter = max(st.counter, min(self._stats(b).counter for b in backlogged))
        elif self._last_left is not None:  # nobody waits: lift to the last one that did
            st.counter = max(st.counter, self._stats(self._last_left).counter)

    def on_first_admission(self, req: Request, waiting: Sequence[Request]) -> None:
        super().on_first_admission(req, waiting)
        t = tenant_of(req)
        if not any(tenant_of(r) == t for r in waiting):
            self._last_left = t

    def pick(self, waiting: Sequence[Request], skip: set[str]) -> Request | None:
        best: Request | None = None
        best_key: tuple[float, float] | None = None
        for req in waiting:
            if req.request_id in skip:
                continue
            key = (self._stats(tenant_of(req)).counter, req.arrival_time)
            if best_key is None or key < best_key:
                best, best_key = req, key
        return best

    def victim(self, running: Sequence[Request]) -> Request:
        i = max(
            range(len(running)),
            key=lambda i: (self._stats(tenant_of(running[i])).counter, i),
        )
        return running[i]

    # ---- fair running slots -------------------------------------------------------------
    def shares(
        self, tenants: Iterable[str], max_num_seqs: int, num_blocks: int
    ) -> dict[str, tuple[int, int]]:
        """Tenant → ``(seats, blocks)`` it is entitled to among the active ``tenants``:
        ``max(1, floor(max_num_seqs * w / W))`` and ``floor(num_blocks * w / W)``."""
        active = set(tenants)
        total = sum(self.weight(t) for t in active)
        return {
            t: (
                max(1, int(max_num_seqs * self.weight(t) / total)),
                int(num_blocks * self.weight(t) / total),
            )
            for t in active
        }

    def _held(self, room: Room) -> tuple[dict[str, int], dict[str, int]]:
        seats: dict[str, int] = {}
        blocks: dict[str, int] = dict(room.pinned_blocks)
        for r in room.running:
            t = tenant_of(r)
            seats[t] = seats.get(t, 0) + 1
            blocks[t] = blocks.get(t, 0) + room.blocks_held(r)
        return seats, blocks

    def displaceable(self, req: Request, room: Room) -> list[Request]:
        """Running requests (outside the hysteresis; the cheapest to recompute, then the least
        often preempted, then the newest first) of tenants over their shares with a VTC counter no less than ``req``'s
        tenant's, the most-over tenant first, while ``req``'s tenant stays within its own shares counting ``req``; never a
        victim that would take its tenant below a share."""
        me = tenant_of(req)
        active = {tenant_of(r) for r in room.running} | {tenant_of(r) for r in room.waiting}
        shares = self.shares(active | {me}, room.max_num_seqs, room.num_blocks)
        seats, blocks = self._held(room)
        my_seats, my_blocks = shares[me]
        if room.need_seat and seats.get(me, 0) + 1 > my_seats:
            return []
        if room.short_blocks and blocks.get(me, 0) + room.need_blocks > my_blocks:
            return []
        victims: list[Request] = []
        others = sorted(
            (t for t in seats if t != me),
            key=lambda t: (
                seats[t]
                - shares[t][0]
                + (blocks.get(t, 0) - shares[t][1]) / max(1, room.num_blocks),
                self._stats(t).counter,
            ),
            reverse=True,
        )
        mine = self._stats(me).counter
        exempt = room.exempt | self._exempt()
        preempted = {rid: n for rid, (_, n, _) in self._fair_preempted.items()}
        for t in others:
            if self._stats(t).counter < mine:
                continue  # VTC serves that tenant first: it keeps its seats
            s_left, b_left = seats[t], blocks.get(t, 0)
            mine_t = [r for r in reversed(room.running) if tenant_of(r) == t]  # newest first
            # the cheapest to recompute first, then the least often preempted (stable sort:
            # newest first among equals)
            mine_t.sort(key=lambda r: (room.recompute(r), preempted.get(r.request_id, 0)))
            for r in mine_t:
                if r.request_id in exempt:
                    continue
                over_seats = room.need_seat and s_left > shares[t][0]
                over_blocks = room.short_blocks > 0 and b_left > shares[t][1]
                if not (over_seats or over_blocks):
                    break
                victims.append(r)
                s_left -= 1
                b_left -= room.blocks_held(r)
        return victims

    def seat_verdict(
        self,
        req: Request,
        running: Sequence[Request],
        waiting: Sequence[Request],
        max_num_seqs: int,
        num_blocks: int,
    ) -> str | None:
        """A tenant already holding its seat share displaces nothing for a seat: ``"skip"``
        with another tenant active (the tenants behind it in VTC order are tried), else
        ``"stop"``; ``None`` when it is within its share."""
        me = tenant_of(req)
        active = {tenant_of(r) for r in running} | {tenant_of(r) for r in waiting} | {me}
        held = sum(1 for r in running if tenant_of(r) == me)
        if held + 1 <= self.shares(active, max_num_seqs, num_blocks)[me][0]:
            return None
        return "skip" if len(active) >= 2 else "stop"

    def may_overtake(self, req: Request, room: Room) -> bool:
        """True when ``req``'s tenant is at or over the share it lacks (seats or blocks):
        the tenants behind it in VTC order are tried."""
        me = tenant_of(req)
        active = {tenant_of(r) for r in room.running} | {tenant_of(r) for r in room.waiting}
        if len(active | {me}) < 2:
            return False
        shares = self.shares(active | {me}, room.max_num_seqs, room.num_blocks)
        seats, blocks = self._held(room)
        if room.need_seat and seats.get(me, 0) + 1 > shares[me][0]:
            return True
        return bool(room.short_blocks) and blocks.get(me, 0) + room.need_blocks > shares[me][1]

    def over_share(
        self,
        running: Sequence[Request],
        waiting: Sequence[Request],
        max_num_seqs: int,
        num_blocks: int,
    ) -> dict[str, float]:
        """Tenants running more requests than their seat share (``shares``) while two or more
        tenants are active, each with its VTC counter (its place). A new request of a tenant
        within its share is admitted before their waiting requests, displacing theirs when
        the seats are full (its counter is lifted to no more than theirs on arrival, and
        theirs grows with every token they are served), and so is one of such a tenant of a
        lower counter; their waiting requests get seats only as fast as seats free beyond
        those arrivals (``load_model.estimate_ttft``'s ``overtake_per_s``)."""
        active = {tenant_of(r) for r in running} | {tenant_of(r) for r in waiting}
        if len(active) < 2:
            return {}
        shares = self.shares(active, max_num_seqs, num_blocks)
        seats: dict[str, int] = {}
        for r in running:
            seats[tenant_of(r)] = seats.get(tenant_of(r), 0) + 1
        return {t: self._stats(t).counter for t, n in seats.items() if n > shares[t][0]}

    def hold_back(
        self,
        running: Sequence[Request],
        waiting: Sequence[Request],
        max_num_seqs: int,
        num_blocks: int,
    ) -> set[str]:
        """The first step of a light request alone: when a request waits for its first token
        (it never ran) whose tenant is within its seat share counting it, the tenants over
        their seat shares whose VTC counter is no less than its tenant's sit this step out
        (their decodes, prefill chunks and admissions run in the next one), so that the
        light request's first step holds its prefill and the light tenant's own decodes
        only. The scheduler never holds back two steps in a row (the held tenants run at
        least every other step) and runs the held requests in the same step when no such
        request is admitted after all. ``set()`` when ``first_step_alone`` is off, fewer
        than two tenants are active, or no such request waits."""
        if not self.first_step_alone:
            return set()
        active = {tenant_of(r) for r in running} | {tenant_of(r) for r in waiting}
        if len(active) < 2:
            return set()
        shares = self.shares(active, max_num_seqs, num_blocks)
        seats: dict[str, int] = {}
        for r in running:
            seats[tenant_of(r)] = seats.get(tenant_of(r), 0) + 1
        over = {t for t, n in seats.items() if n > shares[t][0]}
        if not over:
            return set()
        least: float | None = None  # the least counter of a tenant with a first step due
        for r in waiting:
            t = tenant_of(r)
            if r.first_scheduled_time is not None or r.waits_for_grammar or t in over:
                continue
            if seats.get(t, 0) + 1 > shares[t][0]:
                continue
            c = self._stats(t).counter
            least = c if least is None else min(least, c)
        if least is None:
            return set()
        return {t for t in over if self._stats(t).counter >= least}

    def anticipates(
        self, tenant: str, running: Sequence[Request], max_num_seqs: int, num_blocks: int
    ) -> bool:
        """True when a request of the idle ``tenant`` arriving now would have its first step
        alone (``hold_back``'s rule, as if it waited): a running tenant over its seat share,
        counting ``tenant`` active, whose VTC counter is no less than ``tenant``'s. The loop
        may then wait for it a moment (``engine/anticipation.py``)."""
        seats: dict[str, int] = {}
        for r in running:
            seats[tenant_of(r)] = seats.get(tenant_of(r), 0) + 1
        if not seats or tenant in seats:
            return False
        shares = self.shares(set(seats) | {tenant}, max_num_seqs, num_blocks)
        mine = self._stats(tenant).counter
        return any(n > shares[t][0] and self._stats(t).counter >= mine for t, n in seats.items())

    def token_caps(
        self, budget: int, running: Sequence[Request], waiting: Sequence[Request]
    ) -> dict[str, int] | None:
        """While two or more tenants want tokens (a waiting request or a running prefill
        chunk), each gets ``max(1, floor(budget * w / W))`` in the first round."""
        wanting = {tenant_of(r) for r in waiting}
        wanting |= {tenant_of(r) for r in running if r.num_tokens - r.num_computed_tokens > 1}
        if len(wanting) < 2:
            return None
        total = sum(self.weight(t) for t in wanting)
        caps = {t: max(1, int(budget * self.weight(t) / total)) for t in wanting}
        return caps


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": SchedulingPolicy,
    "priority": PriorityPolicy,
    "fair": FairPolicy,
}


def policy_class(name: str) -> type[SchedulingPolicy]:
    """The class of the policy called ``name``: read ``uses_priority`` /
    ``uses_tenant_weights`` from it (torch-free; the gateway asks it).

    Raises:
        ValueError: unknown name.
    """
    if name not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]


def make_policy(
    name: str,
    input_weight: float = 1.0,
    output_weight: float = 2.0,
    tenant_weights: dict[str, float] | None = None,
    first_step_alone: bool = True,
) -> SchedulingPolicy:
    """The policy called ``name`` (``"fcfs"``, ``"priority"`` or ``"fair"``); the weights and
    ``first_step_alone`` (a light request's first step alone, ``FairPolicy.hold_back``) are
    read by ``"fair"`` only.

    Raises:
        ValueError: unknown name.
    """
    return policy_class(name)(input_weight, output_weight, tenant_weights, first_step_alone)
