"""API keys, per-key rate limits (token buckets) and per-key cache salts.

Keys come from ``--api-key`` (repeatable, no limits) and/or a keys file (JSON, or TOML when
the name ends in ``.toml``)::

    {"keys": [
      {"key": "sk-team-a", "name": "team-a", "requests_per_minute": 600,
       "tokens_per_minute": 200000, "max_concurrent": 16, "salt": "tenant-a"},
      {"key": "sk-team-a-ci", "salt": "tenant-a"},
      {"key": "sk-batch", "name": "batch", "weight": 0.5, "priority": 10,
       "allow_priority": true},
      {"key": "sk-ops", "name": "ops", "role": "operator"}
    ]}

``role``: ``"tenant"`` (the default) or ``"operator"``. A tenant's key sees its own usage only
(its samples of ``/metrics``' per-key and per-tenant families, its own entry of
``/dashboard/data``) and no upstream address; an operator's key sees everything (every key's
usage, the upstreams' URLs and errors in ``/ready`` and ``/metrics``). Keys given with
``--api-key`` are operators' keys; on an open gateway (no key at all) every caller is.

The key's ``name`` is its tenant: the engine's ``fair`` scheduling policy shares the
engine between tenants by ``weight`` (default 1), and the admission queue's bound is shared by
tenants in the same proportion. ``priority`` is the key's default request priority (the
engine's ``priority`` policy: lower first); a request may set its own ``priority`` only when
its key has ``allow_priority`` (else 400 naming the field).

Every limit is optional (absent or 0 = unlimited), but for the key's share of the prefix API,
``max_prefixes`` and ``max_pinned_blocks``: absent = the gateway's defaults
(``GatewaySettings.key_max_prefixes`` / ``key_max_pinned_fraction``), 0 = unlimited. ``salt``
names the prefix-cache partition:
keys with the same salt share cached KV blocks; a key without one gets its own partition
(salt derived from a SHA-256 of the key, so the key itself never reaches the engine). With no
key configured at all the gateway is open and every request shares one partition (salt None).
A request's own ``cache_salt`` field splits its key's partition further (``effective_salt``):
the pair (key salt, request salt) is hashed, so no two different pairs ever meet (key salt
``acme`` with ``cache_salt: "prod"`` is not key salt ``acme/prod``).

Rate limits are token buckets (capacity = the per-minute limit, refilled continuously at
limit/60 per second). Requests/min is charged one per request at admission; tokens/min is
charged the prompt tokens at admission (an estimate in proxy mode) and settled to exactly
prompt + completion tokens when the request ends (so a long answer delays the key's next
requests rather than being cut). A request refused or failed before its first token is
refunded: it spends nothing (``Charge``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prefixgate.gateway.http.errors import (
    ANTHROPIC,
    GEMINI,
    APIError,
    dialect_of,
    takes_query_key,
    too_many,
)
from prefixgate.gateway.http.headers import header_text
from prefixgate.gateway.http.request_account import account
from prefixgate.gateway.tenancy.slot_wait import SlotClock
from prefixgate.sdk.flow_control import TokenBucket

MAX_SALT_CHARS = 256  # cache_salt's bound; a key salt forwarded upstream fits it too


@dataclass(slots=True)
class KeySpec:
    """One API key and its limits (0 = unlimited; ``max_prefixes`` / ``max_pinned_blocks``
    None = the gateway's default share, ``key_max_prefixes`` / ``key_max_pinned_fraction``)."""

    key: str
    name: str = ""
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0
    salt: str | None = None
    weight: float = 1.0
    priority: int = 0
    allow_priority: bool = False
    max_prefixes: int | None = None
    max_pinned_blocks: int | None = None
    role: str = "tenant"

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError("every API key must be a non-empty string")
        if self.key != self.key.strip():
            raise ValueError(
                "an API key must not start or end with whitespace (clients' "
                "keys are read stripped, so it could never match)"
            )
        if not isinstance(self.name, str):
            raise ValueError(f"name of a key must be a string, got {type(self.name).__name__}")
        if not self.name:  # named before the checks below, whose errors name the key
            self.name = "key-" + _digest(self.key)[:8]
        if self.salt is not None and (not isinstance(self.salt, str) or not self.salt):
            raise ValueError(f"salt of key {self.name} must be a non-empty string")
        if self.salt is not None and not _plain_salt(self.salt):
            raise ValueError(
                f"salt of key {self.name} must be at most {MAX_SALT_CHARS} characters "
                "of valid Unicode without control characters"
            )
        for field in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field} of key {self.name} must be an integer >= 0")
        if (
            isinstance(self.weight, bool)
            or not isinstance(self.weight, int | float)
            or not 0 < self.weight < float("inf")
        ):
            raise ValueError(f"weight of key {self.name} must be a number > 0")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority of key {self.name} must be an integer")
        if not isinstance(self.allow_priority, bool):
            raise ValueError(f"allow_priority of key {self.name} must be true or false")
        for field in ("max_prefixes", "max_pinned_blocks"):
            value = getattr(self, field)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{field} of key {self.name} must be an integer >= 0")
        if self.role not in ROLES:
            raise ValueError(f"role of key {self.name} must be one of {', '.join(ROLES)}")
        if self.salt is None:
            self.salt = "key:" + _digest(self.key)[:32]


