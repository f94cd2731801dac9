"""``precise`` routing's decisions on a stub index (no engine), its options, and its import
without torch.

- the cost: the upstream holding more of the prompt wins at equal load; load (tokens in flight
  there) outweighs a small cache advantage; a copy of tokens another upstream holds costs
  them twice (the prefill and the cache it displaces);
- homes: a cold prompt's home stays while it is only busy;
- the per-request bound: an upstream whose in-flight requests with this one would exceed X x
  the mean is not chosen while another under the bound holds as much; when every holder is
  over it, the cost decides (the bound alone never makes a copy); the least loaded always
  qualifies;
- the fleet's load: the engines' load reports (requests another gateway sent) count in the
  bound and the queued prefill, with this gateway's requests sent since the last report added
  once, and never less than this gateway's own;
- the share bound moves a hot replica's hottest prompt, but not a continuation (a request
  whose holder caches its own history);
- session affinity (``prompt_cache_key``, else ``user``, within a cache partition) holds while
  the session's pins are held (or a request of it is in flight) and is forgotten when the
  index says they are gone;
- fallback to ``cache_aware`` when a candidate has no feed or its feed is not synced, or the
  request does not tokenize;
- salts: the engine salt per upstream is ``effective_salt(None, forwarded cache_salt)``;
- options: ``--upstream-kv-events`` specs, settings refused by name, the CLI flags;
- torch-free: the policy tokenizes in a process where torch cannot be imported.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence

import pytest
from prefixgate.engine.kv_events import EngineLoad
from prefixgate.gateway.proxy.kv_index import prompt_block_keys
from prefixgate.gateway.proxy.policies.precise_routing import (
    PreciseRoute,
    PreciseRouting,
    parse_kv_events_spec,
)
from prefixgate.gateway.proxy.upstream import Route, Upstream
from prefixgate.gateway.settings import GatewaySettings
from prefixgate.gateway.tenancy.keys import effective_salt

BS = 4
A, B, C = "http://a:1", "http://b:1", "http://c:1"


class StubIndex:
    """What the policy asks of ``KVIndex``: per replica a set of held keys, synced or not."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.held: dict[str, set[bytes]] = {u: set() for u in urls}
        self.synced = dict.fromkeys(urls, True)
        self.loads: dict[str, tuple[EngineLoad, float]] = {}  # url -> (report, arrival)

    def load(self, name: str) -> tuple[EngineLoad, float] | None:
        return self.loads.get(name)

    def report(self, url: str, running: int = 0, waiting: int = 0, queued: int = 0) -> None:
        """A load report from ``url``'s engine arrives now."""
        n = self.loads[url][0].n + 1 if url in self.loads else 1
        load = EngineLoad(time.time(), n, running, waiting, queued, 0, 0, 256)
        self.loads[url] = (load, time.monotonic())

    def stats(self) -> dict:
        return {"replicas": {u: {"synced": s} for u, s in self.synced.items()}}

    def readiness(self) -> dict[str, tuple[bool, str | None, int]]:
        return {u: (s, self.hash_scheme(u), self.block_size(u)) for u, s in self.synced.items()}

    def block_size(self, name: str) -> int:
        return BS

    def hash_scheme(self, name: str) -> str:
        return "prefixgate"

    def match(self, keys: Sequence[bytes]) -> dict[str, int]:
        out = {}
        for u, held in self.held.items():
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            out[u] = n
        return out

    def hold(self, url: str, ids: list[int], salt: str | None = None, blocks: int | None = None):
        keys = prompt_block_keys(ids, BS, salt)
        self.held[url].update(keys[:blocks])

    def start(self) -> None: ...

    def close(self) -> None: ...


class FakeTokenizer:
    """Each character one token (its code point); chat: the contents joined."""

    vocab_size = 1 << 20

    def encode_chat(self, messages, add_generation_prompt=True, **kw):
        return [ord(c) for m in messages for c in m["content"]]

    def encode_batch(self, texts, add_special_tokens=True):
        return [[ord(c) for c in t] for t in texts]

    def min_num_tokens(self, text: str) -> int:
        return 0

    def apply_chat_template(self, messages, **kw):
        return "".join(m["content"] for m in messages)


