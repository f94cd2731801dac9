"""``precise`` routing: score each upstream on the KV blocks its engine really holds.

The gateway tokenizes a request exactly as a prefixgate upstream will (the same model folder,
``--tokenizer``, loaded with ``engine.tokenizer``; chat through ``wire.prompts.render_chat``
with the messages and tools local mode passes; completions through ``completion_prompts``),
hashes it with the engines' own function (``block_hash.prompt_block_hashes`` via
``kv_index.prompt_block_keys`` for a prefixgate engine; vLLM's sha256 chain,
``vllm_block_hash.vllm_prompt_block_hashes``, for an upstream whose events show vLLM's
hashes: ``KVIndex.hash_scheme``) under the salt that upstream's engine will use, and asks the
exact index (``kv_index.KVIndex``, fed by each upstream engine's KV events) how many leading
blocks each upstream holds.

Salt: the body forwarded to upstream ``u`` carries ``cache_salt`` = the gateway's effective
salt when ``u`` takes it (``proxy.routes._Bodies``), else the client's own; the upstream then
composes ``keys.effective_salt(its key salt, cache_salt)``. Upstreams are taken to serve
without keys of their own (their key salt ``None``), as replicas behind a gateway do; an
upstream whose key has a salt hashes otherwise, and the agreement counter shows it.

Score (after NVIDIA Dynamo's KV router cost, in tokens; the lowest wins)::

    cost(u) = overlap_weight * (prompt - cached(u) + copied(u)) + pending_prefill(u)

``copied(u)``: the tokens another candidate holds beyond ``cached(u)`` (the most any
candidate caches, less ``cached(u)``): computing them again on ``u`` makes a copy that
displaces as many tokens of ``u``'s cache — other prompts' blocks, to be computed again by
their next request. Without it a holder with one cold prompt queued lost its hit to an idle
replica, and such copies cost the fleet more hits than they saved in queueing
(docs/precise-routing.md).
``cached(u)``: prompt tokens ``u`` serves from its cache: the index's match x block size, or
the blocks of requests in flight to ``u`` when those reach further (computed there before
their events arrive: a burst of one prefix is not spread by the event delay);
``pending_prefill(u)``: prompt tokens the requests in flight on ``u`` have to compute until
their answers begin, the prefill queued ahead of this one, less what this one shares of it.

Load (``load(u)``: requests in flight and their pending prefill) is the fleet's, not this
gateway's alone: each engine publishes load reports on its KV event stream
(``kv_events.EngineLoad``: running and waiting requests, queued prefill net of its cache),
so every gateway following it sees the same numbers; to the latest report are added this
gateway's requests sent since it arrived (their uncached tokens), and the result is never
less than this gateway's own (``Upstream.in_flight``; the uncached tokens of its requests
not yet ``started``: a stream's headers come with its first token). Engines without
reports: this gateway's own. The bound on imbalance is judged per request: ``u`` is a
candidate only when its requests with this one stay within ``max_load_ratio`` times the
mean with this one, ``load(u) + 1 <= max(X * m, m + 1, 2)`` with ``m = (sum + 1) / n``
(the ``m + 1``: requests are whole, so one above the mean is allowed while X times it is
less — two requests of one prompt on an idle pool of two stay together; the ``2``: on a pool
mostly idle, a mean below one, a replica may take a second request — on three replicas with
one request in flight, ``m + 1`` = 1.67 sent every request of the busy replica's prompts to a
cold one, a whole prefill and a copy to save waiting beside one request), or it is the least
loaded (always a candidate). The bound alone never turns a hit into a copy: when every
upstream holding the most of the prompt is over it, those holders stay candidates and the
cost decides (their queued prefill against a copy's tokens). Without that, a burst at round
robin's capacity sent requests cold to replicas under the bound (docs/precise-routing.md).

The share bound: a candidate whose share of this gateway's last ``SHARE_WINDOW x n`` picks,
with this one, would exceed ``max_load_ratio`` times the mean share is left out too for the
request of its hottest prompt in that window (``Route.key``; the one with the fewest recent
picks stays). The in-flight bound is instantaneous: at a light load (a replica mostly idle
between requests) it never acts, and a replica homing the most popular prompts served well
over the mean (docs/precise-routing.md); the share bound sends the hot prompt's next
request to another replica, which computes it once and holds a copy, after which the cost
spreads the prompt over its holders. Only the hottest prompt moves: leaving the replica out
for every prompt made a copy of each prompt that came while it was over
(docs/precise-routing.md). A continuation does not move: a candidate caching more tokens of
the prompt than the shortest prompt of its key seen has (``Route.key``; more than a whole
prompt of the key: a session's next turn, cached with its history) holds the request's own
history, which no other request shares: moving it copies that whole history and spreads
nothing of the shared prompt (docs/sim.md). A fresh request of the key (cached up to its
shared prefix, at most its shortest prompt) still moves, even when a request of the key
was the shared prefix alone. With two gateways behind a
round-robin client each bounds its own half of the traffic, and so the sum.

A prompt no candidate holds (cold, or evicted everywhere) goes to its home: the upstream its
leading text (``Route.key``: the system prompt, salted) was first placed on, a candidate
homing the fewest prompts (ties by rendezvous hashing). Each prefix then has one copy and the
fleet's distinct prefixes spread evenly — as many as its KV holds — instead of copies wherever
the queue was shortest. A home over the bound right now stays the home (this request goes to
the candidate homing the fewest); only a home that is no longer a candidate is replaced.

Session affinity: a request with ``prompt_cache_key`` (else ``user``) goes where the previous
request of that session within its cache partition (effective salt) went, while that upstream
is a candidate and still holds the session's pins: the first block of the session's last
prompt (by the index), or a request of the session is still in flight there. When the pins
are gone the session is forgotten (no fixed lifetime).

Fallback to ``cache_aware`` (``policies.precise.Precise`` is a ``CacheAware``), counted by reason: the request
could not be tokenized (the upstream will answer its own error), or a candidate has no event
feed (``--upstream-kv-events``) or its feed is not synced (before its snapshot, or while a gap
is being resynced), or its hashes are not reproducible here (``unknown_hash``: a vLLM with
another hash algorithm or ``PYTHONHASHSEED``). A completions batch (several prompts) is
routed on its first prompt and not predicted.

Visible: per request the predicted cached tokens beside the upstream's reported
``cached_tokens`` (the access log's ``predicted=`` and ``cached=``), and in ``/metrics``:
``prefixgate_route_predicted_cached_tokens`` / ``_reported_cached_tokens`` (sums, per upstream),
``prefixgate_route_predictions{result=exact|over|under}``, ``prefixgate_route_decisions{reason}``
and the index's state per replica (``prefixgate_kv_index_*``: synced, blocks, lag, gaps,
resyncs, replays, snapshots, restarts, failures, load reports; and the latest report's
requests, queued prefill tokens and KV usage, ``prefixgate_kv_index_load_*``).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from prefixgate.engine.block_hash import block_key_bytes, num_reusable_blocks
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.proxy.kv_index import (
    HASH_PREFIXGATE,
    HASH_UNKNOWN,
    HASH_VLLM_BYTES,
    HASH_VLLM_INT,
    BlockHash,
    KVIndex,
    parse_kv_events_spec,
    prompt_block_keys,
)
from prefixgate.gateway.proxy.metrics_load import published_requests
from prefixgate.gateway.proxy.policies.base import Candidate
from prefixgate.gateway.proxy.policies.prompt import Route
from prefixgate.gateway.proxy.urls import normalize_url
from prefixgate.gateway.proxy.vllm_block_hash import vllm_prompt_block_hashes
from prefixgate.gateway.tenancy.keys import effective_salt
from prefixgate.gateway.wire.prompts import completion_prompts, render_chat
from prefixgate.gateway.wire.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from prefixgate.gateway.wire.tools import plan_tools, template_messages
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = [
    "DEFAULT_MAX_LOAD_RATIO",
    "PreciseRoute",
    "PreciseRouting",
    "parse_kv_events_spec",
]

logger = logging.getLogger("prefixgate.gateway")

DEFAULT_MAX_LOAD_RATIO = 1.3  # X: no upstream above X x the mean in-flight load
MAX_SESSIONS = 65_536  # session pins remembered (least recently used forgotten beyond)
MAX_PROMPT_CHARS = 1 << 21  # a longer body is routed without tokenizing (cache_aware)
SHARE_WINDOW = 16  # picks per upstream in the window of the share bound


class PreciseRoute(Route):
    """A ``Route`` with what ``precise`` routing learns of the request (see the module
    docstring): its token ids and salts, and the prediction for the chosen upstream."""

    __slots__ = (
        "token_ids",
        "salt",
        "client_salt",
        "session",
        "predicted_cached",
        "reported_cached",
        "reason",
        "batch",
        "_keys",
        "_charge",
        "_sent",
    )

    def __init__(self, key: bytes | None, blocks: list[int], model: str | None = None) -> None:
        super().__init__(key, blocks, model)
        self.token_ids: list[int] | None = None  # None: not tokenized (fallback)
        self.salt: str | None = None  # the gateway's effective salt
        self.client_salt: str | None = None  # the body's own cache_salt
        self.session: tuple[str | None, str] | None = None
        self.predicted_cached: int | None = None  # for the chosen upstream, None: unknown
        self.reported_cached: int | None = None
        self.reason = ""
        self.batch = False  # a completions batch: routed on its first prompt, not predicted
        self._keys: dict[tuple[str | None, int, str], list[BlockHash]] = {}
        self._charge: tuple[str, int, list[BlockHash]] | None = None  # (url, uncached, keys)
        self._sent = 0.0  # time.monotonic() of the pick

    def engine_salt(self, up: Candidate, scheme: str | None = HASH_PREFIXGATE) -> str | None:
        """The cache salt ``up``'s engine hashes this request under (an open upstream): a
        prefixgate engine composes ``effective_salt(None, cache_salt)``; a vLLM engine
        (``scheme`` a vLLM one) takes the forwarded ``cache_salt`` as it is."""
        takes = getattr(up, "cache_salt", None)  # Upstream.cache_salt: False, it ignores it
        forwarded = self.client_salt if takes is False or self.salt is None else self.salt
        if scheme in (HASH_VLLM_INT, HASH_VLLM_BYTES):
            return forwarded
        return effective_salt(None, forwarded)

    def prime_keys(self, salt: str | None, block_size: int, hashes: Sequence[int]) -> None:
        """Hand ``keys(salt, block_size)`` (prefixgate's scheme) the prompt's block keys
        hashed already (``prefixgate sim`` hashes each prompt once for routing and engine).

        Args:
            salt, block_size: as for ``keys``.
            hashes: ``block_hash.prompt_block_hashes(token_ids, block_size, salt)``, or at
                least its first ``num_reusable_blocks`` keys.

        Raises:
            ValueError: fewer keys than the prompt's reusable blocks.
        """
        assert self.token_ids is not None
        n = num_reusable_blocks(len(self.token_ids), block_size)
        if len(hashes) < n:
            raise ValueError(f"{len(hashes)} block keys for a prompt of {n} reusable blocks")
        self._keys[(salt, block_size, HASH_PREFIXGATE)] = [block_key_bytes(k) for k in hashes[:n]]

    def keys(
        self, salt: str | None, block_size: int, scheme: str | None = HASH_PREFIXGATE
    ) -> list[BlockHash]:
        """The reusable block keys of the prompt under ``salt``, hashed as the engine of
        ``scheme`` (``KVIndex.hash_scheme``; ``None``: prefixgate's) publishes them (computed
        once per triple)."""
        assert self.token_ids is not None
        vllm = scheme in (HASH_VLLM_INT, HASH_VLLM_BYTES)
        form: str = scheme if scheme is not None and vllm else HASH_PREFIXGATE
        got = self._keys.get((salt, block_size, form))
        if got is None:
            if vllm:
                n = num_reusable_blocks(len(self.token_ids), block_size)
                got = vllm_prompt_block_hashes(
                    self.token_ids[: n * block_size],
                    block_size,
                    salt,
                    as_int=scheme == HASH_VLLM_INT,
                )
            else:
                got = list(prompt_block_keys(self.token_ids, block_size, salt))
            self._keys[(salt, block_size, form)] = got
        return got


@dataclass(slots=True)
class _Session:
    url: str
    first_key: BlockHash | None
    in_flight: int = 0


class PreciseRouting:
    """The ``precise`` policy (module docstring): ``prepare`` (tokenize, in the handler),
    ``pick`` (score the candidates), ``learn`` (the answer's cached tokens), ``release``
    (the request left its upstream).

    Args:
        tokenizer: the upstreams' tokenizer (``engine.tokenizer.Tokenizer``, or anything
            with its ``encode_chat`` / ``encode_batch`` / ``min_num_tokens`` / ``vocab_size``).
        feeds: upstream URL → ``(PUB endpoint, replay endpoint or None)`` of its engine's KV
            events; upstreams without one make ``pick`` fall back.
        max_load_ratio: X of the imbalance bound (>= 1).
        overlap_weight: weight of prefill tokens against active tokens (> 0).
        index: an index to use instead of one built on ``feeds`` (tests); its replica names
            are upstream URLs.

    Raises:
        ValueError: ``max_load_ratio`` < 1 or ``overlap_weight`` <= 0.
    """

    def __init__(
        self,
        tokenizer: Any,
        feeds: Mapping[str, tuple[str, str | None]],
        max_load_ratio: float = DEFAULT_MAX_LOAD_RATIO,
        overlap_weight: float = 1.0,
        index: KVIndex | None = None,
        probe_interval_s: float = 5.0,
    ) -> None:
        if not max_load_ratio >= 1.0:
            raise ValueError(f"max_load_ratio must be >= 1, got {max_load_ratio}")
        if not overlap_weight > 0:
            raise ValueError(f"overlap_weight must be > 0, got {overlap_weight}")
        self.tokenizer = tokenizer
        self.max_load_ratio = float(max_load_ratio)
        self.overlap_weight = float(overlap_weight)
        self.feeds = {normalize_url(u): f for u, f in feeds.items()}
        self.index = (
            index
            if index is not None
            else KVIndex(dict(self.feeds), probe_interval_s=probe_interval_s, start=False)
        )
        self._sessions: OrderedDict[tuple[str | None, str], _Session] = OrderedDict()
        self._pending: Counter[str] = Counter()  # url -> uncached prompt tokens in flight
        self._flying: dict[str, dict[int, PreciseRoute]] = {}  # url -> id -> route charged
        # url -> block keys of the requests in flight there (stored soon, not yet published)
        self._inflight_keys: dict[str, Counter[BlockHash]] = {}
        self._turn = itertools.count()
        # the upstreams of the last picks (the share bound: SHARE_WINDOW per upstream fed)
        self._recent: deque[tuple[str, bytes | None]] = deque(  # (url, prompt key)
            maxlen=SHARE_WINDOW * max(1, len(self.feeds))
        )
        self._recent_count: Counter[str] = Counter()  # url -> its picks in _recent
        self._recent_keys: dict[str, Counter[bytes | None]] = {}  # url -> prompt key -> picks
        self._homes: OrderedDict[bytes, str] = OrderedDict()  # prompt key -> its home upstream
        # prompt key -> the fewest prompt tokens of a request of that key seen (share bound)
        self._shortest: OrderedDict[bytes, int] = OrderedDict()
        self._home_count: Counter[str] = Counter()  # upstream -> prompts homed there
        self.decisions: Counter[str] = Counter()
        self.predictions: Counter[tuple[str, str]] = Counter()  # (url, exact|over|under)
        self.predicted_tokens: Counter[str] = Counter()
        self.reported_tokens: Counter[str] = Counter()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start following the feeds (the index's consumer thread)."""
        self.index.start()

    def close(self) -> None:
        """Stop the index (its sockets closed)."""
        self.index.close()

    # ---- per request -------------------------------------------------------------------------
    async def prepare(
        self, base: Route, body: dict[str, Any], path: str, salt: str | None
    ) -> PreciseRoute:
        """``base`` (the request's ``Route``) as a ``PreciseRoute`` with the prompt's token
        ids, tokenized as the upstream will; a body that does not tokenize (the upstream
        answers its own error) stays untokenized and is routed by the fallback. Never raises
        for the request's content.

        Args:
            base: the rendezvous key, text blocks and model (``UpstreamRouter.route``).
            body: the parsed request body (a prefix's messages already in front).
            path: the route (``/v1/chat/completions`` or ``/v1/completions``).
            salt: the gateway's effective cache salt of the request.
        """
        route = PreciseRoute(base.key, base.blocks, base.model)
        route.salt = salt
        cs = body.get("cache_salt")
        route.client_salt = cs if isinstance(cs, str) else None
        session = body.get("prompt_cache_key") or body.get("user")
        if isinstance(session, str) and session:
            kind = "prompt_cache_key" if body.get("prompt_cache_key") else "user"
            route.session = (salt, f"{kind}:{session}")
        try:
            raw = json.dumps(body).encode()
            if len(raw) > MAX_PROMPT_CHARS:
                return route
            if path.endswith("/chat/completions"):
                req = parse(ChatCompletionRequest, raw)
                plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, "hermes")
                route.token_ids = await render_chat(
                    self.tokenizer, template_messages(req.messages), tools=plan.tools or None
                )
            else:
                creq = parse(CompletionRequest, raw)
                prompts = await completion_prompts(self.tokenizer, creq.prompt)
                route.token_ids = prompts[0]
                route.batch = len(prompts) > 1
        except (APIError, ValueError, TypeError, RecursionError) as exc:
            logger.debug("precise routing: request not tokenized (%s)", exc)
            route.token_ids = None
        return route

    def pick(
        self,
        route: Route,
        cands: Sequence[Candidate],
        fallback: Callable[[], Candidate],
    ) -> Candidate:
        """The upstream for ``route`` among healthy ``cands`` (two or more); ``fallback``
        (cache_aware) when the request is not tokenized or a candidate's feed is missing or
        not synced. Notes the prediction for the chosen upstream on the route."""
        if not isinstance(route, PreciseRoute):
            return fallback()
        self.release(route)  # a retry: the previous upstream's charge goes
        route.predicted_cached = None
        if route.token_ids is None:
            return self._fallback(route, "untokenized", fallback)
        ready = self.index.readiness()  # url -> (synced, hash scheme, block size)
        if any(u.url not in ready for u in cands):
            return self._fallback(route, "no_feed", fallback)
        if not all(ready[u.url][0] for u in cands):
            return self._fallback(route, "not_synced", fallback)
        if any(ready[u.url][1] == HASH_UNKNOWN for u in cands):
            return self._fallback(route, "unknown_hash", fallback)
        # one index walk per distinct key list (every upstream of one hash scheme and salt
        # shares it), not one per candidate: O(blocks) per pick, not O(blocks x upstreams)
        found = self._match_all(route, cands, ready)
        cached = {url: n for url, (n, _) in found.items()}
        loads = {u.url: self.load(u) for u in cands}
        busy = {url: reqs for url, (reqs, _) in loads.items()}
        n = len(cands)
        prompt = len(route.token_ids)
        total = sum(busy.values())
        least = min(busy.values())
        mean = (total + 1) / n  # with this request
        bound = max(self.max_load_ratio * mean, mean + 1, 2)
        ok = [u for u in cands if busy[u.url] + 1 <= bound or busy[u.url] == least]
        held = max(cached.values())  # the most any upstream already holds
        if held and not any(cached[u.url] == held for u in ok):
            # the bound never turns a hit into a copy by itself: the holders over it stay
            # candidates and the cost (their queued prefill against a copy's) decides
            ok += [u for u in cands if cached[u.url] == held]
        ok = self._within_share(ok, n, route.key, self._continued(route.key, prompt, cached))
        choice: Candidate | None = None
        reason = "score"
        sess = self._session(route)
        if sess is not None:
            choice = next((u for u in ok if u.url == sess.url), None)
            reason = "affinity" if choice is not None else reason
        if choice is None and route.key is not None and not any(cached[u.url] for u in ok):
            choice, reason = self._place(route.key, ok, cands), "placed"
        if choice is None:
            start = next(self._turn) % n  # ties rotate
            order = list(ok[start % len(ok) :]) + list(ok[: start % len(ok)])
            w = self.overlap_weight

            def cost(u: Candidate) -> tuple[float, int]:
                # the in-flight prefill this request shares is work it need not wait twice for
                pending = max(0, loads[u.url][1] - found[u.url][1])
                # tokens held elsewhere but computed again here are a copy: they displace as
                # many tokens of u's cache (other prompts' blocks, refilled later)
                copy = held - cached[u.url]
                return (w * (prompt - cached[u.url] + copy) + pending, busy[u.url])

            choice = min(order, key=cost)
        self.decisions[reason] += 1
        route.reason = reason
        recent = self._recent
        if len(recent) == recent.maxlen:  # the oldest pick leaves the window
            url, key = recent[0]
            self._recent_count[url] -= 1
            keys = self._recent_keys[url]
            keys[key] -= 1
            if not keys[key]:
                del keys[key]
        recent.append((choice.url, route.key))
        self._recent_count[choice.url] += 1
        self._recent_keys.setdefault(choice.url, Counter())[route.key] += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "precise pick %s reason=%s prompt=%d cached=%s pending=%s load=%s ok=%s",
                choice.url,
                reason,
                prompt,
                {u.url: cached[u.url] for u in cands},
                {u.url: loads[u.url][1] for u in cands},
                busy,
                [u.url for u in ok],
            )
        self._note(route, choice, cached[choice.url])
        return choice

    def _continued(
        self, key: bytes | None, prompt: int, cached: Mapping[str, int]
    ) -> frozenset[str]:
        """The upstreams holding this request as a continuation (module docstring): those
        caching more tokens than the shortest prompt of ``key`` seen has, this one
        (``prompt`` tokens) included; the record of ``key`` is updated first. ``cached``:
        upstream URL -> prompt tokens it serves from its cache. Empty without a key."""
        if key is None:
            return frozenset()
        shortest = min(self._shortest.get(key, prompt), prompt)
        self._shortest[key] = shortest
        self._shortest.move_to_end(key)
        while len(self._shortest) > MAX_SESSIONS:
            self._shortest.popitem(last=False)
        return frozenset(url for url, n in cached.items() if n > shortest)

    def _within_share(
        self,
        ok: list[Candidate],
        n: int,
        key: bytes | None,
        continued: frozenset[str] = frozenset(),
    ) -> list[Candidate]:
        """``ok`` less the upstreams whose share of this gateway's last ``SHARE_WINDOW x n``
        picks, with this one, would exceed ``max_load_ratio`` times the mean share (``share(u)
        + 1 <= max(X * m, m + 1)``, ``m = (window + 1) / n``) when this request's prompt
        (``key``) is the one ``u`` took most often in the window: the hottest prompt moves
        (one copy), the others stay where they are cached. The one with the fewest recent
        picks always stays, and so do the upstreams in ``continued`` (``_continued``: they
        hold the request's own history). Judged once the window is half full (a mean share
        of ``SHARE_WINDOW / 2`` picks: a gateway's first picks are the warm-up of its
        prompts' homes, and over a few picks the bound is within the noise)."""
        recent = self._recent
        if 2 * len(recent) < SHARE_WINDOW * n or len(ok) < 2:
            return ok
        counts = self._recent_count  # Counter(url for url, _ in recent), kept as it goes
        m = (len(recent) + 1) / n
        bound = max(self.max_load_ratio * m, m + 1)
        fewest = min(counts[u.url] for u in ok)
        over = {u.url for u in ok if counts[u.url] + 1 > bound and counts[u.url] != fewest}
        if not over:
            return ok
        keys = self._recent_keys  # each url's picks in the window by prompt key
        out = []
        for u in ok:
            if u.url in over and u.url not in continued:
                top = max(keys[u.url].values())
                if keys[u.url][key] == top:  # this prompt is u's hottest: it moves
                    continue
            out.append(u)
        return out

    def load(self, up: Candidate) -> tuple[int, int]:
        """``(requests, prefill tokens)`` in flight on ``up`` from every client of its
        engine, not only this gateway's: the engine's latest load report (its running and
        waiting requests and its queued prefill net of its cache, the same in every gateway
        following its events) plus this gateway's requests sent to ``up`` since that report
        arrived (not in it yet) and their uncached tokens; never less than this gateway's
        own (``up.in_flight`` and the uncached tokens of its requests not yet started: a
        request sent just before the report may not have reached the engine). Without a
        report (the engine publishes none, or none yet): this gateway's own, its requests
        raised to the engine's running + waiting from its ``/metrics`` when fresh
        (``metrics_load``)."""
        own = (up.in_flight, max(0, self._pending[up.url]))
        got = self.index.load(up.url)
        if got is None:  # no load reports (vLLM): its /metrics' requests, when more
            published = published_requests(up)
            return (own[0] if published is None else max(own[0], published)), own[1]
        report, at = got
        reqs = report.num_running + report.num_waiting
        tokens = report.queued_prefill_tokens
        # the routes charged to up, in the order they were sent (each is put in at its pick,
        # after its last charge went): the latest first, down to the first sent by ``at``
        for r in reversed(self._flying.get(up.url, {}).values()):
            if r._sent <= at:
                break
            if r._charge is not None:
                reqs += 1
                tokens += r._charge[1]
        return max(reqs, own[0]), max(tokens, own[1])

    def _place(self, key: bytes, ok: Sequence[Candidate], cands: Sequence[Candidate]) -> Candidate:
        """The home of a prompt no candidate under the bound holds (its leading text
        ``key``): its home when that is in ``ok``, else the candidate homing the fewest
        prompts (ties: rendezvous hashing), which becomes its home — so the fleet's distinct
        prefixes are spread evenly and each has one copy, as many as the fleet's KV holds.
        A home that is still a candidate (healthy, serving the model) but over the bound
        right now stays the home: this request goes to the ``ok`` one homing the fewest, and
        the prompt's later requests go home again once its load is back under the bound."""
        home = self._homes.get(key)
        if home is not None:
            self._homes.move_to_end(key)
            for u in ok:
                if u.url == home:
                    return u
            if any(u.url == home for u in cands):  # only busy: no new home
                return min(
                    ok,
                    key=lambda u: (
                        self._home_count[u.url],
                        -xxhash.xxh3_64_intdigest(key, seed=u.seed),
                    ),
                )
            self._home_count[home] -= 1
        choice = min(
            ok,
            key=lambda u: (self._home_count[u.url], -xxhash.xxh3_64_intdigest(key, seed=u.seed)),
        )
        self._homes[key] = choice.url
        self._home_count[choice.url] += 1
        while len(self._homes) > MAX_SESSIONS:
            _, gone = self._homes.popitem(last=False)
            self._home_count[gone] -= 1
        return choice

    def _fallback(
        self, route: PreciseRoute, why: str, fallback: Callable[[], Candidate]
    ) -> Candidate:
        self.decisions["fallback_" + why] += 1
        route.reason = "fallback_" + why
        choice = fallback()
        if route.token_ids is not None:
            st = self.index.stats()["replicas"].get(choice.url)
            if st is not None and st["synced"]:
                self._note(route, choice, self._cached(route, choice))
                return choice
        self._note(route, choice, None)
        return choice

    def _cached(self, route: PreciseRoute, up: Candidate) -> int:
        return self._match(route, up)[0]

    def _match(
        self, route: PreciseRoute, up: Candidate, walks: dict[int, dict[str, int]] | None = None
    ) -> tuple[int, int]:
        """Prompt tokens ``up``'s engine will serve from its cache: the leading blocks the
        index says it holds, or, when longer, those of requests in flight there (their
        blocks are stored as they are computed, before their events arrive). Returns
        ``(cached tokens, of which only in flight)``. ``walks``: the index's answers for
        the key lists already matched in this pick (by ``id``; ``route.keys`` returns the
        same list for the same salt, block size and scheme), filled in here."""
        bs = self._block_size(up.url)
        if bs <= 0:  # no block stored anywhere yet: nothing cached
            return 0, 0
        scheme = self.index.hash_scheme(up.url)
        keys = route.keys(route.engine_salt(up, scheme), bs, scheme)
        walk = walks.get(id(keys)) if walks is not None else None
        if walk is None:
            walk = self.index.match(keys)
            if walks is not None:
                walks[id(keys)] = walk
        return self._held(up.url, keys, walk, bs)

    def _held(
        self, url: str, keys: list[BlockHash], walk: Mapping[str, int], bs: int
    ) -> tuple[int, int]:
        """``url``'s cached tokens of the prompt (``keys``, ``bs`` tokens a block): the
        longest of its run in the index (``walk``) and its run in flight (sent there, not yet
        reported), and the tokens of the in-flight run past the index's."""
        n = walk.get(url, 0)
        flying = self._inflight_keys.get(url)
        m = 0
        if flying:
            while m < len(keys) and keys[m] in flying:
                m += 1
        return max(n, m) * bs, max(0, m - n) * bs

    def _match_all(
        self,
        route: PreciseRoute,
        cands: Sequence[Candidate],
        ready: Mapping[str, tuple[bool, str | None, int]],
    ) -> dict[str, tuple[int, int]]:
        """``_match`` of every candidate (``ready``: ``KVIndex.readiness()``), with the key
        list and its index walk looked up once per block size, hash scheme and salt taken
        (``Candidate.cache_salt``): the same answers, O(blocks) per pick."""
        any_bs = max((ready[u][2] for u in self.feeds if u in ready), default=0)
        seen: dict[tuple[int, str | None, Any], tuple[list[BlockHash], dict[str, int]]] = {}
        walks: dict[int, dict[str, int]] = {}
        out: dict[str, tuple[int, int]] = {}
        for u in cands:
            _, scheme, bs = ready[u.url]
            bs = bs or any_bs  # _block_size
            if bs <= 0:  # no block stored anywhere yet: nothing cached
                out[u.url] = (0, 0)
                continue
            form = (bs, scheme, getattr(u, "cache_salt", None) is False)  # engine_salt reads
            got = seen.get(form)
            if got is None:
                keys = route.keys(route.engine_salt(u, scheme), bs, scheme)
                walk = walks.get(id(keys))
                if walk is None:
                    walk = walks[id(keys)] = self.index.match(keys)
                got = seen[form] = (keys, walk)
            keys, walk = got
            out[u.url] = self._held(u.url, keys, walk, bs)
        return out

    def _block_size(self, url: str) -> int:
        """``url``'s block size by its events, else another feed's (0 before any)."""
        bs = self.index.block_size(url)
        if bs <= 0:
            bs = max((self.index.block_size(u) for u in self.feeds), default=0)
        return bs

    def _note(self, route: PreciseRoute, up: Candidate, cached: int | None) -> None:
        """Charge ``up`` with the request's load and remember the session's pin."""
        if route.batch:
            cached = None  # several prompts: not predicted
        route.predicted_cached = cached
        if route.token_ids is not None:
            uncached = len(route.token_ids) - (cached or 0)
            bs = self._block_size(up.url)
            scheme = self.index.hash_scheme(up.url)
            keys = route.keys(route.engine_salt(up, scheme), bs, scheme) if bs > 0 else []
            route._charge = (up.url, uncached, keys)
            route._sent = time.monotonic()
            self._flying.setdefault(up.url, {})[id(route)] = route
            self._pending[up.url] += uncached
            self._inflight_keys.setdefault(up.url, Counter()).update(keys)
        if route.session is not None:
            first = None
            if route.token_ids is not None:
                bs = self._block_size(up.url)
                scheme = self.index.hash_scheme(up.url)
                keys = route.keys(route.engine_salt(up, scheme), bs, scheme) if bs else []
                first = keys[0] if keys else None
            sess = self._sessions.get(route.session)
            if sess is None or sess.url != up.url:
                sess = _Session(up.url, first)
                self._sessions[route.session] = sess
            elif first is not None:
                sess.first_key = first
            sess.in_flight += 1
            self._sessions.move_to_end(route.session)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def _session(self, route: PreciseRoute) -> _Session | None:
        """The route's session pin while it holds (module docstring), else None (forgotten)."""
        if route.session is None:
            return None
        sess = self._sessions.get(route.session)
        if sess is None:
            return None
        if sess.in_flight > 0:
            return sess
        if sess.first_key is not None and self.index.match([sess.first_key]).get(sess.url, 0):
            return sess
        del self._sessions[route.session]  # its pins are gone
        return None

    def started(self, route: Route | None) -> None:
        """The upstream's answer began (a stream's headers come with its first token): the
        request's prefill is done, its pending prefill charge goes."""
        if not isinstance(route, PreciseRoute) or route._charge is None:
            return
        url, uncached, keys = route._charge
        self._pending[url] -= uncached
        route._charge = (url, 0, keys)

    def release(self, route: Route | None) -> None:
        """The request left its upstream (answered, failed, or retried elsewhere): its load
        charge goes."""
        if not isinstance(route, PreciseRoute) or route._charge is None:
            return
        url, uncached, keys = route._charge
        route._charge = None
        self._pending[url] -= uncached
        self._flying.get(url, {}).pop(id(route), None)
        held = self._inflight_keys.get(url)
        if held is not None:
            held.subtract(keys)
            for k in keys:
                if k in held and held[k] <= 0:
                    del held[k]
        if route.session is not None:
            sess = self._sessions.get(route.session)
            if sess is not None and sess.url == url and sess.in_flight > 0:
                sess.in_flight -= 1

    def learn(self, up: Candidate, route: Route | None, cached: int, prompt_tokens: int) -> None:
        """The answer from ``up`` reported ``cached`` cached prompt tokens: compared with the
        prediction (counted exact / over / under)."""
        if not isinstance(route, PreciseRoute):
            return
        route.reported_cached = cached
        predicted = route.predicted_cached
        if predicted is None:
            return
        self.predicted_tokens[up.url] += predicted
        self.reported_tokens[up.url] += cached
        result = "exact" if predicted == cached else "over" if predicted > cached else "under"
        self.predictions[(up.url, result)] += 1
        logger.debug(
            "precise learn %s reason=%s predicted=%d reported=%d prompt=%d",
            up.url,
            route.reason,
            predicted,
            cached,
            prompt_tokens,
        )

    # ---- metrics -----------------------------------------------------------------------------
    def collector(self) -> Collector:
        """A prometheus collector of the policy's and the index's counters."""
        return _PreciseCollector(self)


