"""Routing policies of upstream mode (``--routing``) and the approximate prefix tree of
``cache_aware`` routing.

* ``cache_aware`` (after SGLang's cache-aware router): the gateway keeps, per upstream, an
  approximate radix tree of the prompts it has sent there — the prompt text (salt first, so
  tenants' partitions never match each other) cut into blocks of ``block_chars`` characters,
  one tree node per block (keyed by the block's xxh3 hash under its parent). A request goes
  to the upstream holding the longest match of its leading blocks (among equal matches the
  least loaded) when that match covers at least half the prompt (SGLang's
  ``cache_threshold``, 0.5), unless that upstream has more than ``balance_abs_threshold`` requests in
  flight beyond the least loaded one: then to the upstream with the next-longest match
  among those within the threshold (a hot prompt that spilled once goes where it is cached
  already), the least loaded when none of them holds it (and the tree learns the prompt
  there too, so a hot prompt spreads over the pool). Without such a match the request
  goes to the least loaded upstream holding the fewest blocks (new prompts spread out).
  The tree also learns from the answer's ``usage.prompt_tokens_details.cached_tokens``: an
  upstream that reports cached tokens holds that share of the prompt's blocks (so a retry's
  upstream is learnt too), and one that cached less than predicted counts a cache miss
  (``/ready``'s ``cache_misses``). The tree holds at most ``max_nodes`` blocks; beyond, the
  least recently used leaves go.
* ``rendezvous``: highest-random-weight hashing of the prompt's leading blocks (the
  ``UpstreamRouter`` docstring), with the imbalance rule.
* ``round_robin``: each healthy upstream in turn. ``least_loaded``: fewest in flight.
* ``precise``: the exact blocks each upstream's engine holds, from its KV events, scored
  against load (``precise_routing.PreciseRouting``; ``cache_aware`` is its fallback, so the
  tree is kept under it too).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import xxhash

POLICIES = ("cache_aware", "rendezvous", "round_robin", "least_loaded", "precise")


def check_policy(name: str) -> str:
    """``name`` if it is one of :data:`POLICIES` (``--routing``).

    Raises:
        ValueError: any other name (the message lists the policies).
    """
    if name not in POLICIES:
        raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {name!r}")
    return name


@dataclass(slots=True, eq=False)
class _Node:
    parent: _Node | None
    key: int
    children: dict[int, _Node] = field(default_factory=dict)
    owners: dict[str, float] = field(default_factory=dict)  # upstream url -> last use


def prompt_blocks(text: str, salt: str | None, block_chars: int, max_chars: int) -> list[int]:
    """The prompt's whole blocks as hashes (xxh3_64 of the salt-prefixed text's block).

    ``text`` is cut to ``max_chars``; a trailing partial block is dropped (as the engine's
    prefix cache keeps only full blocks); a text shorter than one block is one block.
    """
    full = ("\x00" + salt + "\x00" if salt else "") + text[:max_chars]
    if not full:
        return []
    n = len(full) - len(full) % block_chars if len(full) >= block_chars else len(full)
    return [
        xxhash.xxh3_64_intdigest(full[i : i + block_chars].encode("utf-8", "surrogatepass"))
        for i in range(0, n, block_chars)
    ]


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


class RoundRobin:
    """A counter shared by ``round_robin`` and ``least_loaded`` tie-breaks."""

    def __init__(self) -> None:
        self._count = itertools.count()

    def next(self) -> int:
        return next(self._count)
