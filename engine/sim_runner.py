"""The simulated model runner (``EngineConfig.runner="sim"``): no model, modelled time.

``SimRunner`` stands where ``ModelRunner`` does in ``LLMEngine``: the scheduler, KV cache
manager, block pool, prefix cache and KV events are the real ones; ``execute`` computes no
model. Each step takes the seconds ``CostProfile.step_s`` gives for its composition
(``StepShape``), spent on the runner's clock: ``RealClock`` sleeps (``prefixgate serve --runner
sim``: a replica that answers HTTP like a large GPU replica), ``VirtualClock`` only moves a
number (``prefixgate sim``: many replicas on one virtual time line, no sleeping).

The sampled tokens are pseudo tokens, a function of (seed, request id, position) alone, so a
request's output is the same whatever its batch, preemption or replica: ids drawn from the
vocabulary outside the EOS ids and the request's stop ids, and, with ``eos_probability`` p,
EOS at each position past ``min_tokens`` with probability p (unless ``ignore_eos``); with p = 0
every request runs to ``max_tokens`` (or ``max_model_len``).
"""

from __future__ import annotations

import math
import time
import zlib
from typing import Any

from prefixgate.engine.cost_model import CostProfile, StepShape
from prefixgate.engine.model_runner import RunnerOutput, _decodes_first

_MASK64 = (1 << 64) - 1


