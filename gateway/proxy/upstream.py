"""Upstream mode: a pool of OpenAI-compatible servers and prefix-affinity routing among them.

Routing of one request (after SGLang's cache-aware router, adapted to rendezvous hashing):

1. Only healthy upstreams are candidates. An upstream becomes unhealthy after a connection
   failure, a connect timeout, a 502/503/504 answer or a 200 whose body is not the JSON it
   must be, or a failed probe (every upstream is probed at start, and after an idle
   timeout of one of its requests); a background task probes unhealthy ones
   (``GET /health``) every ``health_interval_s`` and puts them back on any answer below 500.
2. If the load is imbalanced — ``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min``, over in-flight requests (SGLang's defaults 64 and
   1.5) — the least loaded upstream is chosen.
3. Otherwise rendezvous (highest-random-weight) hashing of the prompt's affinity key picks the
   upstream (Thaler & Ravishankar 1998): score = xxh3_64(key, seed=upstream's seed), highest
   wins. The same system prompt goes to the same upstream, where its KV blocks are cached, and
   removing one upstream moves only the keys it owned.

The affinity key is the prompt's leading text in whole "blocks" of ``affinity_block_chars``
characters, at most ``affinity_max_chars``: the leading system/developer messages of a chat
(else its first message), or a completion's prompt. A key shorter than one block is used
whole. A request without one goes to the least loaded upstream.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Sequence
from typing import Any

import aiohttp
import xxhash
import yarl
from prefixgate.gateway.api.request_models import content_text
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.proxy.routing import PrefixTree, RoundRobin, check_policy

logger = logging.getLogger("prefixgate.gateway")


def normalize_url(url: str) -> str:
    """``http://host:port`` from ``http://host:port/``, ``.../v1`` or ``.../v1/``, without
    any ``user:password@`` (see ``split_credentials``): the URL that may be shown.

    Raises:
        ValueError: when the URL is not http(s)://[user[:password]@]host[:port][/v1].
    """
    return split_credentials(url)[0]


def split_credentials(url: str) -> tuple[str, str | None]:
    """``(normalized URL without userinfo, "Basic ..." Authorization value or None)``.

    Userinfo in an upstream URL (``http://user:pass@host``) is turned into an HTTP Basic
    ``Authorization`` header once, here (RFC 7617: base64 of ``user:password``, both
    percent-decoded), and never shown: ``/ready``, ``/metrics`` labels and logs use the URL
    without it.

    Raises:
        ValueError: when the URL is not http(s)://[user[:password]@]host[:port][/v1]
            (the message never repeats the password).
    """
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[:-3]
    try:
        parsed = yarl.URL(u)
        host = parsed.host
        port = parsed.explicit_port
    except ValueError:
        parsed, host, port = None, None, None
    if (
        parsed is None
        or parsed.scheme not in ("http", "https")
        or not host
        or parsed.path not in ("", "/")
        or parsed.query_string
        or parsed.fragment
    ):
        shown = url if "@" not in url else "<redacted>@" + url.rsplit("@", 1)[1]
        raise ValueError(f"upstream URL must look like http://host:port[/v1], got {shown!r}")
    auth = None
    if parsed.user is not None or parsed.password is not None:
        auth = aiohttp.BasicAuth(parsed.user or "", parsed.password or "").encode()
    bare = f"{parsed.scheme}://{parsed.raw_host if ':' not in host else '[' + host + ']'}"
    if port is not None:
        bare += f":{port}"
    return bare, auth


class Upstream:
    """One upstream server: its base URL (without userinfo), the ``Authorization`` value made
    of that userinfo (``auth``, None without), health and in-flight request count."""

    __slots__ = (
        "url",
        "auth",
        "seed",
        "healthy",
        "in_flight",
        "failures",
        "served",
        "last_error",
        "cache_salt",
        "cache_misses",
        "prefix_api",
        "models",
    )

    def __init__(self, url: str) -> None:
        self.url, self.auth = split_credentials(url)  # url: never holds a password
        self.seed = zlib.crc32(self.url.encode())
        self.healthy = True
        self.in_flight = 0
        self.failures = 0
        self.served = 0
        self.last_error = ""
        # Takes vLLM's ``cache_salt`` (isolates tenants' prefix caches): True / False, or None
        # while unknown (then it is sent: an upstream that refuses it fails loudly).
        self.cache_salt: bool | None = None
        self.cache_misses = 0  # answers that cached less than cache_aware routing predicted
        # Serves prefixgate's prefix API (``POST /v1/prefixes``): True / False, None while
        # unknown (then tried: a 404/405/501 answer says no).
        self.prefix_api: bool | None = None
        self.models: frozenset[str] | None = None  # its /v1/models ids, None while unknown

    def __repr__(self) -> str:
        state = "healthy" if self.healthy else "unhealthy"
        return f"Upstream({self.url}, {state}, in_flight={self.in_flight})"


def salted_affinity_key(key: bytes | None, salt: str | None) -> bytes | None:
    """The affinity key of a request in cache partition ``salt``: tenants that can never
    share cached blocks need not meet on one upstream (``None`` salt: the key unchanged)."""
    if key is None or salt is None:
        return key
    return salt.encode("utf-8", "surrogatepass") + b"\x00" + key


CACHE_SALT_MODES = ("auto", "on", "off")  # --upstream-cache-salt
CACHE_THRESHOLD = 0.5  # SGLang router's cache_threshold: the least match worth following


class Route:
    """What routing knows of one request: the rendezvous ``key`` (leading blocks of its
    system prompt) and the whole prompt's ``blocks`` (``routing.prompt_blocks``, salted)."""

    __slots__ = ("key", "blocks", "predicted")

    def __init__(self, key: bytes | None, blocks: list[int]) -> None:
        self.key = key
        self.blocks = blocks
        self.predicted = 0  # blocks the chosen upstream held by the tree (cache_aware)


def prompt_text(body: Any) -> str:
    """The whole prompt of a chat or completions body as text (messages as ``role: content``
    lines; a token-id prompt as its comma-joined ids)."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(
            f"{m.get('role')}: {content_text(m.get('content'))}\n"
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return ",".join(map(str, prompt))
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
            text = ",".join(map(str, prompt[: max_chars // 4]))
    if not text:
        return None
    n = min(len(text), max_chars)
    if n >= block_chars:
        n -= n % block_chars
    return text[:n].encode("utf-8", "surrogatepass")  # a lone surrogate is client text too


class UpstreamRouter:
    """Picks an upstream per request and keeps the pool's health (see the module docstring).

    Args:
        urls: base URLs of the upstreams.
        balance_abs_threshold, balance_rel_threshold: the imbalance rule (in-flight requests).
        health_interval_s: seconds between probes of unhealthy upstreams.
        connect_timeout_s: connect timeout of each upstream request.
        timeout_s: idle timeout of each upstream request — the longest wait for the answer's
            first byte and between two reads of it (aiohttp's ``sock_read``), never a total:
            a healthy long stream is never cut (0 = none).
        cache_salt: whether the upstreams take ``cache_salt`` (one of
            :data:`CACHE_SALT_MODES`, checked by ``GatewaySettings``): ``"auto"`` (detected from
            ``GET /v1/models``: ``owned_by`` ``"prefixgate"`` or ``"vllm"``, the servers known
            to isolate by it), ``"on"`` or ``"off"`` (all of them).
        auth: ``Authorization`` value for the detection request (``--upstream-api-key``);
            an upstream's own userinfo is used when it has one.
        policy: ``cache_aware``, ``rendezvous``, ``round_robin``, ``least_loaded`` or
            ``precise`` (``routing``; ``precise`` picks through ``self.precise``, a
            ``precise_routing.PreciseRouting``, and is ``cache_aware`` while that is None).

    Health: a refused or reset connection, a connect timeout or a 502/503/504 takes an
    upstream out of rotation (``mark_failed``); an idle timeout does not — one slow request
    says nothing of the server — it only asks for a probe (``suspect``), which decides.
    ``start`` probes every upstream before the first request, so ``/ready`` is true from
    the start (a dead upstream is out of rotation until a probe succeeds).

    Raises:
        ValueError: no URL, repeated URLs, or an unknown policy.
    """

    def __init__(
        self,
        urls: Sequence[str],
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        health_interval_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        timeout_s: float = 600.0,
        cache_salt: str = "auto",
        auth: str | None = None,
        policy: str = "cache_aware",
    ) -> None:
        if not urls:
            raise ValueError("upstream mode needs at least one upstream URL")
        self.policy = check_policy(policy)
        self.tree = PrefixTree()
        self._turn = RoundRobin()
        self.upstreams = [Upstream(u) for u in urls]
        if len({u.url for u in self.upstreams}) != len(self.upstreams):
            raise ValueError("upstream URLs must be distinct")
        self.cache_salt_mode = cache_salt
        if cache_salt != "auto":
            for u in self.upstreams:
                u.cache_salt = cache_salt == "on"
        self._auth = auth
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.health_interval_s = health_interval_s
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=timeout_s or None
        )
        self.timeout_s = timeout_s
        self.session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task | None = None
        self._suspects: set[asyncio.Task] = set()
        # policy "precise": a precise_routing.PreciseRouting, set by create_proxy_app
        self.precise: Any = None

    async def start(self) -> None:
        """Open the shared ClientSession and start the health prober (in the server's loop)."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=self.timeout,
            auto_decompress=False,
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
            elif u.cache_salt is None:
                logger.info(
                    "upstream %s: cannot tell whether it takes cache_salt (no answer from "
                    "GET /v1/models); sending it, detecting again when it is healthy",
                    u.url,
                )
        self._probe_task = asyncio.create_task(self._probe_loop())

    async def detect(self, up: Upstream) -> None:
        """Ask ``up`` what it is (``GET /v1/models``, 2 s) and note its model ids. ``owned_by``
        ``"prefixgate"`` on every card: it serves the prefix API (``prefix_api``); prefixgate
        and vLLM take ``cache_salt`` (set only under ``cache_salt="auto"``); another server
        that answers has neither; no answer leaves both unknown."""
        assert self.session is not None
        auth = up.auth or self._auth
        try:
            async with self.session.get(
                up.url + "/v1/models",
                headers={"Authorization": auth} if auth else None,
                timeout=aiohttp.ClientTimeout(total=2.0),
            ) as resp:
                if resp.status != 200:
                    return
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return
        cards = data.get("data") if isinstance(data, dict) else None
        cards = [c for c in cards or [] if isinstance(c, dict)]
        owners = {c.get("owned_by") for c in cards}
        up.models = frozenset(str(c.get("id")) for c in cards)
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

    def pick(
        self, route: Route | bytes | None, exclude: Sequence[Upstream] = ()
    ) -> Upstream | None:
        """The upstream for a request (None when none is healthy), by ``policy``."""
        if isinstance(route, bytes):
            route = Route(route, [])
        if route is not None:
            route.predicted = 0  # this pick's own prediction (a retry's upstream is another)
        cands = [u for u in self.upstreams if u.healthy and u not in exclude]
        if not cands:
            return None
        if self.policy == "precise" and self.precise is not None and route is not None:
            choice = self.precise.pick(route, cands, lambda: self._fallback(route, cands))
        elif len(cands) == 1:
            choice = cands[0]
        elif self.policy == "round_robin":
            choice = cands[self._turn.next() % len(cands)]
        else:
            start = self._turn.next() % len(cands)  # ties rotate
            least = min(cands[start:] + cands[:start], key=_load)
            if route is None or self.policy == "least_loaded":
                choice = least
            elif self.policy in _TREE_POLICIES and route.blocks:
                choice = self._cache_aware(route, cands, least)
            elif route.key is None:
                choice = least
            else:
                lo = least.in_flight
                hi = max(u.in_flight for u in cands)
                if hi - lo > self.abs_threshold and hi > self.rel_threshold * lo:
                    choice = least
                else:
                    key = route.key
                    choice = max(cands, key=lambda u: xxhash.xxh3_64_intdigest(key, seed=u.seed))
        if self.policy in _TREE_POLICIES and route is not None and route.blocks:
            self.tree.insert(route.blocks, choice.url)
        return choice

    def _fallback(self, route: Route, cands: list[Upstream]) -> Upstream:
        """``precise`` routing's fallback: ``cache_aware`` (the least loaded without blocks)."""
        if len(cands) == 1:
            return cands[0]
        start = self._turn.next() % len(cands)
        least = min(cands[start:] + cands[:start], key=_load)
        return self._cache_aware(route, cands, least) if route.blocks else least

    def _cache_aware(self, route: Route, cands: list[Upstream], least: Upstream) -> Upstream:
        depth = self.tree.match(route.blocks)
        best = max(depth.get(u.url, 0) for u in cands)
        if best < CACHE_THRESHOLD * len(route.blocks):
            # Nobody holds most of it (a shared opening is no reason to pile up): the least
            # loaded, then the emptiest.
            return min(cands, key=lambda u: (u.in_flight, self.tree.size.get(u.url, 0)))
        # The deepest match among the upstreams not overloaded (in flight within the threshold
        # of the least loaded): the holder when it can take it, else the next-best holder — a
        # hot prompt that spilled once spills to where it is cached already, not to a new
        # cold replica each time — else the least loaded.
        ok = [u for u in cands if u.in_flight - least.in_flight <= self.abs_threshold]
        choice = min(ok, key=lambda u: (-depth.get(u.url, 0), _load(u)))
        route.predicted = depth.get(choice.url, 0)
        return choice

    def learn(self, up: Upstream, route: Route | None, cached: int, prompt_tokens: int) -> None:
        """An answer from ``up`` said ``cached`` of its ``prompt_tokens`` were cached: the
        tree learns that ``up`` holds that share of the prompt's blocks (a retry's upstream,
        or blocks the tree had evicted), and counts a miss on ``up`` when it cached less than
        the tree predicted (it evicted them; the prompt is cached there again now)."""
        if self.precise is not None:
            self.precise.learn(up, route, cached, prompt_tokens)
        if route is None or not route.blocks or prompt_tokens <= 0:
            return
        held = int(len(route.blocks) * min(1.0, cached / prompt_tokens))
        if held:
            self.tree.insert(route.blocks[:held], up.url)
        if held < route.predicted:
            up.cache_misses += 1

    def exhausted(self, tried: Sequence[Upstream], failed: str) -> APIError:
        """The error when ``pick`` finds no upstream left: 502 ``failed`` plus the last
        upstream's error when some were tried, else 503 "no healthy upstream" with
        Retry-After of one probe interval (seconds)."""
        if tried:
            return APIError(502, f"{failed}: {tried[-1].last_error}", code="upstream_unavailable")
        return APIError(
            503,
            "no healthy upstream",
            code="upstream_unavailable",
            retry_after=self.health_interval_s,
        )

    def mark_failed(self, up: Upstream, why: str) -> None:
        """Take ``up`` out of rotation until a probe succeeds."""
        up.failures += 1
        up.last_error = why
        if up.healthy:
            # (info at start: a proxy started before its upstreams is common; /ready says it)
            log = logger.info if why.startswith("at start") else logger.warning
            log("upstream %s unhealthy: %s", up.url, why)
        up.healthy = False

    def suspect(self, up: Upstream, why: str) -> None:
        """One request to ``up`` timed out: probe it now; only a failed probe takes it out
        of rotation (one slow request must not empty the pool)."""
        up.last_error = why
        if self.session is None or not up.healthy:
            return
        task = asyncio.ensure_future(self.probe(up, mark_down=True, why=why))
        self._suspects.add(task)
        task.add_done_callback(self._suspects.discard)

    async def probe(self, up: Upstream, mark_down: bool = False, why: str = "") -> bool:
        """``GET /health`` on ``up`` (2 s timeout); marks it healthy on an answer below 500
        (an OpenAI-compatible server without ``/health`` answers 404: alive), and unhealthy
        on anything else when ``mark_down``."""
        assert self.session is not None
        try:
            async with self.session.get(
                up.url + "/health", timeout=aiohttp.ClientTimeout(total=2.0)
            ) as resp:
                ok = resp.status < 500  # alive (a server without /health answers 404)
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        if ok and not up.healthy:
            logger.info("upstream %s healthy again", up.url)
            up.healthy = True
            if up.models is None:
                await self.detect(up)
        elif not ok and mark_down:
            self.mark_failed(up, (why + "; " if why else "") + "GET /health failed")
        return ok

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            sick = [u for u in self.upstreams if not u.healthy]
            if sick:
                await asyncio.gather(*(self.probe(u) for u in sick), return_exceptions=True)

    def describe(self) -> list[dict[str, Any]]:
        """Per-upstream state for ``/ready`` and logs."""
        return [
            {
                "url": u.url,
                "healthy": u.healthy,
                "in_flight": u.in_flight,
                "served": u.served,
                "failures": u.failures,
                "last_error": u.last_error,
                "cache_salt": u.cache_salt,
                "cache_misses": u.cache_misses,
                "prefix_api": u.prefix_api,
            }
            for u in self.upstreams
        ]


_TREE_POLICIES = frozenset(("cache_aware", "precise"))  # keep the prefix tree (precise: fallback)
_SALTED_SERVERS = frozenset(("prefixgate", "vllm"))  # ``owned_by`` of servers taking cache_salt


def _load(u: Upstream) -> int:
    return u.in_flight
