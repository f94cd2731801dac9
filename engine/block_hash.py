"""Hash-chained keys of full KV blocks for the prefix cache.

A full block's key is a 128-bit xxhash (``xxhash.xxh3_128``) of the parent block's key, the
block's token ids and extra keys; the cache salt is the first block's extra key, so two salts
never produce the same chain (vLLM v1 ``kv_cache_utils.hash_block_tokens`` uses the same
parent/tokens/extra-keys triple). Keys only find candidates: a hit is served only after the
candidate's stored ``BlockContent`` (token ids, salt, parent identity) matches, so a collision
can never serve KV computed for other tokens.

The module imports no torch (only ``xxhash``): the gateway computes a request's block keys with
the same functions (``prompt_block_hashes``), so a router's prediction and the engine's prefix
cache agree on every key; ``block_key_bytes`` is a key as KV events publish it.
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

_NO_SALT = b"\xff\xff\xff\xff"

BLOCK_KEY_BYTES = 16
"""Bytes of a published block key (``block_key_bytes``): the 128 bits of ``xxh3_128``."""


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
            block 0 and ``None`` otherwise); ``None`` and ``""`` give different keys, as the
            engine keeps them apart (the key is injective on the salt, as on the tokens).
        hash_fn: bytes → int hash (default ``xxh3_128``).

    Returns:
        The block key (int).
    """
    head = b"\x00" if parent is None else b"\x01" + (int(parent) & _MASK_128).to_bytes(16, "little")
    if cache_salt is None:  # a length no salt has: no salt and the empty salt key apart
        salt = _NO_SALT
    else:
        raw = cache_salt.encode("utf-8")
        salt = len(raw).to_bytes(4, "little") + raw
    data = head + salt + array("q", token_ids).tobytes()
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


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    hash_fn: HashFn = default_hash_fn,
) -> list[BlockKey]:
    """The keys of every full block of ``token_ids``, exactly as the engine keys them.

    The one hashing function of both sides: the engine's KV cache manager keys a request's
    blocks with ``hash_request_blocks`` over the request's token ids and cache salt; a router
    that passes the same token ids (the prompt the engine receives: chat rendered with
    ``encode_chat``, completions encoded with special tokens, or token ids as given) and the
    same salt (the one the gateway sends the engine, ``auth.effective_salt``) gets the same
    keys, one per full block (a trailing partial block has none).

    Args:
        token_ids: the prompt's token ids (ints >= 0).
        block_size: the engine's ``EngineConfig.block_size`` (tokens per block, >= 1).
        cache_salt: the salt the engine request carries (``None``: unsalted).
        hash_fn: bytes -> int hash; the engine's default ``xxh3_128``.

    Returns:
        ``len(token_ids) // block_size`` keys (ints), block 0 first; ``block_key_bytes(k)``
        is each as KV events publish it.

    Raises:
        TypeError: ``token_ids`` not a sequence of ints, ``block_size`` not an int,
            ``cache_salt`` not a str or None.
        ValueError: ``block_size`` < 1 or a token id < 0.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
        raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    # plain ints >= 0: checked at C speed; anything else goes through the loop, which names
    # the first fault
    plain = not token_ids or (set(map(type, token_ids)) == {int} and min(token_ids) >= 0)
    for t in () if plain else token_ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"token ids must be ints, got {t!r}")
        if t < 0:
            raise ValueError(f"token ids must be >= 0, got {t}")
    return hash_request_blocks(token_ids, block_size, cache_salt, [], hash_fn)


def num_reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Most cached blocks a prompt of ``num_tokens`` tokens can be served from.

    The engine always computes the prompt's last token (its logits are needed), so only the
    first ``(num_tokens - 1) // block_size`` full blocks can come from the prefix cache
    (``KVCacheManager.get_computed_blocks``); a router predicts at most that many.
    """
    return max(0, num_tokens - 1) // block_size


def block_key_bytes(key: BlockKey) -> bytes:
    """A block key as KV events publish it: ``BLOCK_KEY_BYTES`` bytes, big-endian (vLLM's
    ``bytes`` form of a block hash; a 128-bit key does not fit msgpack's 64-bit ints)."""
    return (int(key) & _MASK_128).to_bytes(BLOCK_KEY_BYTES, "big")


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
        parent_key: the parent block's key (``None`` for a first block); KV events publish it
            as ``BlockStored.parent_block_hash``.
    """

    key: BlockKey
    token_ids: tuple[int, ...]
    cache_salt: str | None
    parent_uid: int | None
    uid: int
    parent_key: BlockKey | None = None