def ups(*urls: str) -> list[Upstream]:
    out = [Upstream(u) for u in urls]
    for u in out:
        u.cache_salt = True
    return out


def policy(urls: Sequence[str], **kw) -> tuple[PreciseRouting, StubIndex]:
    index = StubIndex(urls)
    feeds = {u: ("tcp://127.0.0.1:1", None) for u in urls}
    return PreciseRouting(FakeTokenizer(), feeds, index=index, **kw), index  # type: ignore[arg-type]


def route_of(p: PreciseRouting, body: dict, salt: str | None = None) -> PreciseRoute:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {"model": "m", **body}
    return asyncio.run(p.prepare(Route(None, [1]), body, path, salt))


def never() -> Upstream:
    raise AssertionError("fell back")


PROMPT = "abcdefghijklmnopqrstuvwxyz" * 2  # 52 tokens: 12 reusable blocks of 4


def test_holder_wins_at_equal_load_and_prediction_is_noted():
    p, index = policy([A, B])
    index.hold(B, [ord(c) for c in PROMPT])
    a, b = ups(A, B)
    r = route_of(p, {"prompt": PROMPT})
    assert p.pick(r, [a, b], never) is b
    assert r.predicted_cached == 48 and r.reason == "score"
    p.learn(b, r, 48, 52)
    assert p.predictions[(B, "exact")] == 1
    p.release(r)
    assert p._pending[B] == 0 and not p._inflight_keys[B]


def test_load_outweighs_a_small_cache_advantage():
    p, index = policy([A, B])
    ids = [ord(c) for c in PROMPT]
    index.hold(B, ids, blocks=1)  # B saves 4 tokens
    a, b = ups(A, B)
    busy = route_of(p, {"prompt": "z" * 40})
    assert p.pick(busy, [a], never) is a  # 40 tokens in flight on A
    assert p.pick(route_of(p, {"prompt": PROMPT}), [a, b], never) is b
    # with B's queued prefill far above what it saves, A wins
    p2, index2 = policy([A, B])
    index2.hold(B, ids, blocks=1)
    a2, b2 = ups(A, B)
    heavy = route_of(p2, {"prompt": "y" * 200})
    assert p2.pick(heavy, [b2], never) is b2
    assert p2.pick(route_of(p2, {"prompt": PROMPT}), [a2, b2], never) is a2


def test_a_copy_costs_the_cache_it_displaces():
    """Computing again tokens another upstream holds makes a copy that displaces as many of
    this upstream's cached tokens: the holder keeps the prompt until its queued prefill
    exceeds the prompt's own uncached tokens plus twice the held ones (the bench's case:
    a holder with one cold 60-token prompt queued lost an 80-token hit to an idle replica)."""
    ids = [ord(c) for c in PROMPT]  # 52 tokens, 48 held on A
    for queued, winner in ((60, A), (95, A), (100, B)):
        p, index = policy([A, B])
        index.hold(A, ids)
        a, b = ups(A, B)
        busy = route_of(p, {"prompt": "q" * queued})
        assert p.pick(busy, [a], never) is a  # ``queued`` uncached tokens in flight on A
        # A: 4 + queued; B: 52 + the 48 it would copy
        r = route_of(p, {"prompt": PROMPT})
        assert p.pick(r, [a, b], never).url == winner, queued
        assert r.predicted_cached == (48 if winner == A else 0)


def test_a_busy_home_stays_the_home():
    """A cold prompt whose home is over the bound right now goes elsewhere, but its home
    stays: the next cold request of it goes home again once the load allows, and the home
    counts are unchanged (no prompt re-homed by a passing burst)."""
    p, _ = policy([A, B, C], max_load_ratio=1.3)
    a, b, c = ups(A, B, C)

    def cold() -> PreciseRoute:
        base = Route(b"system prompt", [1])
        body = {"model": "m", "prompt": PROMPT}
        return asyncio.run(p.prepare(base, body, "/v1/completions", None))

    first = cold()
    home = p.pick(first, [a, b, c], never)
    assert first.reason == "placed"
    p.release(first)
    counts = dict(p._home_count)
    home.in_flight = 3  # 4 > max(1.3 * 4 / 3, 4 / 3 + 1): over the bound
    second = cold()
    assert p.pick(second, [a, b, c], never) is not home and second.reason == "placed"
    p.release(second)
    assert p._homes[b"system prompt"] == home.url and dict(p._home_count) == counts
    home.in_flight = 0
    third = cold()
    assert p.pick(third, [a, b, c], never) is home and third.reason == "placed"
    # a home no longer among the candidates (down, or not serving the model) is replaced
    p.release(third)
    rest = [u for u in (a, b, c) if u is not home]
    fourth = cold()
    new = p.pick(fourth, rest, never)
    assert p._homes[b"system prompt"] == new.url and p._home_count[home.url] == 0


