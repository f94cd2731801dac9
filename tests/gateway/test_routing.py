"""Upstream routing policies (``--routing``) and cache_aware's prefix tree (``proxy.policies``)."""

from __future__ import annotations

import random

import pytest
from prefixgate.gateway.proxy.policies import PrefixTree, prompt_blocks
from prefixgate.gateway.proxy.policies.prompt import prompt_text
from prefixgate.gateway.proxy.upstream import Route, UpstreamRouter
from prefixgate.gateway.settings import GatewaySettings

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]


def _route(text: str, salt: str | None = None) -> Route:
    return Route(text[:64].encode(), prompt_blocks(text, salt, 16, 4096))


def test_prompt_blocks_whole_blocks_and_salt():
    assert len(prompt_blocks("a" * 40, None, 16, 4096)) == 2  # the partial block is dropped
    assert len(prompt_blocks("short", None, 16, 4096)) == 1
    assert prompt_blocks("x" * 32, "t1", 16, 4096) != prompt_blocks("x" * 32, "t2", 16, 4096)
    assert prompt_blocks("", None, 16, 4096) == []


def test_tree_longest_match_and_eviction():
    tree = PrefixTree(max_nodes=10)
    a = prompt_blocks("A" * 64 + "1" * 32, None, 16, 4096)
    b = prompt_blocks("A" * 64 + "2" * 32, None, 16, 4096)
    tree.insert(a, "u1")
    tree.insert(b, "u2")
    assert tree.match(a) == {"u1": 6, "u2": 4}
    assert tree.size == {"u1": 6, "u2": 6}
    tree.insert(prompt_blocks("Z" * 160, None, 16, 4096), "u3")  # 10 more blocks: evicts
    assert tree.nodes <= 10
    assert sum(tree.size.values()) >= tree.nodes


def test_cache_aware_keeps_a_prompt_on_its_upstream_and_spreads_new_ones():
    r = UpstreamRouter(URLS, balance_abs_threshold=2)
    prompts = [f"system prompt number {i} " * 8 for i in range(6)]
    first = {p: r.pick(_route(p)) for p in prompts}
    assert len({u.url for u in first.values()}) == 3  # new prompts go to the emptiest
    for p in prompts:
        for _ in range(3):
            assert r.pick(_route(p + "user question")) is first[p]


def test_cache_aware_leaves_a_hot_prompt_s_upstream_when_it_is_overloaded():
    r = UpstreamRouter(URLS, balance_abs_threshold=2)
    hot = _route("the hot system prompt " * 8)
    home = r.pick(hot)
    home.in_flight = 3
    other = r.pick(_route("the hot system prompt " * 8))
    assert other is not home and other.in_flight == 0
    # Now both hold it: the less loaded of the two takes the next one.
    other.in_flight = 1
    assert r.pick(_route("the hot system prompt " * 8)) is other


def test_cache_aware_spills_a_hot_prompt_to_where_it_is_cached_already():
    """When the holder is overloaded, the upstream holding the next-longest match within the
    threshold takes the request, not the least loaded cold upstream: each spill to a new
    upstream is one more cold prefill of the system prompt there."""
    r = UpstreamRouter(URLS, balance_abs_threshold=2)
    system = "the hot system prompt " * 8
    home = r.pick(_route(system + "user A asks a long question " * 3))
    home.in_flight = 3
    second = r.pick(_route(system + "user B asks another question " * 3))  # spilled
    assert second is not home
    second.in_flight = 1  # busier than the cold third upstream, within the threshold
    third = next(u for u in r.upstreams if u not in (home, second))
    # user A again: home holds all of it (overloaded), second the system prompt
    assert r.pick(_route(system + "user A asks a long question " * 3)) is second
    second.in_flight = 3  # both holders overloaded beyond the threshold: the cold one
    assert r.pick(_route(system + "user A asks a long question " * 3)) is third


def test_cache_aware_salts_never_match_across_tenants():
    r = UpstreamRouter(URLS)
    text = "shared system prompt text " * 8
    u1 = r.pick(_route(text, "tenant-1"))
    assert r.tree.match(prompt_blocks(text, "tenant-2", 16, 4096)) == {}
    assert r.pick(_route(text, "tenant-1")) is u1


def test_cache_aware_learns_from_cached_tokens():
    r = UpstreamRouter(URLS)
    route = _route("learned prompt " * 8)
    up = r.upstreams[2]
    r.learn(up, route, cached=100, prompt_tokens=100)  # e.g. a retry's upstream
    assert r.tree.match(route.blocks)[up.url] == len(route.blocks)
    route.predicted = len(route.blocks)
    r.learn(up, route, cached=0, prompt_tokens=100)
    assert up.cache_misses == 1


def test_a_retry_s_upstream_is_not_held_to_the_first_pick_s_prediction():
    r = UpstreamRouter(URLS)
    text = "retried prompt " * 8
    r.pick(_route(text))
    route = _route(text)
    home = r.pick(route)  # the tree predicts all of it cached there
    assert route.predicted == len(route.blocks)
    other = r.pick(route, [home])  # home failed: a cold upstream, nothing predicted
    r.learn(other, route, cached=0, prompt_tokens=100)
    assert other.cache_misses == 0


