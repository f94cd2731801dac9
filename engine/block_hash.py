"""Hash-chained keys of full KV blocks for the prefix cache.

A full block's key is a 128-bit xxhash (``xxhash.xxh3_128``) of the parent block's key, the
block's token ids and extra keys; the cache salt is the first block's extra key, so two salts
never produce the same chain (vLLM v1 ``kv_cache_utils.hash_block_tokens`` uses the same
parent/tokens/extra-keys triple). Keys only find candidates: a hit is served only after the
candidate's stored ``BlockContent`` (token ids, salt, parent identity) matches, so a collision
can never serve KV computed for other tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

BlockKey = int
"""A block key: 128-bit unsigned int from ``xxh3_128`` (or whatever a ``hash_fn`` returns)."""

HashFn = Callable[[bytes], int]
"""Maps the serialized (parent key, extra keys, token ids) to a key. Test hook: force collisions."""

_MASK_128 = (1 << 128) - 1


def default_hash_fn(data: bytes) -> int:
    """``xxhash.xxh3_128`` of ``data`` as an unsigned int."""
    return xxhash.xxh3_128_intdigest(data)


def hash_block_tokens(
    parent: BlockKey | None,
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    hash_fn: HashFn = default_hash_fn,
) -> BlockKey:
    """Key of one full block.

    Args:
        parent: key of the previous block, ``None`` for the first block.
        token_ids: the block's ``block_size`` token ids.
        cache_salt: extra key, mixed into the first block only (the caller passes it for
            block 0 and ``None`` otherwise).
        hash_fn: bytes → int hash (default ``xxh3_128``).

    Returns:
        The block key (int).
    """
    head = b"\x00" if parent is None else b"\x01" + (int(parent) & _MASK_128).to_bytes(16, "little")
    salt = b"" if cache_salt is None else cache_salt.encode("utf-8")
    data = head + len(salt).to_bytes(4, "little") + salt + array("q", token_ids).tobytes()
    return hash_fn(data)


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    hashes: list[BlockKey],
    hash_fn: HashFn = default_hash_fn,
) -> list[BlockKey]:
    """Extend ``hashes`` in place with the keys of every new full block of ``token_ids``.

    ``hashes`` already holds the keys of the first ``len(hashes)`` blocks (incremental: decode
    steps hash each block once, when it fills). Returns ``hashes``.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, cache_salt if i == 0 else None, hash_fn))
    return hashes


@dataclass(slots=True, frozen=True)
class BlockContent:
    """What a cached block holds, checked on every hit (the collision guard).

    Attributes:
        key: the block key (dictionary index only; never trusted alone).
        token_ids: the block's token ids.
        cache_salt: the salt of the chain (the first block's extra key).
        parent_uid: ``uid`` of the cached parent block when this block was cached, ``None`` for a
            first block. Cache uids are never reused, so matching the parent's uid proves the
            whole chain before this block matches, not just its key.
        uid: this cache entry's unique id (a new one each time a block is cached).
    """

    key: BlockKey
    token_ids: tuple[int, ...]
    cache_salt: str | None
    parent_uid: int | None
    uid: int
