"""Upstream mode: a pool of OpenAI-compatible servers, the models each serves, and the
choice of one per request.

Choosing the upstream of one request:

1. Only upstreams serving the request's ``model`` are candidates: the ids of each one's
   ``GET /v1/models`` (asked at start and again every ``health_interval_s``, so an upstream
   whose models change is followed), or the models a config file gives its deployments
   (``proxy.model_list``; aliases resolved first). A model no upstream lists is the
   gateway's own 404 ``model_not_found``; an upstream that never answered ``/v1/models`` is
   a candidate only for a model no known upstream lists (it may serve it).
2. Of those, only the ones in rotation (``proxy.health``, after Envoy's outlier detection):
   ``consecutive_failures`` gateway failures in a row (a refused or reset connection, a
   connect timeout, a 502/503/504, an answer cut mid-body or not in the OpenAI shape) eject
   an upstream for a time that grows with its ejections, never beyond
   ``max_ejection_percent`` of the pool (one bad answer fails only its request); active
   checks (``GET /health`` every ``health_interval_s``, timed out after
   ``health_check_timeout_s``) mark a frozen, silent or dead upstream down after
   ``unhealthy_threshold`` failures and bring it back after ``healthy_threshold`` passes;
   an ejected one returns half-open (one more failure ejects it again) once a check passes
   after its ejection time. Every upstream is checked at start.
3. An upstream that answered 429 with ``Retry-After`` is left out for that long, and one at
   its ``max_in_flight`` is left out while it is: others serve. When every candidate is
   rate limited they are tried anyway (the limit is theirs to enforce, and may be the
   client key's own); when every one is full, 429 with ``Retry-After``.
4. The routing policy picks among the rest (``proxy.policies``, ``--routing``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from prefixgate.gateway.http.access_log import HEALTH_CHECK_USER_AGENT
from prefixgate.gateway.http.errors import APIError, bad_request, not_found, shown
from prefixgate.gateway.proxy.health import HealthPolicy, UpstreamHealth
from prefixgate.gateway.proxy.model_list import ModelList
from prefixgate.gateway.proxy.policies import (
    PrefixTree,
    Route,
    RoutingPolicy,
    affinity_key,
    make_policy,
    prompt_text,
    salted_affinity_key,
)
from prefixgate.gateway.proxy.urls import normalize_url as normalize_url  # re-exported
from prefixgate.gateway.proxy.urls import split_credentials
from prefixgate.gateway.tenancy.slot_wait import SlotClock

logger = logging.getLogger("prefixgate.gateway")

FAILURE_THRESHOLD = HealthPolicy().consecutive_failures  # the default failures that eject
MODELS_EVERY = 5  # health-check rounds between two reads of an upstream's /v1/models


class Upstream:
    """One upstream server (a deployment): its base URL (without userinfo), the
    ``Authorization`` value it is sent (``auth``: made of the URL's userinfo, or a config
    file's credential; None without), TLS (``ssl``: True for default verification, an
    ``ssl.SSLContext`` of its own CA bundle / client certificate, False only when a config
    turns verification off), ``weight`` and ``max_in_flight`` (0: no limit), health,
    in-flight request count and the models it serves.

    ``models``: the public model names it serves (None while unknown): its ``/v1/models``
    ids, or the config's names for it (``names`` then maps each to the upstream's own id,
    and discovery leaves them as they are). ``cards``: its model cards by id as it sent them.

    Raises:
        ValueError: a malformed URL; a URL with userinfo given another credential too.
    """

    __slots__ = (
        "url",
        "auth",
        "seed",
        "health",
        "in_flight",
        "failures",
        "served",
        "last_error",
        "cache_salt",
        "cache_misses",
        "cached_tokens_reported",
        "engine_load",
        "prefix_api",
        "models",
        "names",
        "cards",
        "weight",
        "max_in_flight",
        "limited_until",
        "slots",
        "ssl",
        "dialect",
        "auth_refused",
    )

    def __init__(
        self,
        url: str,
        auth: str | None = None,
        weight: float = 1.0,
        max_in_flight: int = 0,
        tls: ssl.SSLContext | bool = True,
        names: Mapping[str, str] | None = None,
        dialect: str = "openai",
    ) -> None:
        self.url, self.auth = split_credentials(url)  # url: never holds a password
        if auth is not None:
            if self.auth is not None:
                raise ValueError(f"upstream {self.url}: give user:password or a credential")
            self.auth = auth
        self.seed = zlib.crc32(self.url.encode())
        self.health = UpstreamHealth()  # ejection and active checks (proxy.health)
        self.in_flight = 0
        self.failures = 0  # gateway failures in all (``strikes``: those in a row)
        self.served = 0
        self.last_error = ""
        # Takes vLLM's ``cache_salt`` (isolates tenants' prefix caches): True / False, or None
        # while unknown (then it is sent: an upstream that refuses it fails loudly).
        self.cache_salt: bool | None = None
        self.cache_misses = 0  # answers that cached less than cache_aware routing predicted
        # Its last answer's usage held a cached-tokens count (upstream_fields.cached_tokens):
        # True / False, None before an answer with usage
        self.cached_tokens_reported: bool | None = None
        # (requests running + waiting, read at, interval) from its /metrics (metrics_load)
        self.engine_load: tuple[int, float, float] | None = None
        # Serves prefixgate's prefix API (``POST /v1/prefixes``): True / False, None while
        # unknown (then tried: a 404/405/501 answer says no).
        self.prefix_api: bool | None = None
        self.names: dict[str, str] = dict(names or {})
        self.models: frozenset[str] | None = frozenset(self.names) if self.names else None
        self.cards: dict[str, dict[str, Any]] = {}
        self.weight = weight
        self.max_in_flight = max_in_flight
        self.limited_until = 0.0  # time.monotonic() until which its 429 keeps it out
        # its requests' hold times (take at dispatch, give at the end): when a full upstream
        # frees a place, the Retry-After of "every upstream is full"
        self.slots = SlotClock()
        self.ssl = tls
        self.dialect = dialect  # "openai", or "anthropic" (the Messages API: proxy.anthropic)
        # the HTTP status (401/403) of its last GET /v1/models when it refused the gateway's
        # credentials (or their absence); None when it answered otherwise, or was not asked
        self.auth_refused: int | None = None
        if dialect == "anthropic":  # no prefix API, no cache_salt (its cache is the account's)
            self.prefix_api = False
            self.cache_salt = False

    @property
    def healthy(self) -> bool:
        """In rotation: neither ejected by its answers nor down by its health checks."""
        return self.health.in_rotation

    @healthy.setter
    def healthy(self, value: bool) -> None:
        """False: down until ``healthy_threshold`` checks pass; True: back in rotation."""
        if value:
            self.health.down = self.health.ejected = False
        else:
            self.health.mark_down()

    @property
    def strikes(self) -> int:
        """Gateway failures in a row (``consecutive_failures`` of them eject it)."""
        return self.health.failures

    def upstream_model(self, model: str) -> str:
        """The upstream's own id of public model ``model`` (the same without a config)."""
        return self.names.get(model, model)

    def __repr__(self) -> str:
        state = "healthy" if self.healthy else "unhealthy"
        return f"Upstream({self.url}, {state}, in_flight={self.in_flight})"


