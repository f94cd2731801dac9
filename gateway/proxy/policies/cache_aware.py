"""``cache_aware`` (after SGLang's cache-aware router) and its approximate prefix tree.

The gateway keeps, per upstream, an approximate radix tree of the prompts it has sent
there — the prompt text (salt first, so tenants' partitions never match each other) cut
into blocks of ``block_chars`` characters, one tree node per block (keyed by the block's
xxh3 hash under its parent). A request goes to the upstream holding the longest match of
its leading blocks (among equal matches the least loaded) when that match covers at least
half the prompt (SGLang's ``cache_threshold``, 0.5), unless that upstream has more than
``abs_threshold`` requests in flight beyond the least loaded one: then to the upstream with
the next-longest match among those within the threshold (a hot prompt that spilled once
goes where it is cached already), the least loaded when none of them holds it (and the tree
learns the prompt there too, so a hot prompt spreads over the pool). Without such a match
the request goes to the least loaded upstream holding the fewest blocks (new prompts spread
out). A request without prompt blocks is routed as ``rendezvous`` routes it.

The tree also learns from the answer's ``usage.prompt_tokens_details.cached_tokens``: an
upstream that reports cached tokens holds that share of the prompt's blocks (so a retry's
upstream is learnt too), and one that cached less than predicted counts a cache miss
(``/ready``'s ``cache_misses``). The tree holds at most ``max_nodes`` blocks; beyond, the
least recently used leaves go. Only the request's candidates (the upstreams serving its
model) are compared, so affinity holds per model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixgate.gateway.proxy.policies.base import Candidate, load
from prefixgate.gateway.proxy.policies.prompt import (
    Route,
    affinity_key,
    prompt_blocks,
    prompt_text,
    salted_affinity_key,
)
from prefixgate.gateway.proxy.policies.rendezvous import Rendezvous

CACHE_THRESHOLD = 0.5  # SGLang router's cache_threshold: the least match worth following


@dataclass(slots=True, eq=False)
class _Node:
    parent: _Node | None
    key: int
    children: dict[int, _Node] = field(default_factory=dict)
    owners: dict[str, float] = field(default_factory=dict)  # upstream url -> last use


class PrefixTree:
    """Which upstream was sent which prompt blocks (approximate: no tokenizer, text blocks).

    Args:
        max_nodes: most blocks kept (least recently used leaves are evicted beyond).
    """

    def __init__(self, max_nodes: int = 200_000) -> None:
        self.root = _Node(None, 0)
        self.max_nodes = max_nodes
        self.nodes = 0
        self.size: dict[str, int] = {}  # upstream url -> blocks it owns

    def match(self, blocks: list[int]) -> dict[str, int]:
        """Per upstream, how many leading ``blocks`` it holds (only upstreams holding >= 1)."""
        depth: dict[str, int] = {}
        node = self.root
        for i, b in enumerate(blocks):
            child = node.children.get(b)
            if child is None:
                break
            for url in child.owners:
                depth[url] = i + 1
            node = child
        return depth

    def insert(self, blocks: list[int], url: str) -> None:
        """Note that ``url`` was sent ``blocks``."""
        now = time.monotonic()
        node = self.root
        for b in blocks:
            child = node.children.get(b)
            if child is None:
                child = node.children[b] = _Node(node, b)
                self.nodes += 1
            if url not in child.owners:
                self.size[url] = self.size.get(url, 0) + 1
            child.owners[url] = now
            node = child
        if self.nodes > self.max_nodes:
            self._evict(self.nodes - self.max_nodes * 9 // 10)

    def _evict(self, count: int) -> None:
        """Remove ``count`` blocks, least recently used leaves first (rounds of leaves)."""
        while count > 0:
            leaves = []
            stack = [self.root]
            while stack:
                node = stack.pop()
                if node.children:
                    stack.extend(node.children.values())
                elif node is not self.root:
                    leaves.append((max(node.owners.values(), default=0.0), id(node), node))
            if not leaves:
                return
            leaves.sort(key=lambda t: t[:2])
            for _, _, node in leaves[:count]:
                for url in node.owners:
                    self.size[url] -= 1
                assert node.parent is not None
                del node.parent.children[node.key]
                self.nodes -= 1
                count -= 1


class CacheAware(Rendezvous):
    """The longest cached prompt prefix wins (see the module docstring)."""

    name = "cache_aware"

    def __init__(self, *args: Any, max_nodes: int = 200_000, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tree = PrefixTree(max_nodes)

    def route(self, body: Any, salt: str | None, model: str | None = None) -> Route:
        """The salted affinity key and the whole prompt's blocks under ``salt``."""
        key = salted_affinity_key(affinity_key(body, self.block_chars, self.max_chars), salt)
        text = prompt_text(body, self.max_chars)  # prompt_blocks reads max_chars of it
        blocks = prompt_blocks(text, salt, self.block_chars, self.max_chars)
        return Route(key, blocks, model)

    def pick(self, route: Route | None, candidates: Sequence[Candidate]) -> Candidate:
        if route is None or not route.blocks:
            return super().pick(route, candidates)
        if len(candidates) == 1:
            choice = candidates[0]
        else:
            choice = self._deepest(route, candidates, self.least(candidates))
        self.tree.insert(route.blocks, choice.url)
        return choice

    def _deepest(self, route: Route, cands: Sequence[Candidate], least: Candidate) -> Candidate:
        depth = self.tree.match(route.blocks)
        best = max(depth.get(u.url, 0) for u in cands)
        if best < CACHE_THRESHOLD * len(route.blocks):
            # Nobody holds most of it (a shared opening is no reason to pile up): the least
            # loaded, then the emptiest.
            return min(cands, key=lambda u: (load(u), self.tree.size.get(u.url, 0)))
        # The deepest match among the upstreams not overloaded (in flight within the threshold
        # of the least loaded): the holder when it can take it, else the next-best holder — a
        # hot prompt that spilled once spills to where it is cached already, not to a new
        # cold replica each time — else the least loaded.
        ok = [u for u in cands if u.in_flight - least.in_flight <= self.abs_threshold]
        choice = min(ok, key=lambda u: (-depth.get(u.url, 0), load(u)))
        route.predicted = depth.get(choice.url, 0)
        return choice

    def learn(self, up: Candidate, route: Route | None, cached: int, prompt_tokens: int) -> None:
        """An answer from ``up`` said ``cached`` of its ``prompt_tokens`` were cached: the
        tree learns that ``up`` holds that share of the prompt's blocks (a retry's upstream,
        or blocks the tree had evicted), and counts a miss on ``up`` when it cached less than
        the tree predicted (it evicted them; the prompt is cached there again now)."""
        if route is None or not route.blocks or prompt_tokens <= 0:
            return
        held = int(len(route.blocks) * min(1.0, cached / prompt_tokens))
        if held:
            self.tree.insert(route.blocks[:held], up.url)
        if held < route.predicted:
            up.cache_misses += 1
