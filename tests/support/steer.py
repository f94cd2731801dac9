"""Scripted logits for constrained requests: make a real (tiny) model write a given opening.

A tiny model never writes ``<tool_call>`` of its own accord, so a test of "free text, then a
trigger, then a constrained call" steers it: ``steer_opening(monkeypatch, ids)`` adds a large
bonus to ``ids[k]`` at the k-th output token of every constrained request whose output so far
is ``ids[:k]``. The bonus is added before the grammar's mask, so the grammar still decides
(a scripted token it forbids stays forbidden); after the script, the model samples on its own
under the mask. Engine and gateway tests alike (the engine runs in the test's process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from prefixgate.engine.structured_output import StructuredOutputManager, StructuredOutputRequest

BONUS = 1.0e4  # logits units: beats any model logit at any temperature the tests use


def steer_opening(
    monkeypatch: pytest.MonkeyPatch, ids: Sequence[int]
) -> dict[int, tuple[StructuredOutputRequest, list[int]]]:
    """Steer every constrained request's first ``len(ids)`` output tokens to ``ids``.

    Returns:
        ``id(state) -> (state, tokens it accepted)`` (the state is kept so its id is never
        reused by a later request's).
    """
    script = list(ids)
    seen: dict[int, tuple[StructuredOutputRequest, list[int]]] = {}
    accept = StructuredOutputRequest.accept
    apply = StructuredOutputManager.apply_bitmask

    def recording_accept(self: StructuredOutputRequest, token_id: int) -> None:
        seen.setdefault(id(self), (self, []))[1].append(token_id)
        accept(self, token_id)

    def steered_apply(
        self: StructuredOutputManager, logits: Any, rows: list[int], grammars: list[Any]
    ) -> None:
        for row, g in zip(rows, grammars, strict=True):
            done = seen[id(g)][1] if id(g) in seen else []
            k = len(done)
            if k < len(script) and done == script[:k]:
                logits[row, script[k]] += BONUS
        apply(self, logits, rows, grammars)

    monkeypatch.setattr(StructuredOutputRequest, "accept", recording_accept)
    monkeypatch.setattr(StructuredOutputManager, "apply_bitmask", steered_apply)
    return seen