def test_round_robin_and_least_loaded():
    r = UpstreamRouter(URLS, policy="round_robin")
    assert [r.pick(_route("same")).url for _ in range(6)] == URLS * 2
    r = UpstreamRouter(URLS, policy="least_loaded")
    r.upstreams[0].in_flight = 2
    r.upstreams[2].in_flight = 1
    assert r.pick(_route("x")) is r.upstreams[1]


def test_rendezvous_is_stable():
    r = UpstreamRouter(URLS, policy="rendezvous")
    picks = {r.pick(_route("a system prompt " * 8)).url for _ in range(5)}
    assert len(picks) == 1


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="routing must be one of"):
        UpstreamRouter(URLS, policy="random")
    with pytest.raises(ValueError, match="routing must be one of"):
        GatewaySettings(routing="random")


def test_a_policy_is_one_class_registered_by_name(monkeypatch):
    """Adding a policy: a ``Policy`` subclass, its line in ``REGISTRY`` and its name in
    ``settings.ROUTING_POLICIES`` (settings imports no room; tests/test_architecture.py holds
    the two equal) — the router, settings and ``--routing`` take it by name, and it sees only
    the model's healthy upstreams."""
    from prefixgate.gateway import settings
    from prefixgate.gateway.proxy import policies

    class Last(policies.Policy):
        name = "last"

        def pick(self, route, candidates):
            return candidates[-1]

    monkeypatch.setitem(policies.REGISTRY, "last", Last)
    monkeypatch.setattr(settings, "ROUTING_POLICIES", (*settings.ROUTING_POLICIES, "last"))
    r = UpstreamRouter(URLS, policy="last")
    assert r.policy.name == "last" and GatewaySettings(routing="last").routing == "last"
    assert r.pick(_route("x")) is r.upstreams[2]
    r.upstreams[2].healthy = False
    assert r.pick(_route("x")) is r.upstreams[1]
    r.upstreams[0].models = frozenset({"a"})
    r.upstreams[1].models = frozenset({"b"})
    assert r.pick(Route(b"x", [], "a")) is r.upstreams[0]
    with pytest.raises(AttributeError, match="keeps no prefix tree"):
        r.tree  # noqa: B018


def test_weighted_rendezvous_shares_keys_by_weight():
    from prefixgate.gateway.proxy.upstream import Upstream

    ups = [Upstream(URLS[0], weight=3.0), Upstream(URLS[1], weight=1.0)]
    r = UpstreamRouter(ups, policy="rendezvous")
    wins = sum(r.pick(Route(f"key {i}".encode(), [])) is ups[0] for i in range(4000))
    assert 2800 < wins < 3200  # 3/4 of the keys, within a few percent


def test_full_upstreams_are_skipped_and_all_full_is_429():
    from prefixgate.gateway.proxy.upstream import Upstream

    ups = [Upstream(URLS[0], max_in_flight=1), Upstream(URLS[1], max_in_flight=2)]
    r = UpstreamRouter(ups, policy="least_loaded")
    ups[0].in_flight = 1
    assert r.pick(_route("x")) is ups[1]
    ups[1].in_flight = 2
    assert r.pick(_route("x")) is None
    err = r.exhausted([], "every upstream failed")
    assert err.status == 429 and err.code == "upstream_busy" and err.retry_after == 1.0


def test_all_full_upstreams_tell_when_the_soonest_frees_a_place():
    # the 429 of "every upstream is full" said 1 s whatever the upstreams' pace; it now says
    # when the first place is estimated to free: each upstream's requests' ages against its
    # recent hold time (a clock of its own here, no sleeping)
    from prefixgate.gateway.proxy.upstream import Upstream
    from prefixgate.gateway.tenancy.slot_wait import SlotClock

    now = [100.0]
    ups = [Upstream(URLS[0], max_in_flight=1), Upstream(URLS[1], max_in_flight=1)]
    for u, hold in zip(ups, (10.0, 6.0), strict=True):
        u.slots = SlotClock(clock=lambda: now[0])
        token = u.slots.take()
        now[0] += hold  # one request held it this long
        u.slots.give(token)
    for u in ups:  # both full again, their requests 2 s old
        u.slots.take()
        u.in_flight = 1
    now[0] += 2.0
    r = UpstreamRouter(ups, policy="least_loaded")
    assert r.pick(_route("x")) is None
    err = r.exhausted([], "every upstream failed")
    assert err.status == 429 and err.code == "upstream_busy"
    assert err.retry_after == 4.0  # the second upstream: 6 s hold - 2 s held


@pytest.mark.parametrize("high", [10, 354, 1 << 20])
def test_prompt_text_cut_to_max_chars_is_the_whole_text_cut(high: int) -> None:
    # a token-id prompt is joined only as far as max_chars needs; the text is the same
    rng = random.Random(high)
    for n in (0, 1, 5, 900, 1024, 1025, 3000):
        ids = [rng.randrange(high) for _ in range(n)]
        whole = ",".join(map(str, ids))
        assert prompt_text({"prompt": ids}) == whole
        for max_chars in (1, 2, 63, 64, 4096):
            assert prompt_text({"prompt": ids}, max_chars) == whole[:max_chars]
    # ids that are not plain ints keep their own text
    assert prompt_text({"prompt": [1, True, 2.0]}) == "1,True,2.0"
    assert prompt_text({"prompt": [1, True, 2.0]}, 6) == "1,True"
    assert prompt_text({"messages": [{"role": "user", "content": "hi"}]}, 4) == "user"
