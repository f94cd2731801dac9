"""``round_robin``: each healthy upstream of the model in turn."""

from __future__ import annotations

from collections.abc import Sequence

from prefixgate.gateway.proxy.policies.base import Candidate, Policy
from prefixgate.gateway.proxy.policies.prompt import Route


class RoundRobin(Policy):
    """Each candidate in turn (the prompt is not read)."""

    name = "round_robin"

    def pick(self, route: Route | None, candidates: Sequence[Candidate]) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        return candidates[self.turn() % len(candidates)]
