"""The block pool: every KV block, its reference count, the prefix-cache index and the LRU.

Each block is in exactly one state (ARCHITECTURE.md invariant):

- used: ``ref_cnt > 0`` (held by requests and/or prefix pins);
- free-cached: ``ref_cnt == 0``, in the LRU free list, its ``content`` (hash) kept so a later
  request can hit it;
- free-empty: ``ref_cnt == 0``, no content, in the empty free list.

New blocks come from the empty list first; only when it is empty is the least recently freed
cached block evicted (its hash dropped). Callers free a request's blocks tail first, so a
sequence's tail is evicted before its head (vLLM v1 ``block_pool.py`` /
``FreeKVCacheBlockQueue`` has the same policy with a single queue).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Protocol

from prefixgate.engine.block_hash import BlockContent, BlockKey


class BlockEventSink(Protocol):
    """Receives the prefix cache's changes (``engine/kv_events.py``'s ``KVEventCollector``).

    Called on the engine's thread, inside the pool's own operations: must not block.
    """

    def stored(self, content: BlockContent) -> None:
        """A block was cached under ``content`` (its key is now findable)."""

    def removed(self, content: BlockContent) -> None:
        """The cache entry ``content`` was dropped (evicted or reset)."""


class Block:
    """One KV block of ``block_size`` token slots (metadata only; the tensors live in the runner).

    Attributes:
        block_id: index into the per-layer KV tensors ``[num_blocks, block_size, ...]``.
        ref_cnt: requests and pins holding the block.
        content: prefix-cache identity when the block is full and cached, else ``None``.
        pin_cnt: prefix pins holding the block (each also counts in ``ref_cnt``).
    """

    __slots__ = ("block_id", "ref_cnt", "content", "pin_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.content: BlockContent | None = None
        self.pin_cnt = 0

    def __repr__(self) -> str:
        cached = "" if self.content is None else f", uid={self.content.uid}"
        return f"Block({self.block_id}, ref={self.ref_cnt}{cached})"


class BlockPool:
    """Owns all ``num_blocks`` blocks, the free lists and the prefix-cache index.

    Args:
        num_blocks: total KV blocks (never changes).

    Attributes:
        num_evictions: cached blocks whose hash was dropped to reuse them.
        events: where cache changes are reported (KV events), ``None`` when off.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Blocks are made as they are first needed (a pool of 25,000 took ~75 ms to build):
        # ``_blocks`` holds ids ``[0, len)``. The ids from ``_fresh`` on were never taken:
        # they are free-empty and come before ``_free_empty`` (the empty blocks freed since),
        # in id order, the order a free list starting as ``range(num_blocks)`` hands out.
        self._blocks: list[Block] = []
        self._fresh = 0
        self._free_empty: deque[int] = deque()
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self._index: dict[BlockKey, dict[int, Block]] = {}  # key -> cached blocks with that key
        self._next_uid = 0
        # A cache uid names one content chain (parent uid, token ids, salt). Its holders (the
        # entries and tombstones chained on it, and requests whose chain runs through it
        # without holding the block) are counted here; an entry evicted while it has holders
        # leaves a tombstone, so recomputing the same content revives the same uid and the
        # blocks chained on it are found again (their keys are still published as held).
        self._uid_holders: dict[int, int] = {}
        self._tombs: dict[tuple[int | None, tuple[int, ...], str | None], BlockContent] = {}
        self._tomb_of_uid: dict[int, tuple[int | None, tuple[int, ...], str | None]] = {}
        self.num_evictions = 0
        self.events: BlockEventSink | None = None

    # ---- counts -------------------------------------------------------------------------
    @property
    def blocks(self) -> list[Block]:
        """Every block, by id (``num_blocks`` of them; the ones never taken are made here)."""
        blocks = self._blocks
        blocks.extend(Block(i) for i in range(len(blocks), self.num_blocks))
        return blocks

    @property
    def num_free(self) -> int:
        """Blocks with ``ref_cnt == 0`` (free-empty + free-cached)."""
        return self.num_blocks - self._fresh + len(self._free_empty) + len(self._free_cached)

    @property
    def num_free_cached(self) -> int:
        return len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # ---- allocation ---------------------------------------------------------------------
    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` fresh blocks (ref 1, no content): empty ones first, then evict LRU cached.

        Raises:
            ValueError: fewer than ``n`` free blocks (callers check ``num_free`` first).
        """
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free} free")
        out: list[Block] = []
        for _ in range(n):
            if self._fresh < self.num_blocks:  # never taken before: first in line
                if self._fresh == len(self._blocks):
                    self._blocks.append(Block(self._fresh))
                block = self._blocks[self._fresh]
                self._fresh += 1
            elif self._free_empty:
                block = self._blocks[self._free_empty.popleft()]
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                block = self._blocks[block_id]
                self._uncache(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each (cached) block; a ref-0 block leaves the LRU."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_cached[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in the given order (pass tail first).

        A block reaching ref 0 joins the LRU end if cached (evicted after everything freed
        before it), else the empty list.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.content is not None:
                    self._free_cached[block.block_id] = None
                else:
                    self._free_empty.append(block.block_id)

    # ---- prefix-cache index -------------------------------------------------------------
    def cache(
        self,
        block: Block,
        key: BlockKey,
        token_ids: tuple[int, ...],
        cache_salt: str | None,
        parent_uid: int | None,
        parent_key: BlockKey | None = None,
    ) -> BlockContent:
        """Register a full, computed, held block under ``key``; returns its new content.

        ``parent_key``: the previous block's key (``None`` for a first block), reported in
        the block's KV event."""
        assert block.content is None and block.ref_cnt > 0, block
        tomb = self._tombs.pop((parent_uid, token_ids, cache_salt), None)
        if tomb is not None:  # the same content again: it takes its old uid back
            del self._tomb_of_uid[tomb.uid]
            uid = tomb.uid
        else:
            uid = self._next_uid
            self._next_uid += 1
            if parent_uid is not None:
                self.hold_uid(parent_uid)
        content = BlockContent(key, token_ids, cache_salt, parent_uid, uid, parent_key)
        block.content = content
        self._index.setdefault(key, {})[block.block_id] = block
        if self.events is not None:
            self.events.stored(content)
        return content

    def lookup(
        self,
        key: BlockKey,
        token_ids: tuple[int, ...],
        cache_salt: str | None,
        parent_uid: int | None,
    ) -> Block | None:
        """The cached block whose content matches exactly, or ``None``.

        Candidates come from ``key``; each is checked on token ids, salt and parent uid, so
        a key collision is never served.
        """
        candidates = self._index.get(key)
        if not candidates:
            return None
        for block in candidates.values():
            c = block.content
            assert c is not None
            if (
                c.parent_uid == parent_uid
                and c.token_ids == token_ids
                and c.cache_salt == cache_salt
            ):
                return block
        return None

    def cached_contents(self) -> list[BlockContent]:
        """The content of every cached block (used or free), in block id order."""
        return [b.content for b in self.blocks if b.content is not None]

    def reset_prefix_cache(self) -> int:
        """Drop the hash of every free-cached block (they become free-empty); returns how many."""
        n = len(self._free_cached)
        for block_id in list(self._free_cached):
            self._uncache(self._blocks[block_id])
            self._free_empty.append(block_id)
        self._free_cached.clear()
        return n

    def hold_uid(self, uid: int) -> None:
        """One more holder of cache uid ``uid`` (see ``release_uid``)."""
        self._uid_holders[uid] = self._uid_holders.get(uid, 0) + 1

    def release_uid(self, uid: int) -> None:
        """Drop a holder of ``uid``; a tombstone left without holders goes, and releases its
        own parent."""
        while True:
            n = self._uid_holders[uid] - 1
            if n:
                self._uid_holders[uid] = n
                return
            del self._uid_holders[uid]
            tomb_key = self._tomb_of_uid.pop(uid, None)
            if tomb_key is None:
                return
            parent = self._tombs.pop(tomb_key).parent_uid
            if parent is None:
                return
            uid = parent

    def _uncache(self, block: Block) -> None:
        c = block.content
        assert c is not None
        bucket = self._index[c.key]
        del bucket[block.block_id]
        if not bucket:
            del self._index[c.key]
        block.content = None
        if self._uid_holders.get(c.uid):
            tomb_key = (c.parent_uid, c.token_ids, c.cache_salt)
            self._tombs[tomb_key] = c
            self._tomb_of_uid[c.uid] = tomb_key
        elif c.parent_uid is not None:
            self.release_uid(c.parent_uid)
        if self.events is not None:
            self.events.removed(c)

    # ---- checks -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is in exactly one state and counts add up."""
        empty = set(self._free_empty)
        assert len(empty) == len(self._free_empty), "block twice in the empty list"
        assert all(i < self._fresh for i in empty), "an id never taken in the empty list"
        empty.update(range(self._fresh, self.num_blocks))
        cached = set(self._free_cached)
        assert not (empty & cached), f"blocks both empty and cached-free: {empty & cached}"
        indexed = {b.block_id for bucket in self._index.values() for b in bucket.values()}
        used = 0
        for block in self.blocks:
            assert block.pin_cnt >= 0 and block.pin_cnt <= block.ref_cnt, block
            if block.ref_cnt > 0:
                used += 1
                assert block.block_id not in empty and block.block_id not in cached, block
            elif block.content is not None:
                assert block.block_id in cached and block.block_id not in empty, block
            else:
                assert block.block_id in empty and block.block_id not in cached, block
            if block.content is not None:
                assert block.block_id in indexed, f"{block} cached but not indexed"
                assert self._index[block.content.key][block.block_id] is block
            else:
                assert block.block_id not in indexed, f"{block} indexed without content"
        assert used + len(empty) + len(cached) == self.num_blocks, (used, len(empty), len(cached))
        self.check_uid_holders(None)

    def check_uid_holders(self, request_holds: dict[int, int] | None) -> None:
        """Raise AssertionError unless each uid's holder count is the entries and tombstones
        chained on it plus ``request_holds[uid]`` (skipped when ``None``), every tombstone has
        holders and names no live entry."""
        live = {b.content.uid for b in self.blocks if b.content is not None}
        expected: dict[int, int] = dict(request_holds or {})
        chained = [b.content for b in self.blocks if b.content is not None]
        for c in [*chained, *self._tombs.values()]:
            if c.parent_uid is not None:
                expected[c.parent_uid] = expected.get(c.parent_uid, 0) + 1
        for uid, tomb_key in self._tomb_of_uid.items():
            assert uid not in live, f"uid {uid} both live and a tombstone"
            assert self._tombs[tomb_key].uid == uid and self._uid_holders.get(uid), uid
        assert len(self._tombs) == len(self._tomb_of_uid)
        if request_holds is not None:
            assert self._uid_holders == expected, (self._uid_holders, expected)
        else:
            for uid, n in expected.items():
                assert self._uid_holders.get(uid, 0) >= n, (uid, n, self._uid_holders.get(uid))
