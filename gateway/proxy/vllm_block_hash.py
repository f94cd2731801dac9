"""vLLM's prefix-cache block hashes, as a vLLM engine keys a prompt and its KV events carry them.

Source: vLLM 0.32 ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``,
``init_none_hash``, ``generate_block_hash_extra_keys``, ``maybe_convert_block_hash``) and
``vllm/utils/hashing.py`` (``sha256``), with vLLM's defaults:

- ``--prefix-caching-hash-algo sha256``: a block's hash is
  ``sha256(pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=HIGHEST)).digest()``
  (32 bytes); ``parent`` is the previous block's hash, ``NONE_HASH`` for block 0;
- ``NONE_HASH = sha256(pickle.dumps(seed))`` with ``seed`` the engine's ``PYTHONHASHSEED``
  when set, else ``"vllm-none-hash"`` (``DEFAULT_NONE_HASH_SEED``);
- ``extra_keys`` is ``None``, or for block 0 of a salted request ``(("cache_salt", salt),)``
  (LoRA adapters, multimodal inputs and prompt embeddings add keys; the gateway routes text
  prompts only, and an empty salt is no salt);
- KV events publish each hash as its low 64 bits, an unsigned int
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default), else the 32 bytes.

The other algorithms (``sha256_cbor``, ``xxhash``, ``xxhash_cbor``) are not reproduced: a
replica whose events do not verify against these hashes is routed without prediction
(``kv_index.KVIndex.hash_scheme``).

Stdlib only (``pickle`` only serializes here, our own tuples; nothing is unpickled).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "none_hash",
    "vllm_block_hash",
    "vllm_external_hash",
    "vllm_prompt_block_hashes",
]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's seed of ``NONE_HASH`` when ``PYTHONHASHSEED`` is not set (sha256)."""

_MASK_64 = (1 << 64) - 1


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str = DEFAULT_NONE_HASH_SEED) -> bytes:
    """vLLM's ``NONE_HASH`` (the parent of block 0) for ``seed`` (32 bytes)."""
    return _sha256(seed)


def vllm_block_hash(
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
    seed: str = DEFAULT_NONE_HASH_SEED,
) -> bytes:
    """One full block's 32-byte hash (``hash_block_tokens`` under ``sha256``).

    Args:
        parent: the previous block's 32-byte hash, ``None`` for block 0.
        token_ids: the block's token ids.
        extra_keys: vLLM's tagged extra keys, e.g. ``(("cache_salt", "s"),)``, or ``None``.
        seed: the engine's ``NONE_HASH`` seed.
    """
    head = parent if parent else none_hash(seed)
    return _sha256((head, tuple(int(t) for t in token_ids), extra_keys))


def vllm_external_hash(digest: bytes, as_int: bool = True) -> bytes | int:
    """A 32-byte block hash as KV events carry it: the low 64 bits as an unsigned int
    (``as_int``, vLLM's default), else the bytes."""
    return int.from_bytes(digest, "big") & _MASK_64 if as_int else digest


def vllm_prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    seed: str = DEFAULT_NONE_HASH_SEED,
    as_int: bool = True,
) -> list[bytes | int]:
    """The hashes of every full block of ``token_ids`` as a vLLM engine's KV events publish
    them (block 0 first; a trailing partial block has none).

    Args:
        token_ids: the prompt's token ids exactly as the engine receives them.
        block_size: the engine's tokens per block (>= 1).
        cache_salt: the request's ``cache_salt`` (``None`` or ``""``: unsalted).
        seed: the engine's ``NONE_HASH`` seed.
        as_int: the events' form (``vllm_external_hash``).

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[bytes | int] = []
    parent: bytes | None = None
    for i in range(len(token_ids) // block_size):
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
        parent = vllm_block_hash(
            parent, token_ids[i * block_size : (i + 1) * block_size], extra, seed
        )
        out.append(vllm_external_hash(parent, as_int))
    return out