_INDEX_COUNTERS = (
    ("gaps", "sequence gaps found in the replica's KV event stream"),
    ("resyncs", "resyncs of the replica's blocks (replay or snapshot)"),
    ("replays", "resyncs by replay"),
    ("snapshots", "resyncs by snapshot"),
    ("restarts", "engine restarts seen"),
    ("resync_failures", "replay / snapshot requests that failed"),
    ("batches_applied", "KV event batches applied"),
    ("unknown_removals", "removals of blocks the index did not hold (0 when exact)"),
    ("load_reports", "load reports received from the replica's engine"),
)


class _PreciseCollector(Collector):
    def __init__(self, policy: PreciseRouting) -> None:
        self.policy = policy

    def collect(self) -> Iterator[Any]:
        p = self.policy
        pred = CounterMetricFamily(
            "prefixgate_route_predicted_cached_tokens",
            "prompt tokens precise routing predicted cached on the chosen upstream "
            "(requests whose answer reported cached_tokens)",
            labels=["upstream"],
        )
        rep = CounterMetricFamily(
            "prefixgate_route_reported_cached_tokens",
            "cached_tokens the upstreams reported for those requests",
            labels=["upstream"],
        )
        for url in sorted(set(p.predicted_tokens) | set(p.reported_tokens)):
            pred.add_metric([url], p.predicted_tokens[url])
            rep.add_metric([url], p.reported_tokens[url])
        agree = CounterMetricFamily(
            "prefixgate_route_predictions",
            "precise routing's predictions against the reported cached tokens",
            labels=["upstream", "result"],
        )
        for (url, result), n in sorted(p.predictions.items()):
            agree.add_metric([url, result], n)
        dec = CounterMetricFamily(
            "prefixgate_route_decisions",
            "precise routing's choices by reason (score, affinity, fallback_*)",
            labels=["reason"],
        )
        for reason, n in sorted(p.decisions.items()):
            dec.add_metric([reason], n)
        yield from (pred, rep, agree, dec)
        stats = p.index.stats()["replicas"]
        gauges = {
            "synced": GaugeMetricFamily(
                "prefixgate_kv_index_synced",
                "1 when the replica's blocks are in sync",
                labels=["replica"],
            ),
            "blocks": GaugeMetricFamily(
                "prefixgate_kv_index_blocks", "distinct block hashes held", labels=["replica"]
            ),
            "lag_s": GaugeMetricFamily(
                "prefixgate_kv_index_lag_seconds",
                "seconds from the last applied batch's engine step to its application",
                labels=["replica"],
            ),
            "seq_lag": GaugeMetricFamily(
                "prefixgate_kv_index_seq_lag",
                "batches seen on the stream but not applied",
                labels=["replica"],
            ),
        }
        counters = {
            name: CounterMetricFamily(f"prefixgate_kv_index_{name}", doc, labels=["replica"])
            for name, doc in _INDEX_COUNTERS
        }
        for name, st in sorted(stats.items()):
            for k, g in gauges.items():
                g.add_metric([name], float(st[k]))
            for k, c in counters.items():
                c.add_metric([name], st[k])
        load = {
            "requests": GaugeMetricFamily(
                "prefixgate_kv_index_load_requests",
                "requests running and waiting on the replica, by its latest load report",
                labels=["replica"],
            ),
            "queued": GaugeMetricFamily(
                "prefixgate_kv_index_load_queued_prefill_tokens",
                "prefill tokens queued on the replica (net of its cache), by its latest report",
                labels=["replica"],
            ),
            "kv": GaugeMetricFamily(
                "prefixgate_kv_index_load_kv_usage",
                "fraction of the replica's KV blocks in use, by its latest load report",
                labels=["replica"],
            ),
        }
        for name, st in sorted(stats.items()):
            rep = st.get("load")
            if rep is None:
                continue
            load["requests"].add_metric([name], rep.num_running + rep.num_waiting)
            load["queued"].add_metric([name], rep.queued_prefill_tokens)
            total = rep.kv_blocks_total
            load["kv"].add_metric([name], rep.kv_blocks_used / total if total else 0.0)
        yield from gauges.values()
        yield from counters.values()
        yield from load.values()
