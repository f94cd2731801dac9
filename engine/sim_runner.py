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

    @staticmethod
    def shape(scheduled: list[Any]) -> StepShape:
        """The composition of a step's ``ScheduledRequest`` list."""
        prefill = decodes = context = 0
        for s in scheduled:
            n = s.num_new_tokens
            if n == 1:
                decodes += 1
            else:
                prefill += n
            context += s.num_computed_tokens + n
        return StepShape(prefill, decodes, context)

    def execute(self, scheduler_output: Any) -> RunnerOutput:
        """Spend the step's modelled time on the clock and sample a pseudo token for each
        request whose prompt (or recompute) is complete this step."""
        start = self.clock.now()
        scheduled = _decodes_first(scheduler_output.scheduled)
        if not scheduled:
            return RunnerOutput({}, {}, 0.0)
        shape = self.shape(scheduled)
        cost = self.profile.step_s(shape)
        sampled: dict[str, int | list[int]] = {}
        for s in scheduled:
            if s.samples:
                r = s.request
                sampled[r.request_id] = self.token(r, r.num_output_tokens)
        self.last_shape, self.last_step_s = shape, cost
        self.busy_s += cost
        self.clock.sleep(cost - (self.clock.now() - start))
        return RunnerOutput(sampled, {}, cost)

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
