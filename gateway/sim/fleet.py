"""``prefixgate sim``: G gateways x R replicas x T tenants on one virtual clock.

The parts are the project's own, unchanged: each replica is an ``LLMEngine`` with
``runner="sim"`` (the real scheduler, block pool, prefix cache and KV events; step times from
the cost model) behind its own ``AdmissionController`` with ``EngineWait`` (TTFT budgets and
Retry-After, as a local-mode gateway in front of the engine); each gateway holds a routing
policy of ``proxy.policies`` (``precise`` with its ``PreciseRouting`` over a ``KVIndex`` fed by
the replicas' KV events and load reports in-process, ``KVIndex.apply_local``). No sockets, no
sleeping: a heap of timed events, and ``virtual_time`` points the ``time`` of those modules at
the simulator's ``VirtualClock`` while it runs (single-threaded; put back afterwards).

What a request does: it reaches a gateway (client-side round robin), is routed, reaches its
replica's admission (a 429 sends it back to the client, who retries after ``Retry-After``,
at most ``MAX_ATTEMPTS`` times, through a gateway again), is added to the engine, and its
outputs come back at the end of each step that made one. A session's next turn is its
prompt, the answer's tokens and a new user turn, after a think time. Network, tokenization and
the gateways' own CPU time are not modelled (``docs/sim.md``).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import heapq
import importlib
import itertools
import math
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from prefixgate.engine.block_hash import (
    block_key_bytes,
    default_hash_fn,
    hash_request_blocks,
    num_reusable_blocks,
    prompt_block_hashes,
)
from prefixgate.engine.config import EngineConfig
from prefixgate.engine.cost_model import load_profile
from prefixgate.engine.kv_events import KVEventCollector, ParsedEvent
from prefixgate.engine.llm_engine import LLMEngine
from prefixgate.engine.protocol import EngineRequest
from prefixgate.engine.sampling_params import SamplingParams
from prefixgate.engine.sim_runner import VirtualClock, apply_decodes, plan_decodes
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.proxy.kv_index import KVIndex
from prefixgate.gateway.proxy.policies import POLICIES, make_policy
from prefixgate.gateway.proxy.policies.precise import Precise
from prefixgate.gateway.proxy.policies.precise_routing import PreciseRoute, PreciseRouting
from prefixgate.gateway.sim.workload import Workload, WorkloadConfig
from prefixgate.gateway.tenancy.admission import AdmissionConfig, AdmissionController
from prefixgate.gateway.tenancy.admission_wait import EngineWait
from prefixgate.gateway.tenancy.shared_state import LocalState, StateBackend

MAX_ATTEMPTS = 8
"""A client's tries of one request (the first and seven retries after 429s)."""

TIMED_MODULES = (
    "prefixgate.engine.scheduler",
    "prefixgate.engine.request",
    "prefixgate.engine.kv_cache_manager",
    "prefixgate.engine.llm_engine",
    "prefixgate.engine.kv_events",
    "prefixgate.gateway.tenancy.admission",
    "prefixgate.gateway.tenancy.admission_wait",
    "prefixgate.gateway.tenancy.admission_slots",
    "prefixgate.gateway.tenancy.slot_wait",
    "prefixgate.gateway.tenancy.shared_state",
    "prefixgate.gateway.proxy.kv_index",
    "prefixgate.gateway.proxy.policies.precise_routing",
    "prefixgate.gateway.proxy.policies.cache_aware",
)
"""The modules whose ``time`` reads the virtual clock during a run (``virtual_time``)."""


@contextlib.contextmanager
def virtual_time(clock: VirtualClock) -> Iterator[None]:
    """Point the ``time`` global of every ``TIMED_MODULES`` module at ``clock`` (it has
    ``monotonic``, ``time``, ``perf_counter``, ``time_ns``), and put it back on exit."""
    saved = []
    for name in TIMED_MODULES:
        mod = importlib.import_module(name)
        saved.append((mod, mod.time))
        mod.time = clock  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for mod, original in saved:
            mod.time = original  # type: ignore[attr-defined]


FEW_COLLECTIONS = (50_000, 20, 100)
"""``gc`` thresholds while a run goes (``few_collections``)."""