class RealClock:
    """Wall time: ``sleep`` sleeps (``time.monotonic`` seconds)."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock:
    """A virtual time line: ``sleep`` moves ``t`` (seconds) and returns at once.

    It also stands in for the ``time`` module of the engine's modules under
    ``prefixgate sim`` (``monotonic``, ``time``, ``perf_counter``, ``time_ns``), so the
    scheduler's rates, timestamps and pin expiries read virtual seconds.
    """

    def __init__(self, t: float = 0.0) -> None:
        self.t = float(t)

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.t += seconds

    monotonic = now
    perf_counter = now
    time = now

    def time_ns(self) -> int:
        return int(self.t * 1e9)


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SimRunner:
    """A model runner without a model (``ModelRunner``'s ``execute`` contract).

    Args:
        profile: the step cost model.
        vocab_size: pseudo tokens are ids in ``[0, vocab_size)``.
        seed: the pseudo tokens' seed (``EngineConfig.seed``).
        eos_probability: chance of EOS at each position past ``min_tokens`` (0 to 1).
        clock: ``RealClock`` (sleeps) or ``VirtualClock``.
    """

    def __init__(
        self,
        profile: CostProfile,
        vocab_size: int,
        seed: int = 0,
        eos_probability: float = 0.0,
        clock: Any = None,
    ) -> None:
        self.profile = profile
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)
        self.eos_probability = float(eos_probability)
        self.clock = RealClock() if clock is None else clock
        self.structured_output = None
        self.last_shape = StepShape(0, 0, 0)
        self.last_step_s = 0.0
        self.busy_s = 0.0  # modelled seconds of all steps
        self.last_end: float | None = None  # the clock's time the last step ended

    @staticmethod
    def shape(scheduled: list[Any]) -> StepShape:
        """The composition of a step's ``ScheduledRequest`` list."""
        prefill = decodes = context = continued = 0
        for s in scheduled:
            n = s.num_new_tokens
            if n == 1:
                decodes += 1
            else:
                prefill += n
                continued += s.num_computed_tokens > 0
            context += s.num_computed_tokens + n
        return StepShape(prefill, decodes, context, continued)

    def execute(self, scheduler_output: Any) -> RunnerOutput:
        """Spend the step's modelled time on the clock and sample a pseudo token for each
        request whose prompt (or recompute) is complete this step."""
        start = self.clock.now()
        scheduled = _decodes_first(scheduler_output.scheduled)
        if not scheduled:
            return RunnerOutput({}, {}, 0.0)
        shape = self.shape(scheduled)
        cost = self.profile.step_s(shape) + self.profile.wake_up_s(self.idle_s(start))
        sampled: dict[str, int | list[int]] = {}
        for s in scheduled:
            if s.samples:
                r = s.request
                sampled[r.request_id] = self.token(r, r.num_output_tokens)
        self.last_shape, self.last_step_s = shape, cost
        self.busy_s += cost
        self.clock.sleep(cost - (self.clock.now() - start))
        self.last_end = start + cost
        return RunnerOutput(sampled, {}, cost)

    def idle_s(self, now: float) -> float:
        """Seconds since the last step ended (``inf`` before the first): what
        ``CostProfile.wake_up_s`` charges the next step for."""
        return math.inf if self.last_end is None else now - self.last_end

    def tokens(self, request: Any, position: int, k: int) -> list[int]:
        """The pseudo tokens of ``request`` at output positions ``position`` to
        ``position + k - 1``: ``[token(request, p) for p in ...]``, with the request's id
        hashed once."""
        params = request.sampling_params
        eos = request.eos_token_ids
        if (
            eos
            and self.eos_probability > 0
            and not (params is not None and params.ignore_eos)
            or position < 0
        ):
            return [self.token(request, p) for p in range(position, position + k)]
        stop = params.stop_token_ids if params is not None else None
        base = zlib.crc32(request.request_id.encode()) << 32
        seed = self.seed * 0x2545F491
        vocab = self.vocab_size
        out = []
        for p in range(position, position + k):
            x = (((base | p) ^ seed) + 0x9E3779B97F4A7C15) & _MASK64  # _mix, inline
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
            t = ((x ^ (x >> 31)) & 0xFFFFFFFF) % vocab
            if (eos and t in eos) or (stop and t in stop):
                t = self.token(request, p)
            out.append(t)
        return out

    def token(self, request: Any, position: int) -> int:
        """The pseudo token of ``request`` at output ``position`` (0-based)."""
        h = _mix(
            (zlib.crc32(request.request_id.encode()) << 32 | position) ^ (self.seed * 0x2545F491)
        )
        params = request.sampling_params
        eos = request.eos_token_ids
        min_tokens = getattr(params, "min_tokens", 0) if params is not None else 0
        ignore_eos = params is not None and params.ignore_eos
        if (
            eos
            and self.eos_probability > 0
            and not ignore_eos
            and position >= min_tokens
            and (h >> 11) / float(1 << 53) < self.eos_probability
        ):
            return min(eos)
        token = (h & 0xFFFFFFFF) % self.vocab_size
        stop = params.stop_token_ids if params is not None else None
        if (not eos or token not in eos) and (not stop or token not in stop):
            return token  # the usual case: no set built per token
        banned = set(eos or ())
        banned.update(stop or ())
        while token in banned and len(banned) < self.vocab_size:
            token = (token + 1) % self.vocab_size
        return token


MIN_STRETCH = 2
"""Fewest decode steps a stretch takes at once (one step goes the usual way)."""


def plan_decodes(
    engine: Any,
    until: float = math.inf,
    max_steps: int = 1 << 30,
    min_steps: int = MIN_STRETCH,
    through_finish: bool = False,
) -> list[float] | None:
    """The end times of the next k steps of ``engine`` (an ``LLMEngine`` on a ``SimRunner``
    with a ``VirtualClock``, from its clock's now) when they are pure decode steps that
    ``apply_decodes`` may run at once: every running request decodes one token a step, none
    waits, none finishes (with ``through_finish``: none before the last step; those that
    reach ``max_tokens`` or ``max_model_len`` in it finish there), no KV block runs short,
    and every step starts before ``until`` (virtual seconds). k is the most steps that holds
    for, at most ``max_steps``; None (fewer than ``min_steps``) when it is not worth it.
    Nothing is changed: the plan holds while no request is added to the engine.

    Step j (0-based) of n decodes over C computed tokens costs
    ``step_s(StepShape(0, n, C + n * (j + 1)))``, the composition ``SimRunner.shape`` gives
    it (step 0 also ``wake_up_s`` of the runner's idle time)."""
    runner = engine.runner
    s = engine.scheduler
    clock = getattr(runner, "clock", None)
    if not isinstance(runner, SimRunner) or not isinstance(clock, VirtualClock):
        return None
    running = s.running
    n = len(running)
    if (
        not n
        or s.waiting
        or s.spec is not None
        or s.kv._pins  # a pin expiring within the stretch would free its blocks mid-way
        or engine._stashed
        or n > s.max_num_batched_tokens
        or n > s.max_num_seqs
    ):
        return None
    kv = s.kv
    eos_p = runner.eos_probability
    steps = max_steps
    computed = 0
    for r in running:
        if (
            r.num_tokens - r.num_computed_tokens != 1
            or r.pin_job is not None
            or r.structured_output is not None
            or r.detokenizer is not None
            or r.error is not None
            or r.num_output_tokens == 0
        ):
            return None
        params = r.sampling_params
        if eos_p > 0 and r.eos_token_ids and not (params is not None and params.ignore_eos):
            return None  # a pseudo EOS may end it any step
        # the step that appends a request's last token (max_tokens or max_model_len): the
        # last one with through_finish (it finishes there), else after the plan
        left = min(r.max_tokens - r.num_output_tokens, s.max_model_len - r.num_tokens)
        steps = min(steps, left if through_finish else left - 1)
        computed += r.num_computed_tokens
    if steps < min_steps:
        return None
    # no step may run short of KV blocks (no preemption in the stretch)
    free = kv.pool.num_free
    while steps >= min_steps:
        need = sum(
            kv.blocks_needed(r.num_computed_tokens + steps) - len(kv._reqs[r.request_id].blocks)
            for r in running
        )
        if need <= free:
            break
        steps = min(steps - 1, steps * free // max(1, need))
    if steps < min_steps:
        return None
    profile = runner.profile
    ends: list[float] = []
    t = clock.t
    wake = profile.wake_up_s(runner.idle_s(t))  # the first step's, after an idle spell
    while len(ends) < steps and t < until:
        t += profile.step_s(StepShape(0, n, computed + n * (len(ends) + 1))) + wake
        wake = 0.0
        ends.append(t)
    return ends if len(ends) >= min_steps else None


def apply_decodes(engine: Any, start: float, ends: list[float]) -> list[Any]:
    """Run the steps ``plan_decodes`` planned from ``start`` (its clock's now then) with end
    times ``ends`` (all of them, or the first ones), leaving the clock at the last end.

    The state is the real scheduler's and KV cache manager's, as that many calls of
    ``step()`` leave it: each request's tokens (the same pseudo tokens) and computed count,
    its blocks (``allocate_slots`` for the k tokens at once: the same number of blocks from
    the same free queue; only which request got which block id differs), its full blocks
    cached (``cache_blocks``; their KV events in one batch at the end), the fair policy's
    counters (one ``on_output_token`` per token), the load model (one ``on_step`` per step,
    with its modelled time) and the step counters. A request whose last token comes in the
    last step (a plan ``through_finish``) finishes as ``update_from_output`` finishes it
    there (``check_stop``, its blocks freed, ``on_finished`` before that step's ``on_step``);
    ``plan_decodes`` allows no finish before the last step.

    Returns:
        one ``StepOutput`` per request (its k tokens; the finished ones' last).
    """
    runner = engine.runner
    s = engine.scheduler
    kv = s.kv
    clock = runner.clock
    k = len(ends)
    n = len(s.running)
    clock.t = start
    kv.expire_pins()
    policy = s.policy
    reqs = list(s.running)
    computed = 0
    for r in reqs:
        computed += r.num_computed_tokens
        if not kv.allocate_slots(r, k):  # counted by plan_decodes: never short
            raise RuntimeError(f"apply_decodes: {r.request_id} short of KV blocks")
    last = ends[-1]
    for r in reqs:
        pos = r.num_output_tokens
        tokens = runner.tokens(r, pos, k)
        r.output_token_ids.extend(tokens)
        r.all_token_ids.extend(tokens)
        r.last_token_time = last
        r.num_computed_tokens += k
        for _ in range(k):
            policy.on_output_token(r)
        kv.cache_blocks(r, r.num_computed_tokens)
    s.tokens_decoded += n * k
    s._steps_scheduled += k
    s._held_last = False
    s._step_started = None
    # dt as step() measures it: the clock's end less its start
    s.load.on_decode_steps(start, ends[:-1], n)
    before = ends[-2] if k > 1 else start
    clock.t = last
    finished: list[Any] = []
    for r in reqs:  # in update_from_output's order: the running order
        status = r.check_stop(s.max_model_len)
        if status is not None:
            finished.extend(s._finish([r], status))
    s.load.on_finished(finished)
    s.load.on_step(last - before, last, 0, n, len(finished), s.has_unfinished_requests())
    runner.last_shape = StepShape(0, n, computed + n * k)
    runner.last_step_s = ends[-1] - (ends[-2] if k > 1 else start)
    runner.busy_s += last - start
    runner.last_end = last
    clock.t = last
    engine.timing["steps"] += k
    op = engine.output_processor
    outputs = [op.make_output(r) for r in reqs]
    engine._flush_kv_events()
    return outputs