__all__ = ["Route", "affinity_key", "prompt_text", "salted_affinity_key"]  # re-exported


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header's delay in seconds (delta-seconds or an HTTP date, RFC 9110
    10.2.3); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class UpstreamRouter:
    """Picks an upstream per request and keeps the pool's health and models (see the module
    docstring).

    Args:
        urls: base URLs of the upstreams, or ``Upstream`` objects (a config's deployments).
        balance_abs_threshold, balance_rel_threshold: the imbalance rule (in-flight requests).
        health_interval_s: seconds between two active health checks of each upstream
            (``GET /health``); each upstream's ``/v1/models`` is read again every
            ``MODELS_EVERY`` of them.
        connect_timeout_s: connect timeout of each upstream request.
        timeout_s: idle timeout of each upstream request — the longest wait for the answer's
            first byte and between two reads of it (aiohttp's ``sock_read``), never a total:
            a healthy long stream is never cut (0 = none).
        cache_salt: whether the upstreams take ``cache_salt`` (one of
            :data:`CACHE_SALT_MODES`, checked by ``GatewaySettings``): ``"auto"`` (detected from
            ``GET /v1/models``: ``owned_by`` ``"prefixgate"`` or ``"vllm"``, the servers known
            to isolate by it), ``"on"`` or ``"off"`` (all of them).
        auth: ``Authorization`` value for the detection request (``--upstream-api-key``);
            an upstream's own credential is used when it has one.
        forwards_client_keys: the gateway has no keys of its own, so an upstream without a
            credential of the gateway's gets each client's own key: its refusal of the
            gateway's keyless ``GET /v1/models`` does not take it out of ``/ready``.
        policy: a registered routing policy's name (``proxy.policies.POLICIES``).
        block_chars, max_chars: the prompt's affinity blocks (characters) and longest text.
        models: the config file's model list (aliases, fallbacks; ``proxy.model_list``), None
            when the models are discovered.
        health: the outlier-detection and health-check knobs (``proxy.health``; its
            ``interval_s`` is ``health_interval_s``).

    Health (``proxy.health``): each gateway failure of an attempt is counted
    (``mark_failed``), a success clears the count (``mark_ok``); an idle timeout is not a
    failure — one slow request says nothing of the server — it only asks for a check now
    (``suspect``). ``start`` checks every upstream before the first request, so ``/ready``
    is true from the start (a dead upstream is down until its checks pass).

    Raises:
        ValueError: no URL, repeated URLs, or an unknown policy.
    """

    def __init__(
        self,
        urls: Sequence[str | Upstream],
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        health_interval_s: float = 1.0,
        connect_timeout_s: float = 5.0,
        timeout_s: float = 600.0,
        cache_salt: str = "auto",
        auth: str | None = None,
        policy: str = "cache_aware",
        block_chars: int = 64,
        max_chars: int = 4096,
        models: ModelList | None = None,
        health: HealthPolicy | None = None,
        forwards_client_keys: bool = False,
    ) -> None:
        if not urls:
            raise ValueError("upstream mode needs at least one upstream URL")
        self.policy: RoutingPolicy = make_policy(
            policy,
            abs_threshold=balance_abs_threshold,
            rel_threshold=balance_rel_threshold,
            block_chars=block_chars,
            max_chars=max_chars,
        )
        self.upstreams = [u if isinstance(u, Upstream) else Upstream(u) for u in urls]
        if len({u.url for u in self.upstreams}) != len(self.upstreams):
            raise ValueError("upstream URLs must be distinct")
        self.model_list = models
        self.cache_salt_mode = cache_salt
        if cache_salt != "auto":
            for u in self.upstreams:
                u.cache_salt = cache_salt == "on"
        self._auth = auth
        self.forwards_client_keys = forwards_client_keys
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.health_interval_s = health_interval_s
        self.health_policy = dataclasses.replace(
            health or HealthPolicy(), interval_s=health_interval_s
        )

        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=timeout_s or None
        )
        self.timeout_s = timeout_s
        self.session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task | None = None
        self._suspects: set[asyncio.Task] = set()

    @property
    def tree(self) -> PrefixTree:
        """The prefix tree of ``cache_aware`` routing.

        Raises:
            AttributeError: under another policy (it keeps none).
        """
        tree = getattr(self.policy, "tree", None)
        if tree is None:
            raise AttributeError(f"routing {self.policy.name} keeps no prefix tree")
        return tree

    async def start(self) -> None:
        """Open the shared ClientSession and start the health prober (in the server's loop)."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        # aiohttp undoes an answer's Content-Encoding (gzip, deflate; br, zstd with their
        # libraries) for every read of every route: each one parses what it reads, and what
        # the client gets is identity; none is asked for (no Accept-Encoding), some send one
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=self.timeout,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        await asyncio.gather(
            *(self.probe(u, mark_down=True, why="at start") for u in self.upstreams)
        )
        await asyncio.gather(*(self.detect(u) for u in self.upstreams))
        for u in self.upstreams:
            if u.cache_salt is False:
                logger.warning(
                    "upstream %s does not take cache_salt: tenants (keys with different "
                    "salts) share its prefix cache there — no isolation, and the prefix-cache "
                    "timing side channel between them stays open",
                    u.url,
                )
            elif u.auth_refused is not None:
                # an open proxy sending no key of its own forwards each client's: the probe's
                # 401 is expected there (info); a key of the gateway's refused is a fault
                forwarded = self.forwards_client_keys and not self._sends_key(u)
                logger.log(
                    logging.INFO if forwarded else logging.WARNING,
                    "upstream %s: %s (to GET /v1/models)%s; cannot tell whether it takes "
                    "cache_salt",
                    u.url,
                    u.last_error,
                    ""
                    if forwarded
                    else ": every request to it fails until the key is right "
                    "(--upstream-api-key, or the config's api_key_env / api_key_file)",
                )
            elif u.cache_salt is None:
                logger.info(
                    "upstream %s: cannot tell whether it takes cache_salt (no answer from "
                    "GET /v1/models); sending it, detecting again when it is healthy",
                    u.url,
                )
        if self.model_list is None:
            self._warn_split_models()
        self._probe_task = asyncio.create_task(self._probe_loop())

    def _warn_split_models(self) -> None:
        """Log what each upstream serves when they do not all serve the same models."""
        known = {u.url: u.models for u in self.upstreams if u.models is not None}
        if len({*known.values()}) > 1:
            logger.info(
                "upstreams serve different models; each request goes to a server of its model: %s",
                "; ".join(f"{url}: {', '.join(sorted(m)) or '-'}" for url, m in known.items()),
            )

    async def detect(self, up: Upstream) -> None:
        """Ask ``up`` what it is (``GET /v1/models``, 2 s) and note its model ids and cards.
        ``owned_by`` ``"prefixgate"`` on every card: it serves the prefix API
        (``prefix_api``); prefixgate and vLLM take ``cache_salt`` (set only under
        ``cache_salt="auto"``); another server that answers has neither; no answer leaves
        what was known. The models of a config's deployment are the config's."""
        assert self.session is not None
        if up.dialect != "openai":
            return  # a config's deployment: its models are the config's
        auth = self.gateway_credential(up)
        headers = {"User-Agent": HEALTH_CHECK_USER_AGENT}
        if auth:
            headers["Authorization"] = auth
        try:
            async with self.session.get(
                up.url + "/v1/models",
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=2.0),
                ssl=up.ssl,
            ) as resp:
                if resp.status in (401, 403):
                    up.auth_refused = resp.status
                    up.last_error = (
                        f"HTTP {resp.status}: refused the gateway's credentials"
                        if auth
                        else f"HTTP {resp.status}: needs a key, and the gateway sends none "
                        "of its own"
                        + (
                            " (clients' own keys are forwarded)"
                            if self.forwards_client_keys
                            else ""
                        )
                    )
                    return
                if resp.status != 200:
                    return
                up.auth_refused = None
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return
        cards = data.get("data") if isinstance(data, dict) else None
        cards = [c for c in cards or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
        owners = {c.get("owned_by") for c in cards}
        up.cards = {c["id"]: c for c in cards}
        if not up.names:
            models = frozenset(up.cards)
            if up.models is not None and models != up.models:
                logger.info(
                    "upstream %s now serves %s (was %s)",
                    up.url,
                    ", ".join(sorted(models)) or "no model",
                    ", ".join(sorted(up.models)) or "no model",
                )
            up.models = models
        up.prefix_api = owners == {"prefixgate"}
        if self.cache_salt_mode == "auto":
            up.cache_salt = bool(owners) and owners <= _SALTED_SERVERS

    def find(self, url: str) -> Upstream | None:
        """The upstream with base URL ``url`` (None when not in this pool)."""
        return next((u for u in self.upstreams if u.url == url), None)

    async def close(self) -> None:
        """Stop probing and close the session."""
        for task in list(self._suspects):
            task.cancel()
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
            self._probe_task = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def resolve(self, model: Any) -> str | None:
        """The public model name a request's ``model`` field routes by: an alias resolved
        (config), the name itself otherwise; None when it is not a string (any upstream
        may take it, and answers for it).

        Raises:
            APIError: 404 ``model_not_found`` when no upstream serves it and every upstream's
                models are known (a config's models always are); 400 under a config when it
                is missing or not a string.
        """
        if model == "":  # empty is absent, as local mode reads every field
            model = None
        if self.model_list is not None and not isinstance(model, str):
            raise bad_request(
                "model: must be the name of one of this gateway's models (GET /v1/models)",
                param="model",
            )
        if not isinstance(model, str):
            return None
        if self.model_list is not None:
            name = self.model_list.resolve(model)
            if name is None:
                raise _unknown_model(model, self.served_names())
            return name
        if not self.serving(model):
            raise _unknown_model(model, self.served_names())
        return model

    def served_names(self) -> list[str]:
        """The public model names clients may ask for: the config's names (then aliases), else
        every model the upstreams list, sorted."""
        if self.model_list is not None:
            return self.model_list.names()
        return sorted({m for u in self.upstreams for m in u.models or ()})

    def serving(self, model: str | None) -> list[Upstream]:
        """The upstreams that serve ``model`` (all of them for None): those listing it, else
        those whose models are unknown yet."""
        if model is None:
            return self.upstreams
        known = [u for u in self.upstreams if u.models is not None and model in u.models]
        return known or [u for u in self.upstreams if u.models is None]

    def fallbacks(self, model: str | None) -> list[str]:
        """The models a request for ``model`` falls back to, in order (config; none else)."""
        if model is None or self.model_list is None:
            return []
        return self.model_list.fallbacks(model)

    def route(self, body: Any, salt: str | None, model: str | None = None) -> Route:
        """What the policy needs of a chat or completions ``body`` in cache partition
        ``salt``, for public model ``model``."""
        return self.policy.route(body, salt, model)

    def pick(
        self,
        route: Route | bytes | None,
        exclude: Sequence[Upstream] = (),
        promised: str | None = None,
    ) -> Upstream | None:
        """The upstream for a request (None when none can take it) among those serving its
        model, healthy and not in ``exclude``, by the policy (see the module docstring);
        ``promised``: the URL of the upstream holding a promised place for it (a 429's
        promise, ``attempts``), the policy's only candidate while it is one of those with
        room, even while its 429 rests it (``limited_until``): its place is held."""
        if isinstance(route, bytes):
            route = Route(route, [])
        if route is not None:
            route.predicted = 0  # this pick's own prediction (a retry's upstream is another)
        pool = self.serving(route.model if route is not None else None)
        cands = [u for u in pool if u.healthy and u not in exclude]
        if not cands:
            return None
        now = time.monotonic()
        roomy = [u for u in cands if not u.max_in_flight or u.in_flight < u.max_in_flight]
        if not roomy:
            return None
        held = [u for u in roomy if u.url == promised] if promised is not None else []
        free = held or [u for u in roomy if u.limited_until <= now]
        choice = self.policy.pick(route, free or roomy)
        assert isinstance(choice, Upstream)
        return choice

    def learn(self, up: Upstream, route: Route | None, cached: int, prompt_tokens: int) -> None:
        """An answer from ``up`` said ``cached`` of its ``prompt_tokens`` were cached: the
        policy learns it (``cache_aware``'s tree; see ``RoutingPolicy.learn``)."""
        self.policy.learn(up, route, cached, prompt_tokens)

    def retry_after(self, model: str | None) -> float | None:
        """Seconds until the first of ``model``'s healthy upstreams is out of its 429 (None
        when none of them is rate limited)."""
        now = time.monotonic()
        waits = [
            u.limited_until - now
            for u in self.serving(model)
            if u.healthy and u.limited_until > now
        ]
        return min(waits) if waits else None

    def limit(self, up: Upstream, seconds: float) -> None:
        """``up`` answered 429 with ``Retry-After: seconds``: others serve until then."""
        up.limited_until = max(up.limited_until, time.monotonic() + seconds)
        up.last_error = f"HTTP 429, Retry-After {seconds:g} s"

    def exhausted(
        self, tried: Sequence[Upstream], failed: str, model: str | None = None
    ) -> APIError:
        """The error when ``pick`` finds no upstream left: 502 ``failed`` plus the last
        upstream's error when some were tried; 429 when every healthy upstream of ``model``
        is at its ``max_in_flight`` (Retry-After: the soonest an upstream is estimated to
        free a place, from its requests' ages against their recent hold time, ``SlotClock``;
        1 s before any hold time is measured); else 503 "no healthy upstream" with
        Retry-After of one probe interval (seconds)."""
        if tried:
            return APIError(502, f"{failed}: {tried[-1].last_error}", code="upstream_unavailable")
        healthy = [u for u in self.serving(model) if u.healthy]
        if healthy and all(u.max_in_flight and u.in_flight >= u.max_in_flight for u in healthy):
            return APIError(
                429,
                "every upstream of this model has its most requests in flight",
                code="upstream_busy",
                type="rate_limit_error",
                retry_after=min(u.slots.wait(u.in_flight + 1 - u.max_in_flight) for u in healthy),
            )
        return APIError(
            503,
            "no healthy upstream",
            code="upstream_unavailable",
            retry_after=self.health_interval_s,
        )

    def mark_failed(self, up: Upstream, why: str) -> None:
        """One gateway failure of ``up`` (a refused, reset or timed-out connection, a
        502/503/504, an answer cut or not in its shape): ``consecutive_failures`` in a row
        eject it, unless that would take more than ``max_ejection_percent`` of the pool out
        of rotation (``proxy.health``); a single one fails only its own request."""
        up.failures += 1
        up.last_error = why
        policy = self.health_policy
        if not up.health.failure(policy) or not up.healthy:
            if up.healthy:
                logger.warning(
                    "upstream %s: failure %d of %d in a row: %s",
                    up.url,
                    up.health.failures,
                    policy.consecutive_failures,
                    why,
                )
            return
        out = sum(1 for u in self.upstreams if not u.healthy) + 1
        if not policy.ejectable(out, len(self.upstreams)):
            logger.warning(
                "upstream %s: %d failures in a row (%s), not ejected: %d of %d upstreams "
                "would be out of rotation (max_ejection_percent %g); its health checks decide",
                up.url,
                up.health.failures,
                why,
                out,
                len(self.upstreams),
                policy.max_ejection_percent,
            )
            return
        seconds = up.health.eject(policy)
        logger.warning(
            "upstream %s ejected for %g s (ejection %d): %d failures in a row, the last: %s",
            up.url,
            seconds,
            up.health.ejections,
            up.health.failures,
            why,
        )

    def mark_bad_answer(self, up: Upstream, why: str) -> None:
        """``up`` answered, but not in the OpenAI shape: a gateway failure (``mark_failed``)."""
        self.mark_failed(up, why)

    def mark_ok(self, up: Upstream) -> None:
        """``up`` answered in the OpenAI shape: its failures in a row are cleared."""
        up.health.success()

    def suspect(self, up: Upstream, why: str) -> None:
        """One request to ``up`` timed out: check it now (one active check, counted as the
        periodic ones are); one slow request never ejects it by itself."""
        up.last_error = why
        if self.session is None or not up.healthy:
            return
        task = asyncio.ensure_future(self.probe(up))
        self._suspects.add(task)
        task.add_done_callback(self._suspects.discard)

    async def probe(self, up: Upstream, mark_down: bool = False, why: str = "") -> bool:
        """One active health check of ``up``: ``GET /health`` with the policy's
        ``timeout_s``; passes on an answer below 500 (an OpenAI-compatible server without
        ``/health`` answers 404: alive). Recorded on its health (``UpstreamHealth.checked``);
        ``mark_down`` (the check at start): a failure marks it down at once."""
        assert self.session is not None
        policy = self.health_policy
        try:
            async with self.session.get(
                up.url + "/health",
                headers={"User-Agent": HEALTH_CHECK_USER_AGENT},
                timeout=aiohttp.ClientTimeout(total=policy.timeout_s),
                ssl=up.ssl,
            ) as resp:
                ok = resp.status < 500  # alive (a server without /health answers 404)
                problem = f"GET /health: HTTP {resp.status}"
        except TimeoutError:
            ok, problem = False, f"GET /health: no answer in {policy.timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            ok, problem = False, f"GET /health: {type(exc).__name__}"
        change = up.health.checked(ok, policy)
        if not ok:
            up.last_error = (why + "; " if why else "") + problem
        if not ok and mark_down and not up.health.down:
            up.health.mark_down()
            change = "down"
        if change == "down":
            up.failures += 1
            # (info at start: a proxy started before its upstreams is common; /ready says it)
            log = logger.info if mark_down else logger.warning
            log("upstream %s down: %s", up.url, up.last_error)
        elif change == "back":
            logger.info("upstream %s back in rotation (half-open)", up.url)
            if up.models is None:
                await self.detect(up)
        return ok

    async def _probe_loop(self) -> None:
        """Every ``health_interval_s``: check every upstream whose ejection time is not
        running (``probe``), and every ``MODELS_EVERY`` rounds read the in-rotation ones'
        ``/v1/models`` (an upstream whose models change is followed)."""
        rounds = 0
        while True:
            await asyncio.sleep(self.health_interval_s)
            rounds += 1
            models = rounds % MODELS_EVERY == 0
            await asyncio.gather(
                *(self._check(u, models) for u in self.upstreams if u.health.due_check()),
                return_exceptions=True,
            )

    async def _check(self, up: Upstream, models: bool) -> None:
        if await self.probe(up) and models and up.healthy:
            await self.detect(up)

    def gateway_credential(self, up: Upstream) -> str | None:
        """The gateway's own ``Authorization`` value towards ``up`` (None: it has none for
        it): ``up``'s own (a config's credential, its URL's userinfo), else
        ``--upstream-api-key`` as Bearer, which is for the OpenAI-compatible upstreams (not
        an Anthropic deployment)."""
        if up.auth is not None:
            return up.auth
        return self._auth if up.dialect != "anthropic" else None

    def _sends_key(self, up: Upstream) -> bool:
        """Whether the gateway sends ``up`` a credential of its own."""
        return bool(self.gateway_credential(up))

    def auth_failed(self, up: Upstream) -> bool:
        """``up`` refused the gateway's credentials (or their absence: no key sent and no
        client's key forwarded) at its last ``GET /v1/models``: no request of the gateway's
        can succeed there, whatever its ``/health`` says."""
        return up.auth_refused is not None and (
            self._sends_key(up) or not self.forwards_client_keys
        )

    def describe(self) -> list[dict[str, Any]]:
        """Per-upstream state for ``/ready`` and logs: ``healthy`` false and ``state``
        ``"auth_failed"`` for an upstream that refuses the gateway's credentials
        (``auth_failed``; its requests are still sent, each answered 502
        ``upstream_auth_failed``)."""
        return [
            {
                "url": u.url,
                "healthy": u.healthy and not self.auth_failed(u),
                "state": "auth_failed" if self.auth_failed(u) else u.health.state(),
                "ejections": u.health.ejections,
                "ejected_s": round(max(0.0, u.health.ejected_until - time.monotonic()), 3)
                if u.health.ejected
                else 0.0,
                "in_flight": u.in_flight,
                "served": u.served,
                "failures": u.failures,
                "strikes": u.strikes,
                "last_error": u.last_error,
                "cache_salt": u.cache_salt,
                "cache_misses": u.cache_misses,
                "reports_cached_tokens": u.cached_tokens_reported,
                "prefix_api": u.prefix_api,
                "models": sorted(u.models) if u.models is not None else None,
                "rate_limited_s": round(max(0.0, u.limited_until - time.monotonic()), 3),
            }
            for u in self.upstreams
        ]


_SALTED_SERVERS = frozenset(("prefixgate", "vllm"))  # ``owned_by`` of servers taking cache_salt


def _unknown_model(model: str, served: list[str]) -> APIError:
    """404 ``model_not_found`` naming what is served, in local mode's words
    (``GatewayState.check_model``); at most 20 names, then how many more."""
    names = ", ".join(repr(m) for m in served[:20])
    if len(served) > 20:
        names += f" and {len(served) - 20} more (GET /v1/models)"
    serves = f"; this server serves {names}" if served else ""
    return not_found(
        f"the model {shown(model)} does not exist{serves}", param="model", code="model_not_found"
    )