@contextlib.contextmanager
def few_collections() -> Iterator[None]:
    """Run the body with the cyclic garbage collector seldom: the objects made before it
    frozen (``gc.freeze``: the imported modules, the engines; never scanned again) and a
    young generation of 50,000 objects, not 700. A run makes millions of short-lived
    requests, lists and tuples that reference counting frees; the collector only looks for
    cycles, and with the default thresholds it scanned them thousands of times (its share
    of the CPU time: docs/sim.md, "7 December 2026, afternoon: speed"). Put back on exit; a
    nested use leaves that to the outer one. The run's figures do not depend on it."""
    threshold = gc.get_threshold()
    if threshold == FEW_COLLECTIONS:  # inside another: it puts things back
        yield
        return
    gc.freeze()
    gc.set_threshold(*FEW_COLLECTIONS)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The fleet: replicas, gateways, routing, each replica's engine and admission.

    Attributes:
        replicas, gateways: how many of each (>= 1).
        routing: a policy of ``proxy.policies.POLICIES``.
        profile: the replicas' cost profile (``cost_model.PROFILES`` name or JSON file).
        kv_blocks: KV blocks per replica (None: the profile's).
        block_size: tokens per KV block.
        max_num_seqs, max_num_batched_tokens: each engine's batch bounds.
        scheduling_policy: each engine's (``fair``: per-tenant VTC).
        max_queued_requests: each replica's admission queue bound.
        max_model_len: each engine's context (tokens).
    """

    replicas: int = 4
    gateways: int = 2
    routing: str = "precise"
    profile: str = "h100-llama3-8b"
    kv_blocks: int | None = None
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fair"
    max_queued_requests: int = 256
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("replicas", "gateways"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")

    def context_len(self) -> int:
        """Tokens a replica's request may take (its prompt under it): ``max_model_len`` within
        the replica's KV blocks (``kv_blocks``, else the profile's, at ``block_size``)."""
        blocks = self.kv_blocks
        if blocks is None:
            profile = load_profile(self.profile)
            if profile.num_kv_blocks is not None:
                blocks = max(1, profile.num_kv_blocks * profile.block_size // self.block_size)
        if blocks is None:
            return self.max_model_len
        return min(self.max_model_len, blocks * self.block_size)

    def check_workload(self, workload: WorkloadConfig) -> None:
        """Refuse a workload whose first turns may not fit a replica's context
        (:meth:`context_len`): the engine would refuse such a prompt in the middle of the run.

        Raises:
            ValueError: ``system_prompt_tokens`` + the longest user turn (3/2 ``user_tokens``)
                not under the context.
        """
        longest = workload.system_prompt_tokens + workload.user_tokens * 3 // 2
        context = self.context_len()
        if longest >= context:
            raise ValueError(
                f"a first turn's prompt takes up to {longest} tokens (system_prompt_tokens + "
                f"3/2 user_tokens), not under a replica's context of {context} tokens "
                f"(kv_blocks x {self.block_size} tokens, at most {self.max_model_len}): "
                "raise kv_blocks or shorten the prompts"
            )

    def engine_config(self, seed: int) -> EngineConfig:
        """Each replica's engine (``max_model_len``: :meth:`context_len`)."""
        max_len = self.context_len()
        return EngineConfig(
            runner="sim",
            sim_profile=self.profile,
            num_kv_blocks=self.kv_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduling_policy=self.scheduling_policy,  # type: ignore[arg-type]
            max_model_len=max_len,
            hf_overrides={"max_position_embeddings": max_len},
            seed=seed,
            kv_events_load_interval_s=0.1,
        )


