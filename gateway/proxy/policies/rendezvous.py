"""``rendezvous``: highest-random-weight hashing of the prompt's affinity key (Thaler &
Ravishankar 1998), with the imbalance rule.

score = xxh3_64(key, seed=upstream's seed), highest wins: the same system prompt goes to
the same upstream, where its KV blocks are cached, and removing one upstream moves only the
keys it owned. Upstreams of unequal ``weight`` get keys in proportion to it (weighted
rendezvous hashing: score = -weight / ln(hash / 2^64)). When the load is imbalanced
(``Policy.imbalanced``) or the request has no key, the least loaded upstream is chosen.
"""

from __future__ import annotations

import math
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
        if all(u.weight == candidates[0].weight for u in candidates):
            return max(candidates, key=lambda u: xxhash.xxh3_64_intdigest(key, seed=u.seed))
        return max(
            candidates, key=lambda u: _weighted(xxhash.xxh3_64_intdigest(key, seed=u.seed), u)
        )


def _weighted(h: int, u: Candidate) -> float:
    """Weighted rendezvous score of hash ``h`` (uniform in [0, 2^64)) for ``u``: -w / ln(x),
    x in (0, 1) — each candidate wins a share of keys proportional to its weight."""
    return -u.weight / math.log((h + 0.5) / 2.0**64)