def test_bound_on_imbalance_is_judged_per_request():
    """An upstream whose requests with this one would exceed X x the mean is not a
    candidate while another under the bound holds as much of the prompt; under the bound
    the holder wins."""
    ids = [ord(c) for c in PROMPT]

    def pick(loads: tuple[int, int, int], holders: Sequence[str]) -> tuple[str, int | None]:
        p, index = policy([A, B, C], max_load_ratio=1.3)
        for h in holders:
            index.hold(h, ids)
        a, b, c = ups(A, B, C)
        a.in_flight, b.in_flight, c.in_flight = loads
        r = route_of(p, {"prompt": PROMPT})
        return p.pick(r, [a, b, c], never).url, r.predicted_cached

    # A with this one: 3 > 1.3 * (4 + 1) / 3 = 2.17 -> not a candidate: C's copy serves it
    assert pick((2, 1, 1), (A, C)) == (C, 48)
    assert pick((1, 1, 1), (A,)) == (A, 48)  # 2 <= max(1.3 * 4 / 3, 4 / 3 + 1)
    # A with this one: 10 > max(1.3 * 22 / 3 = 9.53, 8.33)
    assert pick((9, 6, 6), (A, C)) == (C, 48)
    assert pick((8, 6, 6), (A,)) == (A, 48)  # 9 <= 9.53
    # a mostly idle pool (the mean below one): a second request may join the holder's one
    assert pick((1, 0, 0), (A,)) == (A, 48)  # 2 <= max(1.3 * 2 / 3, 2 / 3 + 1, 2)
    assert pick((2, 0, 0), (A, B)) == (B, 48)  # a third does not: 3 > 2
    with pytest.raises(ValueError, match="max_load_ratio"):
        policy([A], max_load_ratio=0.9)


def test_bound_never_turns_the_only_hit_into_a_copy():
    """When every holder of the prompt is over the in-flight bound, the holders stay
    candidates and the cost decides: the hit stays while the holder's queued prefill is
    below a copy's cost (the prompt's uncached tokens plus the held ones computed again),
    and moves once it is above. Before, the bound alone sent such requests cold: in the
    benchmark at round robin's capacity 15 of 90 requests were copies made in one burst,
    precise's p90 TTFT was 1.09x lower than round robin's and its hit rate 0.77."""
    ids = [ord(c) for c in PROMPT]  # 52 tokens, 48 held on A
    for queued, stays in ((0, True), (95, True), (100, False)):
        p, index = policy([A, B, C], max_load_ratio=1.3)
        index.hold(A, ids)
        a, b, c = ups(A, B, C)
        if queued:
            busy = route_of(p, {"prompt": "q" * queued})
            assert p.pick(busy, [a], never) is a  # ``queued`` uncached tokens in flight on A
        a.in_flight = 2
        b.in_flight = c.in_flight = 0 if queued else 1
        # A with this one over the bound (3 > max(1.3 * m, m + 1, 2)), the only holder
        r = route_of(p, {"prompt": PROMPT})
        assert (p.pick(r, [a, b, c], never).url == A) == stays, queued
        assert r.predicted_cached == (48 if stays else 0)


