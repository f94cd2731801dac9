"""The fleet simulator's workload: many tenants, long shared system prompts, multi-turn
sessions, Poisson or bursty arrivals, Zipf-skewed tenant popularity (after llm-d's
benchmark workloads: a shared prefix per tenant, sessions whose turns grow the prompt).

Everything is drawn from one seeded ``numpy.random.Generator`` per stream (session starts,
a session's turns, a tenant's system prompt), so a seed gives the same workload whatever the
fleet does with it. Prompts are token ids (no tokenizer: the simulated engine's pseudo model
reads ids only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LIGHT_TENANT = "light"
"""The light tenant: a few single requests through the whole run (its TTFT against its solo
TTFT is ``light_tenant_ttft_over_solo``)."""
HEAVY_TENANT = "heavy"
"""The heavy tenant: a flood of requests in the middle third of the run."""
FIRST_TOKEN_ID = 3  # ids below are the tiny-random preset's special tokens


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The workload's shape.

    Attributes:
        tenants: tenants sharing the fleet (popularity Zipf(``zipf_s``) over their rank).
        zipf_s: the Zipf exponent (> 0; 1.1: a few hot tenants, a long tail).
        system_prompt_tokens: each tenant's system prompt (its shared prefix), tokens.
        user_tokens: mean tokens of a user turn (uniform in [mean/2, 3 mean/2]).
        output_tokens: mean output tokens (uniform in [mean/2, 3 mean/2]; ``max_tokens``,
            EOS ignored, so a request's output length is known).
        mean_turns: mean turns of a session (geometric, at least 1).
        think_s: mean think time between a turn's answer and the next turn (exponential).
        max_prompt_tokens: a session ends before its prompt would pass this.
        arrivals: ``"poisson"`` or ``"bursty"`` (a two-state Markov-modulated Poisson
            process: bursts at ``burst_factor`` x the mean rate a fifth of the time, the
            same mean rate).
        burst_factor: the bursts' rate over the mean (bursty arrivals).
        ttft_budget_s: every request's TTFT budget (seconds; 0: none).
        light_rate: the light tenant's requests per second.
        flood_factor: the heavy tenant's flood, as a multiple of the base request rate,
            in the middle third of the run (0: none).
        vocab_size: prompt ids are drawn from ``[FIRST_TOKEN_ID, vocab_size)``.
    """

    tenants: int = 100
    zipf_s: float = 1.1
    system_prompt_tokens: int = 1024
    user_tokens: int = 128
    output_tokens: int = 128
    mean_turns: float = 3.0
    think_s: float = 5.0
    max_prompt_tokens: int = 6144
    arrivals: str = "poisson"
    burst_factor: float = 4.0
    ttft_budget_s: float = 2.0
    light_rate: float = 0.5
    flood_factor: float = 1.0
    vocab_size: int = 354

    def __post_init__(self) -> None:
        if self.tenants < 1:
            raise ValueError(f"tenants must be >= 1, got {self.tenants}")
        if self.arrivals not in ("poisson", "bursty"):
            raise ValueError(f"arrivals must be 'poisson' or 'bursty', got {self.arrivals!r}")
        for name in (
            "zipf_s",
            "mean_turns",
            "think_s",
            "burst_factor",
            "ttft_budget_s",
            "light_rate",
            "flood_factor",
        ):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        for name, least in (("ttft_budget_s", 0), ("light_rate", 0), ("flood_factor", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= 0 (0: none), got {getattr(self, name)}")
        if not 1 <= self.burst_factor <= 5:  # the rest of the time runs at (1 - 0.2 x) / 0.8
            raise ValueError(f"burst_factor must be in [1, 5], got {self.burst_factor}")
        if not self.zipf_s > 0:
            raise ValueError(f"zipf_s must be > 0, got {self.zipf_s}")
        for name, least in (
            ("mean_turns", 1),
            ("think_s", 0),
            ("system_prompt_tokens", 1),
            ("user_tokens", 2),
            ("output_tokens", 2),
        ):
            if getattr(self, name) < least:  # each named alone: the flag a user set
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")


@dataclass(slots=True)
class SessionStart:
    """A new session: when, whose, how many turns, and whether it is a light/heavy request."""

    t: float
    tenant: str
    session: int
    turns: int


class Workload:
    """Session starts over ``[0, duration_s)`` at ``rate`` requests per second in all (the
    base sessions' turns included), plus the light tenant and the heavy tenant's flood.

    Args:
        config: the workload's shape.
        rate: mean requests per second of the base tenants (turns included).
        duration_s: the run's length (no session starts after it).
        seed: the seed of every stream.
    """

    def __init__(self, config: WorkloadConfig, rate: float, duration_s: float, seed: int) -> None:
        if not rate > 0 or not duration_s > 0:
            raise ValueError("rate and duration_s must be > 0")
        self.config = config
        self.rate = float(rate)
        self.duration_s = float(duration_s)
        self.seed = int(seed)
        ranks = np.arange(1, config.tenants + 1, dtype=np.float64)
        weights = ranks**-config.zipf_s
        self._popularity = np.cumsum(weights / weights.sum())

    def tenant_name(self, rank: int) -> str:
        return f"t{rank:05d}"

    def starts(self) -> list[SessionStart]:
        """Every session start of the run, in time order (ties by session number)."""
        cfg = self.config
        rng = np.random.default_rng([self.seed, 1])
        sessions_per_s = self.rate / cfg.mean_turns
        out: list[SessionStart] = []
        t = 0.0
        burst = False
        switch = rng.exponential(10.0) if cfg.arrivals == "bursty" else math.inf
        # bursty: a fifth of the time at burst_factor x, the rest slower, the same mean
        low = (1.0 - 0.2 * cfg.burst_factor) / 0.8 if cfg.arrivals == "bursty" else 1.0
        low = max(low, 0.05)
        n = 0
        while True:
            factor = cfg.burst_factor if burst else low
            t += rng.exponential(1.0 / (sessions_per_s * factor))
            while t > switch:  # state change: redraw from the switch (memoryless)
                burst = not burst
                switch += rng.exponential(2.5 if burst else 10.0)
            if t >= self.duration_s:
                break
            rank = int(np.searchsorted(self._popularity, rng.random(), side="right")) + 1
            turns = int(rng.geometric(1.0 / cfg.mean_turns))
            out.append(SessionStart(t, self.tenant_name(min(rank, cfg.tenants)), n, turns))
            n += 1
        third = self.duration_s / 3
        if cfg.light_rate > 0:
            t = 0.0
            while True:
                t += rng.exponential(1.0 / cfg.light_rate)
                if t >= self.duration_s:
                    break
                out.append(SessionStart(t, LIGHT_TENANT, n, 1))
                n += 1
        if cfg.flood_factor > 0:
            t = third
            flood_rate = cfg.flood_factor * self.rate
            while True:
                t += rng.exponential(1.0 / flood_rate)
                if t >= 2 * third:
                    break
                out.append(SessionStart(t, HEAVY_TENANT, n, 1))
                n += 1
        out.sort(key=lambda s: (s.t, s.session))
        return out

    def tenant_for(self, session: int) -> str:
        """A Zipf-drawn base tenant for session ``session`` (closed-loop clients)."""
        u = np.random.default_rng([self.seed, 6, session]).random()
        rank = int(np.searchsorted(self._popularity, u, side="right")) + 1
        return self.tenant_name(min(rank, self.config.tenants))

    def system_prompt(self, tenant: str) -> list[int]:
        """The tenant's system prompt (the same ids every time)."""
        cfg = self.config
        rng = np.random.default_rng([self.seed, 2, _tenant_number(tenant)])
        return rng.integers(FIRST_TOKEN_ID, cfg.vocab_size, cfg.system_prompt_tokens).tolist()

    def turn(self, session: int, turn: int) -> tuple[list[int], int]:
        """``(user turn ids, max_tokens)`` of a session's turn."""
        cfg = self.config
        rng = np.random.default_rng([self.seed, 3, session, turn])
        n = int(rng.integers(cfg.user_tokens // 2, cfg.user_tokens * 3 // 2 + 1))
        out = int(rng.integers(cfg.output_tokens // 2, cfg.output_tokens * 3 // 2 + 1))
        return rng.integers(FIRST_TOKEN_ID, cfg.vocab_size, n).tolist(), out

    def think_s(self, session: int, turn: int) -> float:
        """Seconds between turn ``turn - 1``'s answer and turn ``turn``."""
        rng = np.random.default_rng([self.seed, 4, session, turn])
        return float(rng.exponential(self.config.think_s)) if self.config.think_s else 0.0

    def gateway_of(self, session: int, turn: int, gateways: int) -> int:
        """Which gateway a request reaches (a client-side round robin: uniform, seeded)."""
        return int(np.random.default_rng([self.seed, 5, session, turn]).integers(gateways))


def _tenant_number(tenant: str) -> int:
    if tenant == LIGHT_TENANT:
        return 1_000_001
    if tenant == HEAVY_TENANT:
        return 1_000_002
    return int(tenant[1:])