@dataclass(slots=True, eq=False)
class SimRequest:
    """One client request through its tries (times in virtual seconds)."""

    rid: str
    tenant: str
    session: int
    turn: int
    turns: int
    prompt: list[int]
    max_tokens: int
    budget_s: float | None
    arrival: float
    gateway: int = 0
    attempts: int = 0
    t_try: float = 0.0  # the current try's arrival
    refusals: list[tuple[float, float]] = field(default_factory=list)  # (when, Retry-After)
    tried: list[tuple[int, bool]] = field(default_factory=list)  # (replica, refused with a promise)
    t_admitted: float | None = None
    t_first: float | None = None
    t_done: float | None = None
    num_cached: int = 0
    replica: int = -1
    output: list[int] = field(default_factory=list)
    route: Any = None
    ticket: Any = None
    upstream: Any = None
    gw: Any = None  # the gateway of the current try
    dropped: bool = False
    # the prompt's full blocks' keys (``prompt_block_hashes(prompt, block_size)``), hashed once
    # and handed to the routing pick and the engine
    hashes: list[int] = field(default_factory=list)
    # what the report reads once the tokens are let go (``Fleet(keep_tokens=False)``): the
    # prompt's and the answer's lengths, and the keys of the KV the request computed (the
    # prompt and every output token but the last), set when it is answered
    prompt_len: int = -1
    output_len: int = 0
    kv_hashes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt)

    def computed_keys(self, block_size: int) -> list[int]:
        """The keys of the full blocks of the KV this request computed (its prompt and every
        output token but the last): ``kv_hashes`` once answered, else hashed from its tokens."""
        if self.kv_hashes or not self.prompt:
            return self.kv_hashes
        seq = self.prompt + self.output[:-1]
        return hash_request_blocks(seq, block_size, None, [])


class SimUpstream:
    """What a gateway's policy sees of a replica (``policies.base.Candidate``)."""

    __slots__ = ("url", "seed", "in_flight", "weight", "cache_misses", "cache_salt", "index")

    def __init__(self, index: int) -> None:
        self.url = f"http://replica-{index}"
        self.seed = zlib.crc32(self.url.encode())
        self.in_flight = 0
        self.weight = 1.0
        self.cache_misses = 0
        self.cache_salt: bool | None = True
        self.index = index


class SimGateway:
    """A proxy gateway: its own policy object and upstream views (and, for ``precise``, its
    own ``KVIndex`` following every replica)."""

    def __init__(self, index: int, routing: str, replicas: int, block_size: int) -> None:
        self.index = index
        self.block_size = block_size
        self.policy: Any = make_policy(routing)
        self.upstreams = [SimUpstream(i) for i in range(replicas)]
        self.exact: PreciseRouting | None = None
        if isinstance(self.policy, Precise):
            feeds = {u.url: (f"inproc://sim-{u.index}", None) for u in self.upstreams}
            kv = KVIndex({u.url: f"inproc://sim-{u.index}" for u in self.upstreams}, start=False)
            self.exact = PreciseRouting(None, feeds, index=kv)
            self.policy.exact = self.exact

    def route(self, req: SimRequest, promised: str | None = None) -> tuple[Any, SimUpstream]:
        """Pick ``req``'s replica; ``promised``: the URL of the replica holding a promised
        place for it (the shared state's ``promised_upstream``), the only candidate then."""
        body = {"prompt": req.prompt}
        route = self.policy.route(body, None, None)
        if self.exact is not None:
            precise = PreciseRoute(route.key, route.blocks, route.model)
            precise.token_ids = req.prompt
            if precise.engine_salt(self.upstreams[0]) is None:  # unsalted: the request's keys
                precise.prime_keys(None, self.block_size, req.hashes)
            if req.turns > 1:
                precise.session = (None, f"user:s{req.session}")
            route = precise
        cands = self.upstreams
        if promised is not None:
            cands = [u for u in self.upstreams if u.url == promised] or self.upstreams
        up = self.policy.pick(route, cands)
        up.in_flight += 1
        return route, up

    def finish(self, req: SimRequest, cached: int | None) -> None:
        up = req.upstream
        if up is None:
            return
        up.in_flight -= 1
        if cached is not None:
            self.policy.learn(up, req.route, cached, len(req.prompt))
        if self.exact is not None:
            self.exact.release(req.route)
        req.upstream = None


