"""Prefix pins: handles that keep cached KV blocks out of eviction until unpinned or expired.

A pin takes one reference on each block of a cached prefix (so the blocks count as used and
never enter the LRU) and one pin count (so ``pinned_blocks`` counts distinct blocks). Pinned
blocks are capped at ``max_pinned_blocks`` (``EngineConfig.max_pinned_fraction`` of the cache).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

from prefixgate.engine.block_pool import Block, BlockPool
from prefixgate.engine.errors import PinLimitError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefixPin:
    """A handle keeping a cached prefix out of eviction.

    Attributes:
        id: pin id (``"pin-<n>"``).
        num_tokens: tokens covered (whole blocks: the longest cached full-block run).
        expires_at: ``time.monotonic()`` seconds when the pin lapses, ``None`` = never.
        block_ids: the pinned blocks, in prefix order.
        cache_salt: the salt the prefix was pinned under.
    """

    id: str
    num_tokens: int
    expires_at: float | None
    block_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None


class PinTable:
    """Live pins over a ``BlockPool``.

    Args:
        pool: the block pool whose blocks are pinned.
        max_pinned_blocks: most distinct blocks pins may hold at once.

    Attributes:
        num_pinned_blocks: distinct blocks held by at least one pin.
        num_revoked: pins released early so a lone request could make progress.
    """

    def __init__(self, pool: BlockPool, max_pinned_blocks: int) -> None:
        self.pool = pool
        self.max_pinned_blocks = max_pinned_blocks
        self.num_pinned_blocks = 0
        self.num_revoked = 0
        self._pins: dict[str, PrefixPin] = {}  # insertion order = age
        self._blocks: dict[str, list[Block]] = {}
        self._ids = itertools.count()

    def add(
        self,
        blocks: list[Block],
        block_size: int,
        ttl_s: float | None,
        cache_salt: str | None,
        now: float | None = None,
    ) -> PrefixPin:
        """Pin ``blocks`` (cached, in prefix order) for ``ttl_s`` seconds (``None``: no expiry).

        Raises:
            PinLimitError: the distinct pinned blocks would exceed ``max_pinned_blocks``.
        """
        new = sum(1 for b in blocks if b.pin_cnt == 0)
        if self.num_pinned_blocks + new > self.max_pinned_blocks:
            raise PinLimitError(
                f"pinning {new} more KV blocks would hold {self.num_pinned_blocks + new} pinned "
                f"blocks, over the cap of {self.max_pinned_blocks} (max_pinned_fraction of "
                f"{self.pool.num_blocks} blocks)"
            )
        self.pool.touch(blocks)
        for b in blocks:
            b.pin_cnt += 1
        self.num_pinned_blocks += new
        now = time.monotonic() if now is None else now
        pin = PrefixPin(
            id=f"pin-{next(self._ids)}",
            num_tokens=len(blocks) * block_size,
            expires_at=None if ttl_s is None else now + ttl_s,
            block_ids=[b.block_id for b in blocks],
            cache_salt=cache_salt,
        )
        self._pins[pin.id] = pin
        self._blocks[pin.id] = blocks
        return pin

    def remove(self, pin_id: str) -> None:
        """Release a pin; its blocks go to the LRU (tail first) when nothing else holds them.

        Raises:
            KeyError: unknown (or already released / expired) pin id.
        """
        if pin_id not in self._pins:
            raise KeyError(f"unknown prefix pin {pin_id!r}")
        del self._pins[pin_id]
        blocks = self._blocks.pop(pin_id)
        for b in blocks:
            b.pin_cnt -= 1
            if b.pin_cnt == 0:
                self.num_pinned_blocks -= 1
        self.pool.free(reversed(blocks))

    def get(self, pin_id: str) -> PrefixPin:
        """The live pin ``pin_id``. Raises KeyError when unknown or released."""
        if pin_id not in self._pins:
            raise KeyError(f"unknown prefix pin {pin_id!r}")
        return self._pins[pin_id]

    def expire(self, now: float | None = None) -> list[str]:
        """Release every pin whose ``expires_at <= now``; returns their ids."""
        if not self._pins:
            return []
        now = time.monotonic() if now is None else now
        expired = [
            p.id for p in self._pins.values() if p.expires_at is not None and p.expires_at <= now
        ]
        for pin_id in expired:
            self.remove(pin_id)
        return expired

    def revoke_oldest(self) -> bool:
        """Release the oldest pin (a lone request needs its blocks); False if there is none."""
        if not self._pins:
            return False
        pin_id = next(iter(self._pins))
        logger.warning(
            "prefix pin %s revoked: a request needs its KV blocks to make progress", pin_id
        )
        self.remove(pin_id)
        self.num_revoked += 1
        return True

    def __len__(self) -> int:
        return len(self._pins)

    def values(self) -> list[PrefixPin]:
        return list(self._pins.values())

    def held_blocks(self) -> list[list[Block]]:
        """Blocks held by each live pin (for invariant checks)."""
        return list(self._blocks.values())
