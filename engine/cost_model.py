"""The step cost model of the simulated runner (``runner="sim"``): seconds per engine step.

One engine step (``Scheduler.schedule`` → one forward) is summarized by its composition
(``StepShape``): prefill tokens, decode rows, the sum of the context lengths its rows attend
over, and the prefill rows that continue a context. Its time is the affine model Vidur and
llm-d's inference simulator use for a step, with one term more::

    step_s = a + b * prefill_tokens + c * decode_rows + d * context_tokens + e * continued_rows

``a``: the per-step floor (weights read once, launch and host overhead), ``b``: a prompt
token's compute, ``c``: a decode row's (its GEMM row, sampling, bookkeeping), ``d``: attention
reads per context token, ``e``: a prefill row over computed tokens (a cached prefix or an
earlier chunk), whose attention takes the general path (on the CPU: the context gathered
through the block table, a mask built) where a whole fresh prompt takes plain causal
attention. Profiles without ``e`` (those written before it) have ``e = 0``.

A step after the engine idled costs more (``CostProfile.wake_up_s``): ``wake_s * (1 -
exp(-idle_s / wake_tau_s))`` is added to the first step after ``idle_s`` seconds without one
(on a CPU: halted virtual CPUs and cold caches; measured 2.4-3.2 ms back to back against
5.0-7.5 ms after 200 ms idle, docs/sim.md). Profiles without it have ``wake_s = 0``.

Profiles are named in ``PROFILES``; ``docs/sim.md`` gives each one's
source and derivation. ``python -m prefixgate.engine.sim_fit`` fits a profile to this machine's
real engine (least squares) and writes it as JSON, which ``load_profile`` reads back.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes.

    Attributes:
        prefill_tokens: query tokens of rows that are not single-token decodes (prompt chunks,
            recomputes after preemption).
        decode_rows: rows with one query token.
        context_tokens: sum over all rows of the tokens attended to (``computed + new``).
        continued_rows: prefill rows whose context already holds computed tokens (a cached
            prefix, an earlier chunk).
    """

    prefill_tokens: int
    decode_rows: int
    context_tokens: int
    continued_rows: int = 0


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Coefficients of ``step_s`` (seconds; see the module docstring) and the replica's size.

    Attributes:
        name: the profile's name.
        a_s: seconds per step.
        b_s_per_prefill_token, c_s_per_decode_row, d_s_per_context_token,
        e_s_per_continued_row: seconds per unit.
        wake_s: seconds the first step after a long idle spell adds (``wake_up_s``).
        wake_tau_s: the idle time constant of that cost (seconds, > 0).
        num_kv_blocks: KV blocks (of ``block_size`` tokens) one replica holds, or None (the
            engine's own default applies).
        block_size: tokens per KV block the block count is stated in.
        source: where the numbers come from (one line).

    Raises:
        ValueError: a negative or non-finite coefficient, or a block count < 1.
    """

    name: str
    a_s: float
    b_s_per_prefill_token: float
    c_s_per_decode_row: float
    d_s_per_context_token: float
    num_kv_blocks: int | None = None
    block_size: int = 16
    source: str = ""
    e_s_per_continued_row: float = 0.0
    wake_s: float = 0.0
    wake_tau_s: float = 0.1

    def __post_init__(self) -> None:
        for key in (
            "a_s",
            "b_s_per_prefill_token",
            "c_s_per_decode_row",
            "d_s_per_context_token",
            "e_s_per_continued_row",
            "wake_s",
            "wake_tau_s",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{key} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{key} must be a finite number >= 0, got {value}")
        if self.wake_tau_s <= 0:
            raise ValueError(f"wake_tau_s must be > 0, got {self.wake_tau_s}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    def step_s(self, shape: StepShape) -> float:
        """Seconds one step of ``shape`` takes (0 for an empty step)."""
        if shape.prefill_tokens == 0 and shape.decode_rows == 0:
            return 0.0
        return (
            self.a_s
            + self.b_s_per_prefill_token * shape.prefill_tokens
            + self.c_s_per_decode_row * shape.decode_rows
            + self.d_s_per_context_token * shape.context_tokens
            + self.e_s_per_continued_row * shape.continued_rows
        )

    def wake_up_s(self, idle_s: float) -> float:
        """Seconds a step adds after ``idle_s`` seconds without one (``inf``: the first
        step): ``wake_s * (1 - exp(-idle_s / wake_tau_s))``, 0 for ``idle_s <= 0``."""
        if self.wake_s == 0.0 or not idle_s > 0:
            return 0.0
        return self.wake_s * -math.expm1(-idle_s / self.wake_tau_s)

    def to_json(self) -> dict[str, Any]:
        """The profile as a JSON object (``load_profile`` reads it back)."""
        return asdict(self)


PROFILES: dict[str, CostProfile] = {
    # Derivation in docs/sim.md ("Profiles"): H100 SXM datasheet (3.35 TB/s HBM3, 989 TFLOP/s
    # dense BF16) and Llama-3-8B's shape (8.03 B parameters, 32 layers, 8 KV heads x 128).
    "h100-llama3-8b": CostProfile(
        name="h100-llama3-8b",
        a_s=7.0e-3,
        b_s_per_prefill_token=3.0e-5,
        c_s_per_decode_row=6.0e-5,
        d_s_per_context_token=5.5e-8,
        num_kv_blocks=25_000,
        block_size=16,
        source="derived from NVIDIA H100 SXM datasheet figures and Llama-3-8B's shape "
        "(docs/sim.md)",
    ),
    # Fitted on this project's dev machine (AMD EPYC, 2 shared cores, 1 torch thread, thread
    # CPU time) by `python -m prefixgate.engine.sim_fit --model ../shared/models/aidreams-260k`:
    # 864 steps, median relative error 0.068, p90 0.197 (docs/sim.md).
    "cpu-aidreams-260k": CostProfile(
        name="cpu-aidreams-260k",
        a_s=3.06e-3,
        b_s_per_prefill_token=1.10e-5,
        c_s_per_decode_row=3.12e-5,
        d_s_per_context_token=4.15e-7,
        num_kv_blocks=8192,
        block_size=16,
        source="fitted by prefixgate.engine.sim_fit on aidreams-260k, AMD EPYC, 1 thread",
    ),
}
"""The built-in profiles by name (``EngineConfig.sim_profile``)."""

DEFAULT_PROFILE = "h100-llama3-8b"


def load_profile(name_or_path: str) -> CostProfile:
    """A built-in profile by name, or one written by ``sim_fit`` (a JSON file path).

    Raises:
        ValueError: neither a known name nor a readable profile file; a bad profile.
    """
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ValueError(
            f"sim_profile must be one of {', '.join(PROFILES)} or a profile JSON file, "
            f"got {name_or_path!r}"
        )
    try:
        data = json.loads(path.read_text())
        return CostProfile(**data)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"sim_profile {name_or_path!r}: not a profile: {exc}") from None
