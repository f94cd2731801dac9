"""Accumulate an engine's step outputs (``StepOutput`` deltas) into the whole generation."""

from __future__ import annotations

from collections.abc import Iterable

from prefixgate.engine.outputs import CompletionOutput, StepOutput


def whole(outputs: Iterable[StepOutput]) -> CompletionOutput:
    """The ``CompletionOutput`` of one request's outputs, in order."""
    acc = CompletionOutput()
    for out in outputs:
        acc.request_id = out.request_id
        acc.add(out)
    return acc