class Replica:
    """One simulated engine behind its admission controller."""

    def __init__(self, index: int, config: FleetConfig, clock: VirtualClock, seed: int) -> None:
        self.index = index
        self.engine = LLMEngine(config.engine_config(seed + index), sim_clock=clock)
        self.collector = KVEventCollector(config.block_size, 1 << 30, first_seq=0)
        self.collector.queue = _Inbox()  # type: ignore[assignment]  # one thread: no locks
        self.engine.kv_cache_manager.pool.events = self.collector
        self.engine.kv_events = _Feed(self.collector)
        # no text: the simulator reads token ids only (detokenizing is not modelled)
        self.engine.output_processor.detokenizer_cls = _no_detokenizer
        # the engine keys blocks as SimRequest.hashes are keyed: it is handed them
        self.takes_hashes = self.engine.kv_cache_manager.hash_fn is default_hash_fn
        self.admission = AdmissionController(
            AdmissionConfig(max_queued_requests=config.max_queued_requests),
            concurrency=config.max_num_seqs,
        )
        # EngineWait reads only stats() and predict_ttft(): the engine's load part of stats()
        self.load = _EngineLoad(self.engine)
        engine: Any = self.load
        self.admission.wait = EngineWait(engine, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, SimRequest] = {}
        self.stepping = False
        self.busy_s = 0.0
        self.served = 0
        self.generation = 0  # bumps when a planned step is superseded
        # a pure-decode stretch planned but not yet run: (its start, its steps' end times)
        self.stretch: tuple[float, list[float]] | None = None

    def drain_events(self) -> tuple[int, list[ParsedEvent], Any]:
        """The KV events and the latest load report the last flushes produced."""
        events: list[ParsedEvent] = []
        seq = -1
        load = None
        q = self.collector.queue.items  # type: ignore[attr-defined]
        while q:
            item = q.popleft()
            batch = getattr(item, "events", None)
            if batch is None:
                load = self.collector.take_load()
                continue
            seq = int(getattr(item, "seq", seq))
            for kind, entries in batch:
                if kind == "stored":
                    events.append(
                        ParsedEvent(
                            "stored",
                            tuple(block_key_bytes(c.key) for c in entries),
                            None,
                            self.collector.block_size,
                        )
                    )
                elif kind == "removed":
                    events.append(
                        ParsedEvent("removed", tuple(block_key_bytes(c.key) for c in entries))
                    )
                else:
                    events.append(ParsedEvent("cleared"))
        return seq, events, load


def _now(coro: Any) -> Any:
    """The result of a ``StateBackend`` coroutine that never suspends (``LocalState``'s: the
    simulator is synchronous, on its virtual clock).

    Raises:
        RuntimeError: the coroutine suspended (a backend that talks to a server)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("prefixgate sim runs on LocalState only: a shared-state call suspended")


def _no_detokenizer(*_: Any) -> None:
    return None


class _Inbox:
    """Stands where the collector's ``queue.Queue`` does (``put_nowait``, ``get_nowait``,
    ``empty``), without its locks: the simulator is one thread, and it takes the batches
    (``Replica.drain_events``) after every step or stretch. Never full."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: deque[Any] = deque()

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)

    def get_nowait(self) -> Any:
        return self.items.popleft()

    def empty(self) -> bool:
        return not self.items


class _EngineLoad:
    """What ``EngineWait`` reads of an engine: ``stats()`` as ``LLMEngine.load_stats`` (the
    queues, rates and seat schedule its predictions use, the same values as ``stats()``'s,
    without building the per-tenant table on every admission) and ``predict_ttft``
    (``Scheduler.predict_ttft``'s formula on that snapshot).

    Between ``hold()`` and ``release()`` (one admission, in which the engine does not change)
    the snapshot is taken once: ``EngineWait`` reads it two to four times an admission, and
    it is O(running requests). Its readers copy it before changing it."""

    __slots__ = ("engine", "held", "snapshot")

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.held = False
        self.snapshot: dict[str, Any] | None = None

    def hold(self) -> None:
        self.held, self.snapshot = True, None

    def release(self) -> None:
        self.held, self.snapshot = False, None

    def stats(self) -> dict[str, Any]:
        if not self.held:
            return self.engine.load_stats()
        if self.snapshot is None:
            self.snapshot = self.engine.load_stats()
        return self.snapshot

    def predict_ttft(self, num_prompt_tokens: int, num_cached_tokens: int = 0) -> float | None:
        return self.engine.scheduler.predict_ttft(
            num_prompt_tokens, num_cached_tokens, stats=self.stats()
        )


