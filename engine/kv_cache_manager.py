"""KV cache manager: per-request block tables on top of the block pool, with prefix caching.

The scheduler talks to this class only (vLLM v1 ``kv_cache_manager.py`` shape):

- ``get_computed_blocks(request)``: longest run of cached full blocks matching the request's
  tokens (hash-chained keys, contents verified), capped so the last token is always computed;
- ``allocate_slots(request, num_new_tokens, ...)``: grow the block table, taking the hit blocks
  (ref + 1) and fresh ones; all or nothing;
- ``cache_blocks(request, num_computed_tokens)``: register newly full, computed blocks;
- ``free(request)``: drop the request's references, tail first;
- in-flight dedup: ``mark_pending`` / ``pending_owner`` record which running request is about to
  compute which full prompt blocks, so a waiting request with the same prefix waits for them
  instead of computing them again;
- prefix pins: ``pin`` / ``unpin`` / ``expire_pins``. A pin is one more reference on each
  block of a cached prefix, held by the manager itself (SGLang's radix cache ``lock_ref``: a
  referenced node is never evicted), with its TTL: the one clock of a pin's life. Pinned
  blocks count as used and never enter the LRU; ``Block.pin_cnt`` counts the pins on a block.

With ``enable_prefix_caching=False`` nothing is hashed, looked up, cached or pinned.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixgate.engine.block_hash import (
    BlockKey,
    HashFn,
    default_hash_fn,
    hash_request_blocks,
)
from prefixgate.engine.block_pool import Block, BlockPool
from prefixgate.engine.errors import PinLimitError, PrefixCachingDisabledError
from prefixgate.engine.request import Request

if TYPE_CHECKING:
    from prefixgate.engine.config import EngineConfig

__all__ = ["KVCacheManager", "PrefixPin"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefixPin:
    """A reference on a cached prefix's blocks that keeps them out of eviction.

    Attributes:
        id: pin id (``"pin-<n>"``).
        num_tokens: tokens covered (whole blocks: the longest cached full-block run).
        expires_at: ``time.monotonic()`` seconds when the pin lapses, ``None`` = never. The
            manager owns this clock: callers (the gateway's prefix registry) ask ``get_pin``
            whether a pin is live rather than keeping a second one.
        block_ids: the pinned blocks, in prefix order.
        cache_salt: the salt the prefix was pinned under.
        tenant: who the pin is charged to (the ``fair`` policy counts its blocks against the
            tenant's share of the cache), ``None``: nobody.
    """

    id: str
    num_tokens: int
    expires_at: float | None
    block_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    tenant: str | None = None

    def is_live(self, now: float) -> bool:
        """False once ``expires_at`` has passed (``now``: ``time.monotonic()`` seconds)."""
        return self.expires_at is None or now < self.expires_at


@dataclass(slots=True)
class _ReqKV:
    """The manager's state for one request: its block table and cache progress."""

    blocks: list[Block] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    chain_uids: list[int] = field(default_factory=list)  # uid of the cached block at each position
    pending: list[BlockKey] = field(default_factory=list)  # keys this request marked pending
    # uids its chain runs through on blocks it does not hold (another request's copy was
    # cached first): held in the pool, so the chain stays findable if that copy is evicted
    uid_holds: list[int] = field(default_factory=list)


class KVCacheManager:
    """Block tables, reference counts and the prefix cache for all requests.

    Args:
        num_blocks: KV blocks in the cache.
        block_size: tokens per block.
        enable_prefix_caching: reuse cached full blocks across requests.
        max_pinned_blocks: most distinct blocks prefix pins may hold (``PinLimitError`` beyond).
        hash_fn: bytes → int block hash (default ``xxh3_128``); test hook to force collisions.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_pinned_blocks: int | None = None,
        hash_fn: HashFn | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.max_pinned_blocks = num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks
        self.hash_fn: HashFn = hash_fn or default_hash_fn
        self._reqs: dict[str, _ReqKV] = {}
        self._pending: dict[BlockKey, list[Request]] = {}
        self._pins: dict[str, tuple[PrefixPin, list[Block]]] = {}  # insertion order = age
        self._pin_ids = itertools.count()
        self.num_pinned_blocks = 0
        self.num_pins_revoked = 0
        self.peak_used_blocks = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @classmethod
    def from_config(
        cls, config: EngineConfig, num_blocks: int, hash_fn: HashFn | None = None
    ) -> KVCacheManager:
        """Build from ``EngineConfig`` (block size, prefix caching, ``max_pinned_fraction``)."""
        return cls(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            max_pinned_blocks=int(config.max_pinned_fraction * num_blocks),
            hash_fn=hash_fn,
        )

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks holding ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # ---- prefix lookup ------------------------------------------------------------------
    def _hashes(self, request: Request) -> list[BlockKey]:
        return hash_request_blocks(
            request.all_token_ids,
            self.block_size,
            request.cache_salt,
            request.block_hashes,
            self.hash_fn,
        )

    def _match(
        self,
        token_ids: Sequence[int],
        keys: Sequence[BlockKey],
        cache_salt: str | None,
        max_blocks: int,
    ) -> list[Block]:
        """Longest verified run of cached blocks for the first ``max_blocks`` full blocks."""
        bs = self.block_size
        hits: list[Block] = []
        parent_uid: int | None = None
        for i in range(min(max_blocks, len(keys))):
            block = self.pool.lookup(
                keys[i], tuple(token_ids[i * bs : (i + 1) * bs]), cache_salt, parent_uid
            )
            if block is None:
                break
            hits.append(block)
            parent_uid = block.content.uid  # type: ignore[union-attr]
        return hits

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Cached blocks the request can reuse, and the tokens they cover.

        Only whole blocks are reused, and at most ``num_tokens - 1`` tokens, so the last token is
        always computed (its logits are needed): a prompt of exactly k cached blocks reuses
        k - 1 and recomputes the last block (vLLM v1 does the same).

        Returns:
            ``(blocks, num_tokens)`` with ``num_tokens == len(blocks) * block_size``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        keys = self._hashes(request)
        hits = self._match(
            request.all_token_ids,
            keys,
            request.cache_salt,
            (request.num_tokens - 1) // self.block_size,
        )
        return hits, len(hits) * self.block_size

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix-cache lookup (tokens) in ``stats()``."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---- allocation ---------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[Block] = (),
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        Args:
            request: the request (``num_computed_tokens`` tokens already have slots).
            num_new_tokens: tokens to compute this step.
            num_new_computed_tokens: prefix-cache hit tokens (first admission only).
            new_computed_blocks: the hit blocks from ``get_computed_blocks`` (ref + 1 here).

        Returns:
            False (and nothing changed) when not enough blocks are free, else True.
        """
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _ReqKV()
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new = self.blocks_needed(total) - len(state.blocks) - len(new_computed_blocks)
        # hit blocks with ref 0 sit in the LRU: taking them shrinks the free pool
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new > self.pool.num_free - num_free_hits:
            if not state.blocks:
                del self._reqs[request.request_id]
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            state.blocks.extend(new_computed_blocks)
            state.block_ids.extend(b.block_id for b in new_computed_blocks)
            state.chain_uids.extend(b.content.uid for b in new_computed_blocks)  # type: ignore[union-attr]
        if num_new > 0:
            fresh = self.pool.allocate(num_new)
            state.blocks.extend(fresh)
            state.block_ids.extend(b.block_id for b in fresh)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used)
        return True

    def num_blocks_short(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[Block] = (),
    ) -> tuple[int, int]:
        """``(grow, short)`` for the ``allocate_slots`` call with these arguments: the blocks
        it adds to the request's table (fresh + prefix hits), and how many fresh blocks the
        free pool lacks (0: it succeeds)."""
        state = self._reqs.get(request.request_id)
        held = len(state.blocks) if state is not None else 0
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new = self.blocks_needed(total) - held - len(new_computed_blocks)
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        grow = max(0, num_new) + len(new_computed_blocks)
        return grow, max(0, num_new - (self.pool.num_free - num_free_hits))

    def num_freeable_blocks(self, request_id: str) -> int:
        """Blocks that freeing the request would return to the free pool (held by it alone)."""
        state = self._reqs.get(request_id)
        return sum(1 for b in state.blocks if b.ref_cnt == 1) if state is not None else 0

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_computed_tokens`` tokens.

        A block whose exact content is cached already (another request computed it first) is
        not registered twice: the chain continues from the existing entry and this copy is
        freed to the empty list later. Clears the request's pending marks on those blocks.
        """
        if not self.enable_prefix_caching:
            return
        state = self._reqs.get(request.request_id)
        if state is None:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(state.blocks))
        if num_full <= len(state.chain_uids):
            return
        keys = self._hashes(request)
        tokens = request.all_token_ids
        for i in range(len(state.chain_uids), num_full):
            parent_uid = state.chain_uids[i - 1] if i else None
            salt = request.cache_salt
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            existing = self.pool.lookup(keys[i], block_tokens, salt, parent_uid)
            if existing is None:
                content = self.pool.cache(
                    state.blocks[i],
                    keys[i],
                    block_tokens,
                    salt,
                    parent_uid,
                    parent_key=keys[i - 1] if i else None,
                )
                state.chain_uids.append(content.uid)
            else:
                uid = existing.content.uid  # type: ignore[union-attr]
                state.chain_uids.append(uid)
                self.pool.hold_uid(uid)
                state.uid_holds.append(uid)
            self._unmark(keys[i], request)

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so tails are evicted first) and marks."""
        state = self._reqs.pop(request.request_id, None)
        if state is None:
            return
        for key in state.pending:
            self._unmark(key, request)
        self.pool.free(reversed(state.blocks))
        for uid in state.uid_holds:
            self.pool.release_uid(uid)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the request's tail blocks beyond the first ``blocks_needed(num_tokens)`` (the
        slots of rejected speculative drafts); returns how many were freed.

        Raises:
            ValueError: a block to free is in the prefix cache's chain of the request (its
                tokens were computed: ``num_tokens`` below the cached length).
        """
        state = self._reqs.get(request.request_id)
        if state is None:
            return 0
        keep = self.blocks_needed(num_tokens)
        if keep < len(state.chain_uids):
            raise ValueError(
                f"request {request.request_id!r}: cannot trim to {num_tokens} tokens, "
                f"{len(state.chain_uids)} of its blocks are cached"
            )
        tail = state.blocks[keep:]
        if not tail:
            return 0
        del state.blocks[keep:]
        del state.block_ids[keep:]
        self.pool.free(reversed(tail))
        return len(tail)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (block ids in token order); ``[]`` if it holds none."""
        state = self._reqs.get(request_id)
        return list(state.block_ids) if state is not None else []

    def num_request_blocks(self, request_id: str) -> int:
        state = self._reqs.get(request_id)
        return len(state.blocks) if state is not None else 0

    # ---- in-flight dedup ----------------------------------------------------------------
    def mark_pending(self, request: Request) -> None:
        """Mark the request's not-yet-cached full blocks as being computed by it.

        Called when the scheduler admits the request; the marks go as the blocks are cached
        (``cache_blocks``) or the request is freed (finish, abort, preemption).
        """
        if not self.enable_prefix_caching:
            return
        state = self._reqs[request.request_id]
        keys = self._hashes(request)
        for i in range(len(state.chain_uids), len(keys)):
            self._pending.setdefault(keys[i], []).append(request)
            state.pending.append(keys[i])

    def pending_owner(self, request: Request, block_index: int) -> Request | None:
        """The running request computing the same block ``block_index`` as ``request``, if any.

        Verified on the whole token prefix and salt, not just the key.
        """
        if not self._pending:
            return None
        keys = self._hashes(request)
        if block_index >= len(keys):
            return None
        owners = self._pending.get(keys[block_index])
        if not owners:
            return None
        end = (block_index + 1) * self.block_size
        for owner in owners:
            if (
                owner is not request
                and owner.cache_salt == request.cache_salt
                and owner.all_token_ids[:end] == request.all_token_ids[:end]
            ):
                return owner
        return None

    def _unmark(self, key: BlockKey, request: Request) -> None:
        owners = self._pending.get(key)
        if owners and request in owners:
            owners.remove(request)
            if not owners:
                del self._pending[key]
            self._reqs_pending_remove(request, key)

    def _reqs_pending_remove(self, request: Request, key: BlockKey) -> None:
        state = self._reqs.get(request.request_id)
        if state is not None and key in state.pending:
            state.pending.remove(key)

    # ---- pins ---------------------------------------------------------------------------
    def pin(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        ttl_s: float | None = None,
        now: float | None = None,
        tenant: str | None = None,
    ) -> PrefixPin:
        """Pin the longest cached full-block run of ``token_ids`` (ref + 1 on each block).

        The blocks must be cached already (prefill the prefix first); a prefix with no cached
        block gives a pin of 0 tokens.

        Args:
            token_ids: the prefix.
            cache_salt: tenant salt the prefix was computed under.
            ttl_s: seconds until the pin lapses (``None``: until ``unpin``).
            now: ``time.monotonic()`` override (tests).
            tenant: who the pinned blocks are charged to (``PrefixPin.tenant``).

        Raises:
            PinLimitError: the distinct pinned blocks would exceed ``max_pinned_blocks``.
            PrefixCachingDisabledError: prefix caching is off.
            ValueError: ``ttl_s`` <= 0.
        """
        if not self.enable_prefix_caching:
            raise PrefixCachingDisabledError("prefix caching is disabled: nothing can be pinned")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        tokens = list(token_ids)
        keys = hash_request_blocks(tokens, self.block_size, cache_salt, [], self.hash_fn)
        blocks = self._match(tokens, keys, cache_salt, len(keys))
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
            id=f"pin-{next(self._pin_ids)}",
            num_tokens=len(blocks) * self.block_size,
            expires_at=None if ttl_s is None else now + ttl_s,
            block_ids=[b.block_id for b in blocks],
            cache_salt=cache_salt,
            tenant=tenant,
        )
        self._pins[pin.id] = (pin, blocks)
        return pin

    def unpin(self, pin_id: str) -> None:
        """Drop the pin's references; its blocks go to the LRU (tail first) when nothing else
        holds them.

        Raises:
            KeyError: unknown (or already released / expired / revoked) pin id.
        """
        if pin_id not in self._pins:
            raise KeyError(f"unknown prefix pin {pin_id!r}")
        _, blocks = self._pins.pop(pin_id)
        for b in blocks:
            b.pin_cnt -= 1
            if b.pin_cnt == 0:
                self.num_pinned_blocks -= 1
        self.pool.free(reversed(blocks))

    def get_pin(self, pin_id: str, now: float | None = None) -> PrefixPin:
        """The live pin ``pin_id``.

        Raises:
            KeyError: unknown, released, revoked, or past its ``expires_at`` (even before
                ``expire_pins`` has swept it).
        """
        entry = self._pins.get(pin_id)
        if entry is None or not entry[0].is_live(time.monotonic() if now is None else now):
            raise KeyError(f"unknown prefix pin {pin_id!r}")
        return entry[0]

    def expire_pins(self, now: float | None = None) -> list[str]:
        """Release every pin whose ``expires_at <= now`` (monotonic seconds); returns their ids."""
        if not self._pins:
            return []
        now = time.monotonic() if now is None else now
        expired = [pin_id for pin_id, (pin, _) in self._pins.items() if not pin.is_live(now)]
        for pin_id in expired:
            self.unpin(pin_id)
        return expired

    def next_pin_expiry(self) -> float | None:
        """Earliest ``expires_at`` (``time.monotonic()`` seconds) of the live pins, or None."""
        times = [p.expires_at for p, _ in self._pins.values() if p.expires_at is not None]
        return min(times) if times else None

    def revoke_oldest_pin(self) -> bool:
        """Release the oldest pin so a lone request can progress; False if there is none."""
        if not self._pins:
            return False
        pin_id = next(iter(self._pins))
        logger.warning(
            "prefix pin %s revoked: a request needs its KV blocks to make progress", pin_id
        )
        self.unpin(pin_id)
        self.num_pins_revoked += 1
        return True

    def pinned_blocks_by_tenant(self) -> dict[str, int]:
        """Tenant → distinct blocks its pins hold (pins without a tenant are not counted)."""
        held: dict[str, set[int]] = {}
        for pin, _ in self._pins.values():
            if pin.tenant is not None:
                held.setdefault(pin.tenant, set()).update(pin.block_ids)
        return {t: len(ids) for t, ids in held.items()}

    @property
    def pins(self) -> list[PrefixPin]:
        """The pins held, oldest first."""
        return [pin for pin, _ in self._pins.values()]

    def reset_prefix_cache(self) -> int:
        """Forget every free cached block (cold-cache benchmarks); returns how many.

        Blocks held by requests or pins keep their hashes.
        """
        return self.pool.reset_prefix_cache()

    # ---- stats and checks ---------------------------------------------------------------
    def stats(self) -> dict[str, float | int]:
        """KV and prefix-cache counters (keys as docs/architecture.md; queries/hits in tokens)."""
        q = self.prefix_cache_queries
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_cached_free": self.pool.num_free_cached,
            "kv_blocks_used_peak": self.peak_used_blocks,
            "prefix_cache_queries": q,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hits / q if q else 0.0,
            "prefix_cache_evictions": self.pool.num_evictions,
            "pinned_blocks": self.num_pinned_blocks,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is in exactly one state and refs add up.

        Each block's ``ref_cnt`` must equal the block tables holding it plus its pins.
        """
        self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        for state in self._reqs.values():
            assert [b.block_id for b in state.blocks] == state.block_ids
            for b in state.blocks:
                refs[b.block_id] += 1
        pins = [0] * self.pool.num_blocks
        for _, blocks in self._pins.values():
            for b in blocks:
                refs[b.block_id] += 1
                pins[b.block_id] += 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs[b.block_id], f"{b}: {refs[b.block_id]} holders"
            assert b.pin_cnt == pins[b.block_id], f"{b}: {pins[b.block_id]} pins"
        assert self.num_pinned_blocks == sum(1 for p in pins if p), "pinned block count drifted"
        holds: dict[int, int] = {}
        for state in self._reqs.values():
            for uid in state.uid_holds:
                holds[uid] = holds.get(uid, 0) + 1
        self.pool.check_uid_holders(holds)
        for key, owners in self._pending.items():
            for owner in owners:
                owner_kv = self._reqs.get(owner.request_id)
                assert owner_kv is not None and key in owner_kv.pending, (
                    f"stale pending mark of {owner}"
                )