ROLES = ("tenant", "operator")  # a key's role: what of the gateway's state it may read


KEY_FIELDS = tuple(f.name for f in dataclasses.fields(KeySpec))  # a keys-file entry's fields


def _plain_salt(salt: str) -> bool:
    """A key salt: bounded, printable, valid UTF-8 (so ``effective_salt`` stays injective)."""
    if len(salt) > MAX_SALT_CHARS or any(ord(c) < 0x20 for c in salt):
        return False
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Principal:
    """An authenticated caller: its key's limits and live counters."""

    __slots__ = ("spec", "id", "salt", "key_id", "concurrent", "slots", "_rpm", "_tpm")

    def __init__(self, spec: KeySpec | None) -> None:
        self.spec = spec
        self.id = "key:" + _digest(spec.key)[:32] if spec else None  # never the key itself
        self.salt = spec.salt if spec else None
        # The key's name in shared state (Redis): a digest, never the key itself.
        self.key_id = _digest(spec.key)[:32] if spec else ""
        self.concurrent = 0
        self.slots = SlotClock()  # its requests' hold times: max_concurrent's Retry-After
        self._rpm = (
            TokenBucket(spec.requests_per_minute, spec.requests_per_minute / 60.0)
            if spec and spec.requests_per_minute
            else None
        )
        self._tpm = (
            TokenBucket(spec.tokens_per_minute, spec.tokens_per_minute / 60.0)
            if spec and spec.tokens_per_minute
            else None
        )

    @property
    def name(self) -> str:
        return self.spec.name if self.spec else "anonymous"

    @property
    def operator(self) -> bool:
        """True for an operator's key, and for every caller of an open gateway (no keys)."""
        return self.spec is None or self.spec.role == "operator"

    @property
    def tenant(self) -> str | None:
        """The tenant the engine charges (the key's name; ``None`` on an open gateway)."""
        return self.spec.name if self.spec else None

    @property
    def weight(self) -> float:
        return self.spec.weight if self.spec else 1.0

    def request_priority(self, requested: int | None) -> int:
        """The engine priority of a request: its own ``priority`` when the key allows it,
        else the key's.

        Raises:
            APIError: 400 naming ``priority`` when the request sets it and the key may not.
        """
        if requested is None:
            return self.spec.priority if self.spec else 0
        if self.spec is not None and not self.spec.allow_priority:
            raise APIError(
                400,
                f"key {self.spec.name} may not set a request priority (allow_priority is off)",
                param="priority",
                code="priority_not_allowed",
            )
        return requested

    def acquire(self, prompt_tokens: int) -> Charge:
        """Count one request of ``prompt_tokens`` against the key's limits (the prompt an
        estimate when the gateway cannot tokenize it: ``Charge.settle`` makes it exact).

        Returns:
            The request's ``Charge``: ``settle(prompt, completion)`` when it ends with tokens
            served, ``refund()`` when it was refused or failed before any (it spends nothing).

        Raises:
            APIError: 429 ``rate_limit_exceeded`` when over a limit (nothing taken), naming
                every limit it is over, with ``Retry-After`` the longest of their waits: a
                concurrency slot's estimated release (``SlotClock``), a bucket's exact time
                until it holds the request (``TokenBucket.take``).
        """
        spec = self.spec
        if spec is None:
            return Charge(self, 0)
        # Every bound is asked, and the 429 states the longest wait of those that refuse: a
        # client told only the first bound's wait came back to meet the next one.
        refusals: list[tuple[str, float]] = []
        if spec.max_concurrent and self.concurrent >= spec.max_concurrent:
            refusals.append(
                (
                    f"already has {self.concurrent} requests in flight "
                    f"(max_concurrent={spec.max_concurrent})",
                    self.slots.wait(self.concurrent + 1 - spec.max_concurrent),
                )
            )
        took_request = took_tokens = False
        if self._rpm is not None:
            wait = self._rpm.take(1)
            if wait:
                refusals.append((f"is over {spec.requests_per_minute} requests per minute", wait))
            else:
                took_request = True
        if self._tpm is not None:
            wait = self._tpm.take(prompt_tokens)
            if wait:
                refusals.append((f"is over {spec.tokens_per_minute} tokens per minute", wait))
            else:
                took_tokens = True
        if refusals:  # nothing is taken: give back what the passing buckets gave
            if took_request and self._rpm is not None:
                self._rpm.adjust(-1)
            if took_tokens and self._tpm is not None:
                self._tpm.adjust(-prompt_tokens)
            reasons = " and ".join(reason for reason, _ in refusals)
            raise too_many(f"key {spec.name} {reasons}", max(w for _, w in refusals))
        self.concurrent += 1
        return Charge(self, prompt_tokens, self.slots.take())