class _Feed:
    """Stands where ``LLMEngine.kv_events`` (the ZeroMQ publisher) does: the collector only;
    the simulator takes its batches and load reports in-process."""

    def __init__(self, collector: KVEventCollector) -> None:
        self.collector = collector

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


class Fleet:
    """The simulator: replicas, gateways, a workload, an event heap on a virtual clock.

    Args:
        config: the fleet.
        workload: the workload's shape.
        rate: base requests per second.
        duration_s: seconds of arrivals; the run goes on until every request is answered
            (or ``drain_s`` more seconds have passed).
        seed: the run's seed.
        only_tenants: keep only these tenants' sessions (the light tenant's solo run).
        drain_s: seconds after ``duration_s`` the run may go on to answer what is in flight.
        clients: instead of the workload's arrivals, this many closed-loop clients, each
            sending a new one-turn session of a Zipf-drawn tenant as soon as its last is
            answered (``saturated_rate``).
        step_by_step: every engine step through ``LLMEngine.step`` (else a replica's
            pure-decode stretches go at once, ``plan_decodes`` / ``apply_decodes``, cut
            short when a request reaches it).
        keep_tokens: keep every request's prompt, answer tokens, route and block keys after
            it ends (tests read them); False lets them go once answered or refused, keeping
            the lengths and the computed blocks' keys the report reads (``prompt_len``,
            ``output_len``, ``kv_hashes``): a long run's memory then grows by about the keys
            of a request's blocks, not its token lists.
        progress: called with one line (the virtual time reached, requests answered, wall
            seconds) every ``progress_every_s`` wall seconds of :meth:`run`; None: silent.
    """

    def __init__(
        self,
        config: FleetConfig,
        workload: WorkloadConfig,
        rate: float,
        duration_s: float,
        seed: int = 0,
        only_tenants: set[str] | None = None,
        drain_s: float = 120.0,
        clients: int = 0,
        step_by_step: bool = False,
        progress: Callable[[str], None] | None = None,
        progress_every_s: float = 10.0,
        keep_tokens: bool = True,
    ) -> None:
        config.check_workload(workload)
        self.keep_tokens = keep_tokens
        self.progress = progress
        self.progress_every_s = progress_every_s
        self.config = config
        self._context_len = config.context_len()  # the replicas' max_model_len
        self.step_by_step = step_by_step
        self.workload = Workload(workload, rate, duration_s, seed)
        self.duration_s = duration_s
        self.drain_s = drain_s
        self.seed = seed
        self.only_tenants = only_tenants
        self.clients = clients
        self._next_session = itertools.count(10_000_000)
        self.clock = VirtualClock()
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.done: list[SimRequest] = []
        self.refused: list[SimRequest] = []  # gave up after MAX_ATTEMPTS
        # refused and told to come back, not admitted yet (at the end: past the drain)
        self.retrying: dict[str, SimRequest] = {}
        self.replicas: list[Replica] = []
        self.gateways: list[SimGateway] = []
        # the gateways' shared state (one store, as one Redis): the promises' pins
        self.shared: StateBackend = LocalState()
        self._system: dict[str, tuple[list[int], list[int]]] = {}  # tenant -> (ids, hashes)
        self.steps = 0
        self.stretched_steps = 0  # of which in pure-decode stretches (advance_decodes)

    # ---- the event heap -------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self) -> Fleet:
        """Run the whole simulation (arrivals, then the drain)."""
        with virtual_time(self.clock), few_collections():
            cfg = self.config
            self.replicas = [Replica(i, cfg, self.clock, self.seed) for i in range(cfg.replicas)]
            self.gateways = [
                SimGateway(g, cfg.routing, cfg.replicas, cfg.block_size)
                for g in range(cfg.gateways)
            ]
            for g in self.gateways:  # every index synced (empty) from the start
                if g.exact is not None:
                    for u in g.upstreams:
                        g.exact.index.apply_local(u.url, -1, [])
            if self.clients:
                for _ in range(self.clients):
                    self.at(0.0, self._client_next)
            else:
                for s in self.workload.starts():
                    if self.only_tenants is None or s.tenant in self.only_tenants:
                        self.at(s.t, self._start_session, s.tenant, s.session, s.turns)
            end = self.duration_s + self.drain_s
            heap = self._heap
            wall0 = last = time.perf_counter()
            while heap:
                t, _, fn, args = heapq.heappop(heap)
                if t > end:
                    break
                self.clock.t = t
                fn(*args)
                if self.progress is not None:
                    now = time.perf_counter()  # ~0.1 µs an event; a request takes ms
                    if now - last >= self.progress_every_s:
                        last = now
                        self.progress(self._progress_line(t, now - wall0))
        return self

    def _progress_line(self, t: float, wall_s: float) -> str:
        """Where a run is: virtual time against the arrivals' end, answered, wall seconds."""
        phase = "arrivals" if t < self.duration_s else "drain"
        return (
            f"at {t:.1f} of {self.duration_s:g} virtual s ({phase}), {len(self.done)} "
            f"answered, {len(self.retrying)} retrying, {self.steps} engine steps, "
            f"{wall_s:.0f} s wall"
        )

    # ---- clients ----------------------------------------------------------------------------
    def _system_prompt(self, tenant: str) -> tuple[list[int], list[int]]:
        """The tenant's system prompt and its blocks' keys."""
        got = self._system.get(tenant)
        if got is None:
            ids = self.workload.system_prompt(tenant)
            got = self._system[tenant] = (ids, prompt_block_hashes(ids, self.config.block_size))
        return got

    def _client_next(self) -> None:
        if self.clock.t >= self.duration_s:
            return
        session = next(self._next_session)
        self._start_session(self.workload.tenant_for(session), session, 1)

    def _start_session(self, tenant: str, session: int, turns: int) -> None:
        self._send_turn(tenant, session, 0, turns, *self._system_prompt(tenant))

    def _send_turn(
        self,
        tenant: str,
        session: int,
        turn: int,
        turns: int,
        history: list[int],
        history_hashes: list[int],
    ) -> None:
        """``history_hashes``: the keys of ``history``'s full blocks."""
        user, max_tokens = self.workload.turn(session, turn)
        prompt = history + user
        budget = self.workload.config.ttft_budget_s or None
        req = SimRequest(
            f"s{session}-{turn}",
            tenant,
            session,
            turn,
            turns,
            prompt,
            max_tokens,
            budget,
            self.clock.t,
        )
        req.gateway = self.workload.gateway_of(session, turn, self.config.gateways)
        req.hashes = hash_request_blocks(prompt, self.config.block_size, None, list(history_hashes))
        self._try(req)

    def _try(self, req: SimRequest) -> None:
        now = self.clock.t
        req.attempts += 1
        req.t_try = now
        # a retry goes to the client's next gateway (its round robin)
        gw = self.gateways[(req.gateway + req.attempts - 1) % len(self.gateways)]
        # a retry goes back to the replica that promised it a place, through any gateway
        fingerprint = f"{req.tenant}/{req.rid}"
        promised = _now(self.shared.promised_upstream(fingerprint)) if req.attempts > 1 else None
        route, up = gw.route(req, promised)
        req.route, req.upstream = route, up
        rep = self.replicas[up.index]
        if rep.stretch is not None:  # its engine as step-by-step stepping has it by now
            self._cut_stretch(rep)
        rep.load.hold()  # the engine does not change during admit: one load snapshot
        try:
            ticket = rep.admission.admit(
                len(req.prompt),
                tenant=req.tenant,
                fingerprint=fingerprint,
                budget_s=req.budget_s,
                max_tokens=req.max_tokens,
            )
        except APIError as exc:
            gw.finish(req, None)
            ra = float(exc.retry_after or 1.0)
            req.refusals.append((now, ra))
            lapses = rep.admission.promises.lapses_in(fingerprint)
            if lapses is not None:  # what a gateway relaying the 429 records
                _now(self.shared.put_promise(fingerprint, up.url, lapses))
            req.tried.append((rep.index, lapses is not None))
            if req.attempts >= MAX_ATTEMPTS:
                req.dropped = True
                self.retrying.pop(req.rid, None)
                self.refused.append(req)
                if not self.keep_tokens:
                    req.prompt, req.hashes, req.route = [], [], None
                if self.clients:
                    self.at(now, self._client_next)
                return
            self.retrying[req.rid] = req
            self.at(now + ra, self._try, req)
            return
        finally:
            rep.load.release()
        if promised is not None:
            _now(self.shared.drop_promise(fingerprint))
        self.retrying.pop(req.rid, None)
        req.tried.append((rep.index, False))
        req.ticket = ticket
        req.t_admitted = now
        req.replica = rep.index
        req.output = []
        er = EngineRequest(
            req.rid,
            req.prompt,
            SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, temperature=0.0),
            None,
            tenant=req.tenant,
        )
        rep.requests[req.rid] = req
        engine_req = rep.engine.prepare_request(er)
        if rep.takes_hashes:  # keys of the same blocks as the engine's own (none salted)
            engine_req.block_hashes = list(req.hashes)
        rep.engine.add_request(engine_req)
        req.gw = gw
        if not rep.stepping:
            rep.generation += 1
            self._step(rep, rep.generation)

    # ---- replicas ---------------------------------------------------------------------------
    def _step(self, rep: Replica, generation: int) -> None:
        if generation != rep.generation:
            return
        eng = rep.engine
        if not eng.has_unfinished_requests():
            rep.stepping = False
            return
        deadline = eng.anticipation_deadline()
        now = self.clock.t
        if deadline is not None and deadline > now:
            rep.stepping = False  # waiting: an arrival steps at once (a new generation)
            self.at(deadline, self._step, rep, generation)
            return
        rep.stepping = True
        if not self.step_by_step:
            ends = plan_decodes(eng, self.duration_s + self.drain_s)
            if ends is not None:  # run at its end, or cut when a request reaches this replica
                rep.stretch = (now, ends)
                self.at(ends[-1], self._stretch_end, rep, generation)
                return
            # one pure decode step (a request's last token in it, or too few for a stretch):
            # run now as LLMEngine.step would run it, its outputs at its end
            ends = plan_decodes(eng, math.inf, max_steps=1, min_steps=1, through_finish=True)
            if ends is not None and ends[0] > now:
                outputs = self._run_stretch(rep, now, ends)
                self.clock.t = now
                self.at(ends[0], self._deliver, rep, outputs, generation)
                return
        outputs = eng.step()
        self.steps += 1
        end = self.clock.t
        self.clock.t = now
        if end <= now:  # nothing ran (nothing schedulable): look again a little later
            end = now + 1e-3
        rep.busy_s += end - now
        self.at(end, self._deliver, rep, outputs, generation)

    def _stretch_end(self, rep: Replica, generation: int) -> None:
        """A planned pure-decode stretch ran to its end: its steps at once, then its outputs."""
        if generation != rep.generation or rep.stretch is None:
            return
        start, ends = rep.stretch
        rep.stretch = None
        outputs = self._run_stretch(rep, start, ends)
        self._deliver(rep, outputs, generation)

    def _cut_stretch(self, rep: Replica) -> None:
        """A request reaches ``rep`` during its planned stretch: run the steps that started
        by now (the one running now included), as ``LLMEngine.step`` would have, and deliver
        their outputs at that step's end; the request joins the step after it."""
        assert rep.stretch is not None
        start, ends = rep.stretch
        rep.stretch = None
        now = self.clock.t
        j = max(1, bisect.bisect_right(ends, now) + 1)  # steps started at or before now
        j = min(j, len(ends))
        outputs = self._run_stretch(rep, start, ends[:j])
        self.clock.t = now
        rep.generation += 1
        self.at(ends[j - 1], self._deliver, rep, outputs, rep.generation)

    def _run_stretch(self, rep: Replica, start: float, ends: list[float]) -> list[Any]:
        outputs = apply_decodes(rep.engine, start, ends)
        self.steps += len(ends)
        self.stretched_steps += len(ends)
        rep.busy_s += ends[-1] - start
        return outputs

    def _deliver(self, rep: Replica, outputs: list[Any], generation: int) -> None:
        now = self.clock.t
        seq, events, load = rep.drain_events()
        if events or load is not None:
            for g in self.gateways:
                if g.exact is not None:
                    g.exact.index.apply_local(f"http://replica-{rep.index}", seq, events, load)
        for out in outputs:
            req = rep.requests.get(out.request_id)
            if req is None:
                continue
            new = out.delta_token_ids
            if new and req.t_first is None:
                req.t_first = now
                req.num_cached = out.num_cached_tokens
                req.ticket.started()
                gw = req.gw
                if gw.exact is not None:
                    gw.exact.started(req.route)
            req.output.extend(new)
            if out.finished:
                req.t_done = now
                req.ticket.done()
                req.gw.finish(req, out.num_cached_tokens)
                del rep.requests[req.rid]
                rep.served += 1
                self.done.append(req)
                req.output_len = len(req.output)
                req.kv_hashes = hash_request_blocks(
                    req.prompt + req.output[:-1], self.config.block_size, None, list(req.hashes)
                )
                if self.clients:
                    self.at(now, self._client_next)
                if req.turn + 1 < req.turns:
                    history = req.prompt + req.output
                    hashes = list(req.kv_hashes)  # its blocks lie within history's
                    user_next = self.workload.config.user_tokens * 3 // 2
                    if len(history) + user_next + req.max_tokens * 2 < min(
                        self.workload.config.max_prompt_tokens, self._context_len
                    ):
                        think = self.workload.think_s(req.session, req.turn + 1)
                        self.at(
                            now + think,
                            self._send_turn,
                            req.tenant,
                            req.session,
                            req.turn + 1,
                            req.turns,
                            history,
                            hashes,
                        )
                if not self.keep_tokens:
                    req.prompt, req.output, req.hashes, req.route = [], [], [], None
        rep.stepping = False
        if generation == rep.generation:
            self._step(rep, generation)