def test_engine_load_reports_count_every_gateways_requests():
    """Two gateways on one pool: the requests gateway 1 sent show in gateway 2's bound and
    queued prefill through the engines' load reports (the same report in both), so 2 does
    not pile onto the replica 1 keeps busy."""
    ids = [ord(c) for c in PROMPT]
    index = StubIndex([A, B, C])
    index.hold(A, ids)
    feeds = {u: ("tcp://127.0.0.1:1", None) for u in (A, B, C)}
    g2 = PreciseRouting(FakeTokenizer(), feeds, index=index, max_load_ratio=1.3)  # type: ignore[arg-type]
    a, b, c = ups(A, B, C)  # gateway 2's own view: nothing in flight anywhere
    assert g2.load(a) == (0, 0)  # no report yet: its own
    index.report(A, running=2, waiting=1, queued=300)  # gateway 1's three requests on A
    index.report(B)
    index.report(C)
    assert g2.load(a) == (3, 300) and g2.load(b) == (0, 0)
    # A with this one: 4 > max(1.3 * 4 / 3, 4 / 3 + 1, 2) -> not a candidate, though it holds
    r = route_of(g2, {"prompt": PROMPT})
    assert g2.pick(r, [a, b, c], never) in (b, c) and r.predicted_cached == 0
    g2.release(r)
    # A down to one running request (a new report): the holder wins again, and its queued
    # prefill is weighed: 4 + 95 against 52 + 48 copied on an idle replica; 4 + 97 loses
    index.report(A, running=1, queued=95)
    r = route_of(g2, {"prompt": PROMPT})
    assert g2.pick(r, [a, b, c], never) is a and r.predicted_cached == 48
    g2.release(r)
    index.report(A, running=1, queued=97)
    assert g2.pick(route_of(g2, {"prompt": PROMPT}), [a, b, c], never) is not a


def test_requests_sent_since_the_last_report_are_added_once():
    p, index = policy([A, B])
    a, b = ups(A, B)
    index.report(A, running=1, queued=10)
    index.report(B)
    r = route_of(p, {"prompt": "z" * 40})
    assert p.pick(r, [a], never) is a
    a.in_flight += 1  # what the proxy does once picked
    # sent after the report arrived: not in it, added (1 request, its 40 uncached tokens)
    assert p.load(a) == (2, 50)
    time.sleep(0.002)  # (monotonic clock steps: the next report arrives after the pick)
    index.report(A, running=2, queued=50)  # the engine has it now: counted once
    assert p.load(a) == (2, 50)
    index.report(A, running=0, queued=0)  # a report that misses it (sent before it arrived)
    assert p.load(a) == (1, 40)  # this gateway's own is the floor
    p.started(r)  # its prefill done
    assert p.load(a) == (1, 0)
    p.release(r)
    a.in_flight -= 1
    assert p.load(a) == (0, 0) and not p._flying[A]


def test_share_of_recent_picks_is_bounded_by_copies_of_the_hot_prompt():
    """One prompt held by A takes every pick while A is idle; once A has more than X x the
    mean share of the last 16 x n picks, the prompt goes to another upstream (a copy), and
    so on until the holders' shares are within the bound: one copy per other upstream (a
    single prompt is the whole traffic here, so it ends on all three), each made once."""
    from prefixgate.gateway.proxy.policies.precise_routing import SHARE_WINDOW

    p, index = policy([A, B, C], max_load_ratio=1.3)
    ids = [ord(c) for c in PROMPT]
    index.hold(A, ids)
    a, b, c = ups(A, B, C)
    window = SHARE_WINDOW * 3
    cold: list[str] = []

    def share(url: str) -> int:
        return sum(1 for u, _ in p._recent if u == url)

    def pick() -> str:
        r = route_of(p, {"prompt": PROMPT})
        up = p.pick(r, [a, b, c], never)
        p.release(r)
        if r.predicted_cached != 48:
            cold.append(up.url)
            index.hold(up.url, ids)  # its events arrive: one more holder
        return up.url

    half = window // 2  # judged once the window is half full
    assert [pick() for _ in range(half)] == [A] * half and not cold
    assert pick() != A and len(cold) == 1  # A: 25 > 1.3 x 25 / 3: a copy elsewhere
    for i in range(4 * window):
        assert pick() != A or share(A) <= 1.3 * (window + 1) / 3  # none while over
        counts = [share(u) for u in (A, B, C)]
        if i >= window:  # the window has slid past A's run: every share within the bound
            assert max(counts) <= 1.3 * (window + 1) / 3, counts
    assert sorted(cold) == [B, C]  # each other upstream copied it once