class Charge:
    """What one admitted request took from its key: a request, a concurrency slot and its
    (estimated) prompt tokens. Ends once, by ``settle`` or ``refund`` (later calls no-ops).

    Accounting rule: a request answered with tokens costs one request and exactly its prompt
    + completion tokens (the usage it reports: its ``RequestAccount``, through
    ``shared_state.close_lease``); a request refused or failed before its
    first token (400, 413, 429 of admission, an engine or upstream failure) costs nothing.
    """

    __slots__ = ("_principal", "_taken", "_open", "_slot")

    def __init__(self, principal: Principal, taken_tokens: int, slot: int | None = None) -> None:
        self._principal = principal
        self._taken = taken_tokens
        self._open = True
        self._slot = slot

    @property
    def slot(self) -> int | None:
        """The key's ``Principal.slots`` token of this charge (None on an open gateway)."""
        return self._slot

    def settle(self, prompt_tokens: int, completion_tokens: int) -> None:
        """The request was served: charge ``prompt_tokens + completion_tokens`` in all (the
        difference to what admission took; the level may go into debt) and free the slot."""
        if not self._end():
            return
        tpm = self._principal._tpm
        if tpm is not None:
            delta = prompt_tokens + completion_tokens - self._taken
            if delta >= 0:
                tpm.charge(delta)  # may leave a debt, repaid by refill
            else:
                tpm.adjust(delta)  # the estimate was high: the rest back, capped

    def refund(self) -> None:
        """Refused or failed before any token: give back the request and its tokens."""
        if not self._end():
            return
        p = self._principal
        if p._rpm is not None:
            p._rpm.adjust(-1)
        if p._tpm is not None:
            p._tpm.adjust(-self._taken)

    def _end(self) -> bool:
        if not self._open:
            return False
        self._open = False
        if self._principal.spec is not None:
            self._principal.concurrent -= 1
        if self._slot is not None:
            self._principal.slots.give(self._slot)
        return True


