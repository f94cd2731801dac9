"""``least_loaded``: the upstream with the fewest requests in flight (per unit of weight)."""

from __future__ import annotations

from collections.abc import Sequence

from prefixgate.gateway.proxy.policies.base import Candidate, Policy
from prefixgate.gateway.proxy.policies.prompt import Route


class LeastLoaded(Policy):
    """The least loaded candidate; ties rotate (the prompt is not read)."""

    name = "least_loaded"

    def pick(self, route: Route | None, candidates: Sequence[Candidate]) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        return self.least(candidates)
