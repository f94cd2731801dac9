"""``ProxyPrefix``: one prefix registered through the gateway in upstream mode (the record the
registry, ``proxy.prefixes``, keeps and ``proxy.prefix_placement`` places on an upstream)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ProxyPrefix:
    """One prefix registered through the gateway in upstream mode.

    Attributes:
        id: the gateway's public id (``"pfx-..."``).
        model: the ``model`` it was created for.
        messages: the leading messages as ``{"role", "content"}`` dicts (kept in all cases).
        prompt_tokens: tokens of the rendered prefix as the upstream counted them (0 when a
            non-prefixgate upstream cannot count them: no ``/tokenize``).
        created_at: Unix seconds.
        expires_at: Unix seconds; the prefix is gone after it.
        salt: the creating key's salt (its owner: other salts get 404).
        cache_salt: the effective cache salt of the create (key salt + request ``cache_salt``).
        owner: the creating key's id (its ``max_prefixes``), None on an open gateway.
        upstream: base URL of the prefixgate upstream holding its pin (None: text kept here
            and sent in full).
        upstream_id: the prefix's id on that upstream.
        published: written to the shared state (Redis) for the other replicas.
        headers: the ``Authorization`` used on the upstream (this replica's memory only,
            for the release at shutdown; never published).
    """

    id: str
    model: str
    messages: list[dict[str, Any]]
    prompt_tokens: int
    created_at: int
    expires_at: float
    salt: str | None
    cache_salt: str | None
    owner: str | None = None
    upstream: str | None = None
    upstream_id: str | None = None
    published: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    def seconds_left(self) -> float:
        """Seconds until it expires (<= 0: expired)."""
        return self.expires_at - time.time()

    def record(self) -> dict[str, Any]:
        """What is published for the other replicas (local mode's record fields + the
        upstream registration)."""
        return {
            "id": self.id,
            "model": self.model,
            "messages": self.messages,
            "prompt_tokens": self.prompt_tokens,
            "created": self.created_at,
            "expires_at": self.expires_at,
            "salt": self.salt,
            "cache_salt": self.cache_salt,
            "upstream": self.upstream,
            "upstream_id": self.upstream_id,
            "owner": self.owner,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ProxyPrefix:
        """A prefix read from the shared state (a local-mode record has no registration:
        its text is sent in full)."""
        return cls(
            id=str(record["id"]),
            model=str(record.get("model", "")),
            messages=list(record["messages"]),
            prompt_tokens=int(record.get("prompt_tokens", 0)),
            created_at=int(record.get("created", 0)),
            expires_at=float(record["expires_at"]),
            salt=record.get("salt"),
            cache_salt=record.get("cache_salt", record.get("salt")),
            upstream=record.get("upstream"),
            upstream_id=record.get("upstream_id"),
            owner=record.get("owner"),
            published=True,
        )