def effective_salt(key_salt: str | None, request_salt: str | None) -> str | None:
    """The engine's cache salt of a request: its key's partition, sub-partitioned by the
    request's own ``cache_salt`` (vLLM's field) when given, so a client can split but never
    leave its key's partition.

    Always one vLLM takes as a request's ``cache_salt`` (``UPSTREAM_SALT_CHARS``: at most 128
    characters, none of ``@``, ``/``, ``\\`` or NUL; vLLM refuses the whole request
    otherwise), so a proxy forwards it as it is. Injective: ``(key_salt, None)`` is
    ``key_salt`` itself when vLLM takes it; any other pair is ``"\\x01"`` + SHA-256 of the
    JSON array ``[key_salt, request_salt]`` (JSON is injective on pairs of strings or null; a
    key salt never holds a control character, so never starts so), so no two different pairs
    share a partition: key salt ``acme`` + ``"prod"`` is not key salt ``acme/prod``, nor key
    salt ``acme/`` + ``"prod"``. ``(None, None)`` is ``None``.
    """
    if request_salt is None and (key_salt is None or upstream_takes_salt(key_salt)):
        return key_salt
    pair = json.dumps([key_salt, request_salt], ensure_ascii=True)
    return "\x01" + hashlib.sha256(pair.encode("ascii")).hexdigest()


UPSTREAM_SALT_CHARS = 128
"""The longest ``cache_salt`` vLLM takes (``validate_cache_salt``, vLLM 0.32)."""


def upstream_takes_salt(salt: str) -> bool:
    """Whether vLLM takes ``salt`` as a request's ``cache_salt``: non-empty, at most
    ``UPSTREAM_SALT_CHARS`` characters, none of ``@``, ``/``, ``\\`` or NUL."""
    return 0 < len(salt) <= UPSTREAM_SALT_CHARS and not any(c in "@/\\\x00" for c in salt)


# the request's (KeyRing, Principal) once authenticated
_AUTHENTICATED = web.RequestKey("prefixgate_principal", tuple)


class KeyRing:
    """The configured keys; ``authenticate(request)`` returns the caller's Principal."""

    def __init__(self, specs: list[KeySpec] | None = None) -> None:
        self._by_digest: dict[str, Principal] = {}
        for spec in specs or []:
            digest = _digest(spec.key)
            seen = self._by_digest.get(digest)
            if seen is not None and seen.spec != spec:
                raise ValueError(
                    f"duplicate API key in the configured keys ({spec_name(seen.spec)!r} "
                    f"and {spec.name!r}) with different limits or salt"
                )
            self._by_digest[digest] = Principal(spec)
        self._anonymous = Principal(None)

    @classmethod
    def from_options(
        cls,
        api_keys: list[str] | None = None,
        keys_file: str | None = None,
        file_specs: list[KeySpec] | None = None,
    ) -> KeyRing:
        """Keys from ``--api-key`` values and a keys file (``file_specs``: its keys as the
        caller read them already, ``load_keys_file``; else it is read here).

        Raises:
            ValueError: on an unreadable or malformed keys file (naming the file), or a
                key configured twice with different settings.
        """
        specs = [KeySpec(key=k, role="operator") for k in api_keys or []]
        if keys_file:
            specs.extend(file_specs if file_specs is not None else load_keys_file(keys_file))
        return cls(specs)

    @property
    def open(self) -> bool:
        """True when no key is configured (no authentication)."""
        return not self._by_digest

    def authenticate(self, request: web.Request) -> Principal:
        """The Principal for the request's ``Authorization: Bearer <key>`` header, or, when it
        sends no Authorization, its ``x-api-key: <key>`` header (Anthropic's clients), its
        ``x-goog-api-key: <key>`` header (Gemini's clients) or, on Gemini's routes
        and ``/v1/models`` (``takes_query_key``) only, its ``?key=<key>`` query parameter
        (Gemini's REST form).

        Read once per request: the answer is kept on the request (the middleware's
        ``require_key`` and the route ask the same ring).

        Raises:
            APIError: 401 ``invalid_api_key`` when the key is missing or unknown; 400
                ``invalid_header`` when the header's bytes are not UTF-8.
        """
        kept = request.get(_AUTHENTICATED)
        if kept is not None and kept[0] is self:
            return kept[1]
        principal = self._authenticate(request)
        request[_AUTHENTICATED] = (self, principal)
        return principal

    def _authenticate(self, request: web.Request) -> Principal:
        if not self._by_digest:
            account(request).key_name = "-"
            return self._anonymous
        header = client_credential(request)
        scheme = (header.split(maxsplit=1) or [""])[0]
        key = bearer_token(header)
        # the header the route's clients send: Anthropic's send x-api-key
        send = {
            ANTHROPIC: "'x-api-key: <key>' (or 'Authorization: Bearer <key>')",
            GEMINI: "'x-goog-api-key: <key>' (or '?key=<key>', or 'Authorization: Bearer <key>')",
        }.get(dialect_of(request), "'Authorization: Bearer <key>'")
        if header.strip() and scheme.lower() != "bearer":
            # named only when it reads as a scheme's word (Basic, Token): a key sent without
            # a scheme, or glued to one by a tab, is never echoed
            named = (
                f" {scheme!r}"
                if scheme.isascii() and scheme.isalpha() and len(scheme) <= 12
                else ""
            )
            raise APIError(
                401,
                f"the Authorization scheme{named} is not supported: send {send}",
                code="invalid_api_key",
            )
        if key is None:
            raise APIError(401, f"missing API key: send {send}", code="invalid_api_key")
        principal = self._by_digest.get(_digest(key))
        if principal is None:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        account(request).key_name = (principal.spec.name if principal.spec else "") or "unnamed"
        return principal