def one_replica_hit_rate(requests: list[SimRequest], block_size: int) -> float | None:
    """The hit rate of one replica holding every block ever computed (no eviction), over
    ``requests`` in the order they were admitted: prompt tokens a request would find cached
    (its reusable leading blocks computed before, by a prompt or an answer: a session's next
    turn holds the last answer) over all prompt tokens. None when empty."""
    # the keys of every block computed so far: a block's key chains its parent's, so a key
    # seen means its whole prefix was computed (the engine's own prefix-cache match)
    seen: set[int] = set()
    hit = total = 0
    bs = block_size
    for req in sorted(requests, key=lambda r: (r.t_admitted or 0.0, r.rid)):
        keys = req.computed_keys(bs)  # the prompt's full blocks first, then the answer's
        usable = num_reusable_blocks(req.prompt_len, bs)
        n = 0
        while n < usable and keys[n] in seen:
            n += 1
        hit += n * bs
        total += req.prompt_len
        seen.update(keys[n:])
    return hit / total if total else None


def saturated_rate(
    config: FleetConfig, workload: WorkloadConfig, seed: int, step_by_step: bool = False
) -> float:
    """Requests per second one replica of ``config`` finishes when always busy: a short run
    (40 virtual seconds, the first 10 dropped) of the workload's base tenants, one-turn
    sessions from ``max_num_seqs + 16`` closed-loop clients (always more than it runs at
    once), with no admission bound in the way. The measured capacity
    ``--load`` is a multiple of (times the replicas)."""
    one = replace(
        config, replicas=1, gateways=1, routing="round_robin", max_queued_requests=1_000_000
    )
    w = replace(workload, light_rate=0.0, flood_factor=0.0, ttft_budget_s=0.0, mean_turns=1.0)
    duration, warm = 40.0, 10.0
    fleet = Fleet(
        one,
        w,
        1.0,
        duration,
        seed,
        drain_s=0.0,
        clients=config.max_num_seqs + 16,
        step_by_step=step_by_step,
    )
    fleet.run()
    done = [r for r in fleet.done if r.t_done is not None and warm <= r.t_done < duration]
    return len(done) / (duration - warm) if done else math.nan