def test_share_bound_moves_only_the_hot_replicas_hottest_prompt():
    """A over its share with two prompts: the hottest one's next request goes elsewhere (a
    copy), the other prompt's request stays where it is cached (no copy of it)."""
    from prefixgate.gateway.proxy.policies.precise_routing import SHARE_WINDOW

    p, index = policy([A, B, C], max_load_ratio=1.3)
    hot, mild = PROMPT, PROMPT[::-1]
    for text in (hot, mild):
        index.hold(A, [ord(c) for c in text])
    a, b, c = ups(A, B, C)

    def pick(text: str) -> PreciseRoute:
        base = Route(text[:8].encode(), [1])  # the prompt's key: its leading text
        r = asyncio.run(p.prepare(base, {"model": "m", "prompt": text}, "/v1/completions", None))
        p.pick(r, [a, b, c], never)
        p.release(r)
        return r

    half = SHARE_WINDOW * 3 // 2  # judged once the window is half full
    for i in range(half):  # A takes them all: 3 of 4 the hot prompt's
        assert pick(mild if i % 4 == 0 else hot).predicted_cached == 48
    r = pick(mild)  # A is over its share, but this is not its hottest prompt: it stays
    assert r.predicted_cached == 48  # on A (only A holds it)
    r = pick(hot)  # the hottest: elsewhere, a copy
    assert r.predicted_cached == 0


