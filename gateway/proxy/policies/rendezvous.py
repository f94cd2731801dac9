"""``rendezvous``: highest-random-weight hashing of the prompt's affinity key (Thaler &
Ravishankar 1998), with the imbalance rule.

score = xxh3_64(key, seed=upstream's seed), highest wins: the same system prompt goes to
the same upstream, where its KV blocks are cached, and removing one upstream moves only the
keys it owned. When the load is imbalanced (``Policy.imbalanced``) or the request has no
key, the least loaded upstream is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash
from prefixgate.gateway.proxy.policies.base import Candidate, Policy
from prefixgate.gateway.proxy.policies.prompt import Route


class Rendezvous(Policy):
    """Rendezvous hashing of the affinity key (see the module docstring)."""

    name = "rendezvous"

    def pick(self, route: Route | None, candidates: Sequence[Candidate]) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        least = self.least(candidates)
        if route is None or route.key is None or self.imbalanced(candidates, least):
            return least
        key = route.key
        return max(candidates, key=lambda u: xxhash.xxh3_64_intdigest(key, seed=u.seed))
