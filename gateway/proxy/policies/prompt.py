"""What routing reads of a request: its affinity key, its prompt's text blocks, its model
(``Route``), made from a chat or completions body without a tokenizer.

The affinity key is the prompt's leading text in whole "blocks" of ``block_chars``
characters, at most ``max_chars``: the leading system/developer messages of a chat (else
its first message), or a completion's prompt. A key shorter than one block is used whole.
The prompt's blocks (``prompt_blocks``) are the whole prompt's text cut the same way and
hashed (xxh3_64), the salt first so tenants' partitions never match each other.
"""

from __future__ import annotations

from typing import Any

import xxhash
from prefixgate.gateway.wire.request_models import content_text


class Route:
    """What routing knows of one request: the rendezvous ``key`` (leading blocks of its
    system prompt, salted; None without one), the whole prompt's ``blocks``
    (``prompt_blocks``, salted; empty unless the policy reads them) and the requested
    ``model`` (None: any upstream may take it)."""

    __slots__ = ("key", "blocks", "predicted", "model")

    def __init__(self, key: bytes | None, blocks: list[int], model: str | None = None) -> None:
        self.key = key
        self.blocks = blocks
        self.model = model
        self.predicted = 0  # blocks the chosen upstream held by the tree (cache_aware)


def salted_affinity_key(key: bytes | None, salt: str | None) -> bytes | None:
    """The affinity key of a request in cache partition ``salt``: tenants that can never
    share cached blocks need not meet on one upstream (``None`` salt: the key unchanged)."""
    if key is None or salt is None:
        return key
    return salt.encode("utf-8", "surrogatepass") + b"\x00" + key


class _IdText(dict[int, str]):
    """``str`` of token ids, kept for ids below ``2**18`` (a vocabulary's)."""

    def __missing__(self, key: int) -> str:
        text = str(key)
        if 0 <= key < 1 << 18:
            self[key] = text
        return text


_ID_TEXT = _IdText()


def ids_text(ids: list[Any]) -> str:
    """``",".join(map(str, ids))``, the ids' text from a table when they are all ints."""
    if set(map(type, ids)) == {int}:
        return ",".join(map(_ID_TEXT.__getitem__, ids))
    return ",".join(map(str, ids))


def prompt_text(body: Any, max_chars: int | None = None) -> str:
    """The whole prompt of a chat or completions body as text (messages as ``role: content``
    lines; a token-id prompt as its comma-joined ids), cut to ``max_chars`` characters when
    given (a token-id prompt is then joined only as far as needed)."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        text = "".join(
            f"{m.get('role')}: {content_text(m.get('content'))}\n"
            for m in messages
            if isinstance(m, dict)
        )
        return text if max_chars is None else text[:max_chars]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt if max_chars is None else prompt[:max_chars]
    if isinstance(prompt, list):
        if max_chars is None:
            return ids_text(prompt)
        # k ids give at least 2k - 1 characters: join a quarter of max_chars ids, then, when
        # short, enough more that the text is max_chars long or the prompt is all in
        k = max(1, max_chars // 4)
        text = ids_text(prompt[:k])
        short = max_chars - len(text)
        if short > 0 and k < len(prompt):
            text += "," + ids_text(prompt[k : k + short // 2 + 1])
        return text[:max_chars]
    return ""


def affinity_key(body: Any, block_chars: int = 64, max_chars: int = 4096) -> bytes | None:
    """The prompt's leading blocks of text (UTF-8 bytes) of a chat or completions body."""
    if not isinstance(body, dict):
        return None
    text = ""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        lead = []
        for m in messages:
            if isinstance(m, dict) and m.get("role") in ("system", "developer"):
                lead.append(content_text(m.get("content")))
            else:
                break
        text = (
            "\n".join(lead)
            if lead
            else (content_text(messages[0].get("content")) if isinstance(messages[0], dict) else "")
        )
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list):
            text = ids_text(prompt[: max_chars // 4])
    if not text:
        return None
    n = min(len(text), max_chars)
    if n >= block_chars:
        n -= n % block_chars
    return text[:n].encode("utf-8", "surrogatepass")  # a lone surrogate is client text too


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
