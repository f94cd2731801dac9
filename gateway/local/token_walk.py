"""Where a request's first token went: the access log's ``walk=`` part (local mode).

From the gateway's own timestamps (request parsed, admitted, first token received from the
engine, first content written to the client) and the engine's timeline (``StepOutput.metrics``: arrival, first scheduled, first
token, the steps it waited, its first step's size and time), all ``time.monotonic()`` seconds
of one host, so the parts add up to the time to first token the client saw (but for the
socket). Used by the tenant-flood benchmark to say which part a flood lengthens.
"""

from __future__ import annotations

from collections.abc import Mapping


def first_token_walk(
    t_parsed: float,
    t_admitted: float | None,
    engine: Mapping[str, float] | None,
    t_received: float | None,
    t_client: float | None,
) -> str | None:
    """The ``walk=`` value: ``name:value`` pairs joined by ``,`` (milliseconds with one
    decimal, ``steps`` and ``chunk`` counts, ``step`` as ``<tokens>tok/<ms>``); a part whose
    timestamps are not known is left out; ``None`` when nothing is known (refused early)."""
    parts: list[str] = []

    def ms(name: str, a: float | None, b: float | None) -> None:
        if a is not None and b is not None:
            parts.append(f"{name}:{1000.0 * (b - a):.1f}")

    e = engine or {}
    ms("admit", t_parsed, t_admitted)
    ms("to_engine", t_admitted, e.get("arrival"))
    ms("wait", e.get("arrival"), e.get("first_scheduled"))
    if "steps_waited" in e:
        parts.append(f"steps:{int(e['steps_waited'])}")
    if "first_step_tokens" in e:
        step_s = e.get("first_step_s")
        took = "" if step_s is None else f"/{1000.0 * step_s:.1f}"
        parts.append(f"step:{int(e['first_step_tokens'])}tok{took}")
        parts.append(f"chunk:{int(e.get('first_chunk_tokens', 0))}")
    ms("to_token", e.get("first_scheduled"), e.get("first_token"))
    ms("deliver", e.get("first_token"), t_received)
    ms("write", t_received, t_client)
    return ",".join(parts) or None


def parse_walk(value: str) -> dict[str, float]:
    """A ``walk=`` value back to numbers: each part's value (ms or count); ``step`` becomes
    ``step_tokens`` and ``step_ms``.

    Raises:
        ValueError: a part that is not ``name:value``.
    """
    out: dict[str, float] = {}
    for part in value.split(","):
        name, sep, v = part.partition(":")
        if not sep:
            raise ValueError(f"walk part {part!r} is not name:value")
        if name == "step":
            tokens, _, took = v.partition("/")
            out["step_tokens"] = float(tokens.removesuffix("tok"))
            if took:
                out["step_ms"] = float(took)
        else:
            out[name] = float(v)
    return out