def bearer_token(credential: str) -> str | None:
    """The token of an ``Authorization`` value of the Bearer scheme (RFC 6750), its scheme
    matched case-insensitively (RFC 7235 section 2.1: ``bearer x`` is ``Bearer x``),
    surrounding spaces dropped; None for another scheme or no token. The one reading of a
    Bearer credential: the key ring's, the proxy's towards its upstreams."""
    scheme, _, token = credential.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def client_credential(request: web.Request) -> str:
    """The request's credential as an ``Authorization`` value: its ``Authorization`` header
    (a Bearer one spelt ``Bearer <token>``, whatever the scheme's case: ``bearer_token``),
    else ``Bearer <key>`` of its ``x-api-key`` header (Anthropic's clients), its
    ``x-goog-api-key`` header (Gemini's) or, on Gemini's routes and ``/v1/models``
    (``takes_query_key``) only, its ``?key=`` query parameter
    (Gemini's REST form); ``""`` when it sends none. The one reading of every dialect's
    credential: the key ring authenticates by it, an open proxy forwards it.

    Raises:
        APIError: 400 ``invalid_header`` when a header's bytes are not UTF-8.
    """
    header = header_text(request, "Authorization")
    if header.strip():
        token = bearer_token(header)
        return header if token is None else "Bearer " + token
    other = header_text(request, "x-api-key") or header_text(request, "x-goog-api-key")
    if not other.strip() and takes_query_key(request.path):
        other = request.query.get("key", "")
    return "Bearer " + other.strip() if other.strip() else ""


def load_keys_file(path: str) -> list[KeySpec]:
    """Read a keys file (format in the module docstring).

    Raises:
        ValueError: unreadable file, bad syntax, no keys (``{"keys": []}``: a server started
            with it would answer every request unauthenticated), or an entry with unknown or
            invalid fields.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
        data = tomllib.loads(raw.decode()) if p.suffix == ".toml" else json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read keys file {path}: {exc}") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f'keys file {path} must hold {{"keys": [...]}}')
    if not entries:  # given to require keys: none would leave every request open
        raise ValueError(
            f"the keys file {path} has no keys: every request would be open; "
            "add a key or drop --keys-file"
        )
    specs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"keys file {path}: entry {i} is not an object")
        unknown = sorted(set(entry) - set(KEY_FIELDS))
        if unknown:
            near = difflib.get_close_matches(unknown[0], KEY_FIELDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(
                f"keys file {path}: entry {i}: unknown field {unknown[0]!r}{hint}; "
                f"valid fields: {', '.join(KEY_FIELDS)}"
            )
        if "key" not in entry:
            raise ValueError(f"keys file {path}: entry {i}: missing field 'key'")
        try:
            specs.append(KeySpec(**entry))
        except TypeError as exc:
            raise ValueError(f"keys file {path}: entry {i}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"keys file {path}: entry {i}: {exc}") from None
    return specs


def spec_name(spec: KeySpec | None) -> str:
    """The key's display name (``""`` for the anonymous caller of an open gateway)."""
    return spec.name if spec is not None else ""