def test_share_bound_leaves_a_continuation_on_its_holder():
    """A over its share, the hot key its hottest: a fresh request of the key (cached on A up
    to the shared system prompt only, no more than the key's shortest prompt, the system
    prompt alone) goes elsewhere, but a continuation (A caches its history, more than the
    key's shortest prompt) stays on A, session id or not: moving it would copy the whole
    history and spread nothing of the shared prompt (docs/sim.md)."""
    from prefixgate.gateway.proxy.policies.precise_routing import SHARE_WINDOW

    p, index = policy([A, B, C], max_load_ratio=1.3)
    system = "You are a helpful assistant. Be brief."[:32]  # 32 tokens: 8 blocks of 4
    index.hold(A, [ord(c) for c in system + "."])  # its 8 blocks (a block's worth and one)
    a, b, c = ups(A, B, C)

    def pick(text: str) -> PreciseRoute:
        base = Route(system.encode(), [1])  # the key: the shared system prompt
        r = asyncio.run(p.prepare(base, {"model": "m", "prompt": text}, "/v1/completions", None))
        p.pick(r, [a, b, c], never)
        p.release(r)
        return r

    # a request of the system prompt alone (the key's shortest: 32 tokens), then fresh
    # requests of the key (40 tokens each): all on A, the holder, until the window is half full
    assert pick(system).predicted_cached == 28
    for i in range(SHARE_WINDOW * 3 // 2 - 1):
        assert pick(system + f"{i:03d} user").predicted_cached == 32
    # a session's second turn: A holds its first turn and the answer (32 + 8 + 12 tokens)
    history = system + "000 user" + "the answer!!"
    index.hold(A, [ord(ch) for ch in history + "."])  # its 13 blocks
    turn = pick(history + "and then?")
    assert turn.predicted_cached == 52 and turn.reason == "score"  # stays: no copy
    # a fresh request of the key still moves (one copy of the system prompt elsewhere)
    fresh = pick(system + "new: user")
    assert fresh.predicted_cached == 0
    assert p._recent[-1][0] != A and p._recent[-2][0] == A


def test_session_affinity_lasts_as_long_as_its_pins():
    p, index = policy([A, B])
    a, b = ups(A, B)
    first = route_of(p, {"prompt": "hello there, this is turn one", "user": "u1"}, salt="t")
    assert p.pick(first, [a, b], never) is a  # nothing cached anywhere: the first in turn
    p.release(first)
    index.hold(A, [ord(c) for c in "hello there, this is turn one"], salt=effective_salt(None, "t"))
    # B holds this new prompt's opening, but the session's pins are on A
    other = "something else entirely, turn two"
    index.hold(B, [ord(c) for c in other], salt=effective_salt(None, "t"))
    second = route_of(p, {"prompt": other, "user": "u1"}, salt="t")
    assert p.pick(second, [a, b], never) is a and second.reason == "affinity"
    p.release(second)
    # another tenant's session of the same name is its own
    third = route_of(p, {"prompt": other, "user": "u1"}, salt="other-tenant")
    assert p.pick(third, [a, b], never).url in (A, B) and third.reason == "score"
    p.release(third)
    # A evicted the session's blocks: the pin is gone, the session forgotten
    index.held[A].clear()
    fourth = route_of(p, {"prompt": other, "user": "u1"}, salt="t")
    assert p.pick(fourth, [a, b], never) is b and fourth.reason == "score"


def test_burst_of_one_prompt_stays_before_its_events_arrive():
    """Nothing published yet: the second request of a prompt goes where the first is in
    flight (its blocks are being computed there), and is predicted cached there."""
    p, _ = policy([A, B])
    a, b = ups(A, B)
    first = route_of(p, {"prompt": PROMPT})
    up = p.pick(first, [a, b], never)
    up.in_flight = 1
    second = route_of(p, {"prompt": PROMPT})
    assert p.pick(second, [a, b], never) is up and second.predicted_cached == 48
    p.release(first)
    p.release(second)
    assert not p._inflight_keys[up.url] and p._pending[up.url] == 0


def test_falls_back_without_feed_sync_or_tokens():
    p, index = policy([A, B])
    a, b = ups(A, B)
    c = Upstream(C)
    r = route_of(p, {"prompt": PROMPT})
    assert p.pick(r, [a, c], lambda: a) is a and r.reason == "fallback_no_feed"
    assert r.predicted_cached == 0  # the chosen one's feed is synced: still predicted
    p.release(r)
    index.synced[B] = False
    r = route_of(p, {"prompt": PROMPT})
    assert p.pick(r, [a, b], lambda: b) is b and r.reason == "fallback_not_synced"
    assert r.predicted_cached is None
    p.release(r)
    r = route_of(p, {"messages": "not a list"})
    assert r.token_ids is None
    assert p.pick(r, [a], lambda: a) is a and r.reason == "fallback_untokenized"
    assert p.decisions == {
        "fallback_no_feed": 1,
        "fallback_not_synced": 1,
        "fallback_untokenized": 1,
    }


def test_engine_salt_follows_the_forwarded_cache_salt():
    p, _ = policy([A])
    (a,) = ups(A)
    r = route_of(p, {"prompt": PROMPT, "cache_salt": "mine"}, salt="composed")
    assert r.engine_salt(a) == effective_salt(None, "composed")
    a.cache_salt = False  # the body goes as the client sent it
    assert r.engine_salt(a) == effective_salt(None, "mine")
    open_route = route_of(p, {"prompt": PROMPT}, salt=None)
    assert open_route.engine_salt(a) is None


def test_batch_of_prompts_is_routed_but_not_predicted():
    p, _ = policy([A, B])
    a, b = ups(A, B)
    r = route_of(p, {"prompt": ["first prompt", "second"]})
    assert r.batch and r.token_ids == [ord(c) for c in "first prompt"]
    p.pick(r, [a, b], never)
    assert r.predicted_cached is None


def test_kv_events_specs():
    assert parse_kv_events_spec("http://e0:8000/v1=tcp://e0:5557") == (
        "http://e0:8000",
        "tcp://e0:5557",
        "tcp://e0:5558",
    )
    assert parse_kv_events_spec("http://e0:8000=tcp://e0:5557,tcp://e0:6000")[2] == "tcp://e0:6000"
    assert parse_kv_events_spec("http://e0:8000=tcp://e0:5557,-")[2] is None
    for bad in ("tcp://e0:5557", "http://e0:8000=", "http://e0:8000=udp://x:1", "x=tcp://e:*"):
        with pytest.raises(ValueError):
            parse_kv_events_spec(bad)


def test_settings_refuse_precise_options_by_name(aidreams_path):
    """The policy's own options are checked by the policy (``check_settings``), which every
    app build and the CLI run: ``GatewaySettings`` knows the policies' names only."""
    from prefixgate.gateway.app import create_proxy_app
    from prefixgate.gateway.proxy.policies import check_settings

    for bad, match in [
        (dict(routing="precise"), "tokenizer"),
        (dict(tokenizer=aidreams_path), "tokenizer is used by routing precise only"),
        (
            dict(upstream_kv_events={A: ("tcp://a:1", None)}),
            "upstream_kv_events is used by routing precise only",
        ),
        (
            dict(routing="precise", tokenizer=aidreams_path, precise_max_load_ratio=0.5),
            "precise_max_load_ratio",
        ),
        (
            dict(routing="precise", tokenizer=aidreams_path, precise_overlap_weight=0),
            "precise_overlap_weight",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            check_settings(GatewaySettings(**bad))
        with pytest.raises(ValueError, match=match):
            create_proxy_app([A], GatewaySettings(**bad))

    s = GatewaySettings(
        routing="precise", tokenizer=aidreams_path, upstream_kv_events={B: ("tcp://b:1", None)}
    )
    with pytest.raises(ValueError, match="not upstreams"):
        create_proxy_app([A], s)


def test_cli_flags_reach_the_settings(aidreams_path):
    from prefixgate.gateway.cli import build_parser
    from prefixgate.gateway.serve.configure import settings_from_args

    args = build_parser("serve").parse_args(
        [
            "serve",
            "--upstream",
            A,
            "--routing",
            "precise",
            "--tokenizer",
            aidreams_path,
            "--upstream-kv-events",
            A + "=tcp://a:5557",
            "--precise-max-load-ratio",
            "1.5",
        ]
    )
    s = settings_from_args(args)
    assert s.routing == "precise" and s.tokenizer == aidreams_path
    assert s.upstream_kv_events == {A: ("tcp://a:5557", "tcp://a:5558")}
    assert s.precise_max_load_ratio == 1.5


def test_precise_proxy_tokenizes_without_torch(tmp_path, aidreams_path):
    """In a process where torch (and numpy, safetensors, triton, transformers) cannot be
    imported, a precise proxy app is built and tokenizes a chat as the engine's tokenizer does
    (the parent process computes the expected ids)."""
    from prefixgate.engine.tokenizer import Tokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    expected = Tokenizer.from_pretrained(aidreams_path).encode_chat(
        messages, add_generation_prompt=True
    )
    blocked = ("torch", "safetensors", "numpy", "triton", "transformers")
    (tmp_path / "sitecustomize.py").write_text(
        f"import sys\nfor n in {blocked!r}:\n    sys.modules[n] = None\n"
    )
    code = textwrap.dedent(
        f"""
        import asyncio, sys
        from prefixgate.gateway.app import create_proxy_app
        from prefixgate.gateway.proxy.serving import PROXY
        from prefixgate.gateway.proxy.upstream import Route
        from prefixgate.gateway.settings import GatewaySettings
        s = GatewaySettings(routing="precise", tokenizer={aidreams_path!r})
        app = create_proxy_app(["http://127.0.0.1:9"], s)
        body = {{"model": "m", "messages": {messages!r}}}
        r = asyncio.run(app[PROXY].router.policy.exact.prepare(
            Route(None, []), body, "/v1/chat/completions", None))
        assert "torch" not in sys.modules or sys.modules["torch"] is None
        print(r.token_ids)
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(list(expected))


def test_primed_keys_are_the_keys_the_route_would_hash() -> None:
    from prefixgate.engine.block_hash import prompt_block_hashes

    ids = list(range(3, 3 + 4 * BS + 2))
    hashed = PreciseRoute(None, [])
    hashed.token_ids = ids
    primed = PreciseRoute(None, [])
    primed.token_ids = ids
    primed.prime_keys(None, BS, prompt_block_hashes(ids, BS))
    assert primed.keys(None, BS) == hashed.keys(None, BS) == prompt_block_keys(ids, BS)
    assert len(primed.keys(None, BS)) == 4
    with pytest.raises(ValueError, match="reusable"):
        primed.prime_keys(None, BS, prompt_block_hashes(ids, BS)[:3])
