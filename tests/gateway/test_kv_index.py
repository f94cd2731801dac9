"""The exact prefix-cache index (gateway/proxy/kv_index.py) following a real engine's KV events.

aidreams-260k engines publish on loopback ZeroMQ ports (``kv_events="tcp://127.0.0.1:*"``) with
small KV pools, so the workloads evict. Each scenario ends with the index's multiset of block
hashes equal to the engine's cached blocks (``BlockPool.cached_contents``), and the pool whole:

- a workload with evictions, followed live;
- predicted cached tokens (``KVIndex.predict``) equal the engine's ``num_cached_tokens`` for
  every request of a salted, evicting workload, on chat and completions prompts rendered by the
  gateway's own functions (``prompts.render_chat`` / ``completion_prompts``, salts from
  ``auth.effective_salt``), and ``prompt_block_hashes`` equals the engine's blocks;
- a consumer stopped while the engine works, then restarted: the gap is found and replayed;
- a consumer that starts late: snapshot;
- batches dropped past the engine's queue bound: the gap is found, replay cannot cover it,
  snapshot;
- a replay buffer rolled over: snapshot; an engine restarted on the same ports: snapshot;
- a pinned prefix (the prefix API's path) is predicted; two replicas each match their own;
  AsyncEngine publishes and its shutdown frees the ports;
- a vLLM-style publisher (legacy ``array_like`` batches, int hashes, no snapshot) is followed;
  a replica without a replay endpoint is followed inexactly (its gaps counted);
- vLLM's layouts (maps and the legacy ``array_like``) parse; the modules import without torch;
- load reports: the index holds the engine's latest (running, waiting, queued prefill net of
  the cache, KV blocks used), reported when its requests change, idle at the end; off with
  ``kv_events_load_interval_s=0``; they never advance or disturb the batches' sequence.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
from prefixgate.engine.block_hash import block_key_bytes, prompt_block_hashes
from prefixgate.engine.kv_events import parse_batch
from prefixgate.engine.protocol import PinRequest
from prefixgate.gateway.proxy.kv_index import KVIndex, prompt_block_keys
from prefixgate.gateway.tenancy.keys import effective_salt

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BS = 8


def make_engine(path: str, **cfg):
    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.llm_engine import LLMEngine

    cfg.setdefault("block_size", BS)
    cfg.setdefault("num_kv_blocks", 24)
    cfg.setdefault("kv_events", "tcp://127.0.0.1:*")
    return LLMEngine(EngineConfig(path, **cfg))


def greedy(n: int):
    from prefixgate.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


_ids = iter(range(10**9))


def run(engine, prompts: list[list[int]], salt: str | None = None, max_tokens: int = 4) -> list:
    """Run ``prompts`` together to completion; their final outputs in order."""
    rids = []
    for p in prompts:
        rid = f"r{next(_ids)}"
        engine.add_request(rid, p, greedy(max_tokens), cache_salt=salt)
        rids.append(rid)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[r] for r in rids]


def workload(rng: random.Random, n: int, prefixes: list[list[int]]) -> list[list[int]]:
    return [
        rng.choice(prefixes) + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))]
        for _ in range(n)
    ]


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def seeded_prefixes(seed: int) -> tuple[random.Random, list[list[int]]]:
    """``random.Random(seed)`` and three 24-token prefixes drawn from it (BOS, then 23 ids)."""
    rng = random.Random(seed)
    return rng, [[1] + rand_ids(rng, 23) for _ in range(3)]


def engine_blocks(engine) -> Counter:
    """The engine's cached blocks as the index counts them (hash -> entries)."""
    return Counter(block_key_bytes(c.key) for c in engine.kv_cache_manager.pool.cached_contents())


def index_for(engine, name: str = "e0", **kw) -> KVIndex:
    kw.setdefault("probe_interval_s", 0.1)
    return KVIndex({name: (engine.kv_events.endpoint, engine.kv_events.replay_endpoint)}, **kw)


def wait_synced(index: KVIndex, engine, name: str = "e0", timeout_s: float = 60.0) -> dict:
    """Wait until the index has applied the engine's last batch (a deadline, not a timing
    assertion); returns the replica's counters."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = index.stats()["replicas"][name]
        if st["synced"] and index.applied_seq(name) == engine.kv_events.collector.last_seq:
            return st
        time.sleep(0.02)
    raise AssertionError(f"index never caught up: {index.stats()}")


@contextmanager
def synced_index(engine, prompts: list[list[int]]) -> Iterator[KVIndex]:
    """``index_for(engine)`` once ``prompts`` have run and the index has applied them."""
    with index_for(engine) as index:
        run(engine, prompts)
        wait_synced(index, engine)
        yield index


def mirrors(index: KVIndex, engine) -> dict:
    """``wait_synced``, then the index's blocks of ``e0`` are the engine's; the counters."""
    st = wait_synced(index, engine)
    assert index.blocks("e0") == engine_blocks(engine)
    return st


@pytest.fixture
def engines(aidreams_path, pool_whole):
    """``make(**cfg)`` builds engines; each is checked whole and shut down after the test."""
    made = []

    def make(**cfg):
        e = make_engine(aidreams_path, **cfg)
        made.append(e)
        return e

    yield make
    for e in made:
        pool_whole(e)
        e.shutdown()


def test_index_equals_engine_blocks_after_evicting_workload(engines):
    engine = engines()
    rng = random.Random(1)
    prefixes = [[1] + rand_ids(rng, 23) for _ in range(4)]
    with index_for(engine) as index:
        for _ in range(8):
            run(engine, workload(rng, 3, prefixes))
        st = wait_synced(index, engine)
        assert engine.stats()["prefix_cache_evictions"] > 0
        assert index.blocks("e0") == engine_blocks(engine)
        # gaps may be > 0: batches published before the subscription reached the engine
        # (ZeroMQ's slow joiner) are replayed
        assert st["unknown_removals"] == 0 and st["bad_batches"] == 0
        assert st["snapshots"] == 1 and st["batches_applied"] > 0
        assert engine.stats()["kv_events_dropped_batches"] == 0
        stats = index.stats()
        assert stats["events_applied"] == st["events_applied"] > 0 and stats["lag_s"] >= 0


def test_predicted_cached_tokens_equal_engine_reported(engines, aidreams_path):
    """Chat and completions prompts rendered by the gateway's own code, two tenants' salts
    (one sub-partitioned by a request cache_salt), an evicting pool: prediction == report."""
    from prefixgate.engine.tokenizer import Tokenizer
    from prefixgate.gateway.wire.prompts import completion_prompts, render_chat

    tok = Tokenizer.from_pretrained(aidreams_path)
    engine = engines(num_kv_blocks=32)
    rng = random.Random(2)
    systems = [
        "You are a careful assistant. Answer briefly and kindly, in plain words.",
        "You dream of electric sheep and of gentle machines humming in the night.",
    ]
    texts = [
        "Once upon a time there was a little robot who loved the sea.",
        "The nodes of the gentle machine were glowing softly in the dark room.",
    ]
    salts = [None, effective_salt("tenant-a", None), effective_salt("tenant-a", "team-1")]
    prompts: list[tuple[list[int], str | None]] = []
    for _ in range(30):
        salt = rng.choice(salts)
        if rng.random() < 0.5:
            messages = [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": f"question {rng.randrange(4)}"},
            ]
            ids = asyncio.run(render_chat(tok, messages))
        else:
            text = rng.choice(texts) + f" chapter {rng.randrange(4)}"
            ids = asyncio.run(completion_prompts(tok, text))[0]
        prompts.append((ids, salt))
    hits = misses = 0
    with index_for(engine) as index:
        for ids, salt in prompts:
            wait_synced(index, engine)
            predicted = index.predict(ids, BS, salt)["e0"]
            (out,) = run(engine, [ids], salt)
            assert out.num_cached_tokens == predicted, (len(ids), salt)
            hits += predicted > 0
            misses += predicted == 0
        mirrors(index, engine)
    assert hits >= 10 and misses >= 3
    assert engine.stats()["prefix_cache_evictions"] > 0


def test_pinned_prefix_is_predicted(engines, aidreams_path):
    """A registered prefix (the gateway pins its rendered ids but the last, under the key's
    salt): the index sees its blocks; a chat on it is predicted as the engine serves it."""
    from prefixgate.engine.tokenizer import Tokenizer
    from prefixgate.gateway.wire.prompts import render_chat

    tok = Tokenizer.from_pretrained(aidreams_path)
    engine = engines(num_kv_blocks=32)
    salt = effective_salt("tenant-b", None)
    system = [{"role": "system", "content": "You are the keeper of the gentle machine's nodes."}]
    prefix_ids = asyncio.run(render_chat(tok, system, add_generation_prompt=False))
    chat = asyncio.run(render_chat(tok, [*system, {"role": "user", "content": "hello there"}]))
    with index_for(engine) as index:
        pin = engine.pin_prefix(PinRequest(prefix_ids[:-1], ttl_s=600, cache_salt=salt))
        assert pin.num_tokens >= 2 * BS
        wait_synced(index, engine)
        predicted = index.predict(chat, BS, salt)["e0"]
        assert predicted >= pin.num_tokens
        assert index.predict(chat, BS, None)["e0"] == 0  # another partition
        (out,) = run(engine, [chat], salt)
        assert out.num_cached_tokens == predicted
        engine.unpin_prefix(pin.id)


def test_prompt_block_hashes_are_the_engine_blocks(engines, aidreams_path):
    """The shared function gives the keys the engine caches for a prompt (one greedy token:
    only the prompt's full blocks are cached), salted or not; salts give other keys."""
    from prefixgate.engine.tokenizer import Tokenizer
    from prefixgate.gateway.wire.prompts import completion_prompts, render_chat

    tok = Tokenizer.from_pretrained(aidreams_path)
    messages = [
        {"role": "system", "content": "You are a careful assistant who answers in plain words."},
        {"role": "user", "content": "Tell me about the gentle machine and its glowing nodes."},
    ]
    chat = asyncio.run(render_chat(tok, messages))
    completion = asyncio.run(completion_prompts(tok, "Once upon a time, a little robot sang."))[0]
    for ids in (chat, completion):
        for salt in (None, effective_salt("acme", None), effective_salt("acme", "prod")):
            engine = engines(num_kv_blocks=64)
            run(engine, [ids], salt, max_tokens=1)
            keys = prompt_block_hashes(ids, BS, salt)
            assert len(keys) == len(ids) // BS >= 2
            assert engine_blocks(engine) == Counter(block_key_bytes(k) for k in keys)
            assert prompt_block_keys(ids, BS, salt) == [
                block_key_bytes(k) for k in keys[: (len(ids) - 1) // BS]
            ]
            engine.shutdown()
    assert prompt_block_hashes(chat, BS, "a")[0] != prompt_block_hashes(chat, BS, "b")[0]
    assert prompt_block_hashes(chat, BS, None)[0] != prompt_block_hashes(chat, BS, "")[0]


def test_stopped_consumer_restarted_replays_the_gap(engines):
    engine = engines()
    rng, prefixes = seeded_prefixes(3)
    with synced_index(engine, workload(rng, 3, prefixes)) as index:
        index.stop()
        before = engine.kv_events.collector.last_seq
        for _ in range(5):
            run(engine, workload(rng, 3, prefixes))
        assert engine.kv_events.collector.last_seq > before  # batches the consumer missed
        assert index.applied_seq("e0") == before
        index.start()
        st = mirrors(index, engine)
        assert st["gaps"] >= 1 and st["replays"] >= 1 and st["snapshots"] == 1


def test_late_consumer_starts_from_snapshot(engines):
    engine = engines()
    rng, prefixes = seeded_prefixes(4)
    for _ in range(5):
        run(engine, workload(rng, 3, prefixes))
    assert engine_blocks(engine)  # something is cached
    with index_for(engine) as index:
        st = mirrors(index, engine)
        assert st["snapshots"] == 1 and st["resyncs"] >= 1
        run(engine, workload(rng, 3, prefixes))  # and it follows live from there
        mirrors(index, engine)


def test_batches_dropped_past_the_queue_bound_are_detected(engines):
    engine = engines(kv_events_queue_size=2)
    rng, prefixes = seeded_prefixes(5)
    with synced_index(engine, workload(rng, 2, prefixes)) as index:
        engine.kv_events.hold()  # a stalled publisher: the step loop keeps going, batches drop
        t_before = engine.timing["steps"]
        for _ in range(5):
            run(engine, workload(rng, 3, prefixes))
        assert engine.timing["steps"] > t_before
        dropped = engine.stats()["kv_events_dropped_batches"]
        assert dropped > 0 and engine.stats()["kv_events_dropped_events"] >= dropped
        assert engine.kv_events.collector.last_dropped_seq == engine.kv_events.collector.last_seq
        engine.kv_events.release()
        # the last batch was dropped: no later batch shows the gap; the probe's replay answer
        # names the latest batch, so the index still finds it and resyncs (snapshot)
        st = mirrors(index, engine)
        assert st["gaps"] >= 1 and st["snapshots"] >= 2  # the first sync, then the gap's
        run(engine, workload(rng, 2, prefixes))  # and it follows live again
        mirrors(index, engine)


def test_rolled_over_replay_buffer_falls_back_to_snapshot(engines):
    engine = engines(kv_events_buffer_steps=2)
    rng, prefixes = seeded_prefixes(6)
    with synced_index(engine, workload(rng, 2, prefixes)) as index:
        index.stop()
        for _ in range(4):
            run(engine, workload(rng, 3, prefixes))
        index.start()
        st = mirrors(index, engine)
        assert st["gaps"] >= 1 and st["snapshots"] >= 2


def test_engine_restart_on_the_same_ports_resyncs(engines, pool_whole):
    first = engines()
    rng, prefixes = seeded_prefixes(7)
    pub, replay = first.kv_events.endpoint, first.kv_events.replay_endpoint
    with KVIndex({"e0": (pub, replay)}, probe_interval_s=0.1) as index:
        run(first, workload(rng, 3, prefixes))
        wait_synced(index, first)
        assert index.blocks("e0")
        pool_whole(first)
        first.shutdown()
        second = engines(kv_events=pub, kv_events_replay=replay)
        run(second, workload(rng, 2, prefixes))
        st = wait_synced(index, second)
        assert st["gaps"] >= 1 and st["snapshots"] >= 2
        assert index.blocks("e0") == engine_blocks(second)


def test_two_replicas_match_each_their_own_blocks(engines):
    a, b = engines(), engines()
    rng = random.Random(8)
    shared = [1] + rand_ids(rng, 31)  # 4 blocks
    only_a = shared + rand_ids(rng, 17)
    with KVIndex(
        {n: (e.kv_events.endpoint, e.kv_events.replay_endpoint) for n, e in (("a", a), ("b", b))},
        probe_interval_s=0.1,
    ) as index:
        run(a, [only_a])
        run(b, [shared + [7]])
        wait_synced(index, a, "a")
        wait_synced(index, b, "b")
        keys = prompt_block_keys(only_a + [9], BS)
        assert index.match(keys) == {"a": 6, "b": 4}
        assert index.predict(only_a + [9], BS) == {"a": 48, "b": 32}
        assert index.predict(only_a + [9], BS, "salted") == {"a": 0, "b": 0}
        index.remove_replica("b")
        assert index.match(keys) == {"a": 6}


def test_async_engine_publishes_and_shutdown_unbinds(aidreams_path, pool_whole):
    """AsyncEngine (what ``prefixgate serve --kv-events`` runs): its step thread publishes;
    ``shutdown()`` stops the publisher and frees its ports (a new engine binds them)."""
    from prefixgate.engine.async_engine import AsyncEngine

    async def scenario() -> tuple[str, str]:
        engine = AsyncEngine(
            model=aidreams_path, block_size=BS, num_kv_blocks=24, kv_events="tcp://127.0.0.1:*"
        )
        llm = engine.engine
        with index_for(llm) as index:
            prompt = [1] + rand_ids(random.Random(9), 30)
            async for _ in engine.generate(prompt, greedy(3), "a0"):
                pass
            await asyncio.to_thread(wait_synced, index, llm)
            assert index.blocks("e0") == engine_blocks(llm)
            assert index.predict(prompt, BS)["e0"] == 24
        pool_whole(engine)
        endpoints = (llm.kv_events.endpoint, llm.kv_events.replay_endpoint)
        await engine.shutdown()
        return endpoints

    pub, replay = asyncio.run(scenario())
    again = make_engine(aidreams_path, kv_events=pub, kv_events_replay=replay)
    assert again.kv_events.endpoint == pub
    with pytest.raises(ValueError, match="cannot bind"):  # the port is taken: said at start
        make_engine(aidreams_path, kv_events=pub)
    again.shutdown()


# ---- format (no engine) -----------------------------------------------------------------------


def wait_load(index: KVIndex, engine, name: str = "e0", timeout_s: float = 60.0):
    """Until the index holds the engine's latest load report (a deadline, not a timing
    assertion); returns it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = index.load(name)
        if got is not None and got[0].n == engine._load_n:
            return got[0]
        time.sleep(0.02)
    raise AssertionError(f"load report {engine._load_n} never arrived: {index.load(name)}")


def test_load_reports_follow_the_engines_queue(engines):
    engine = engines(max_num_seqs=2, num_kv_blocks=48)
    rng = random.Random(11)
    prefix = [1] + rand_ids(rng, 31)  # 4 blocks
    with index_for(engine) as index:
        run(engine, [prefix + rand_ids(rng, 5)])  # cached now
        wait_synced(index, engine)
        idle = wait_load(index, engine)
        assert (idle.num_running, idle.num_waiting, idle.queued_prefill_tokens) == (0, 0, 0)
        prompts = [prefix + rand_ids(rng, 5) for _ in range(3)] + [rand_ids(rng, 20)]
        for i, p in enumerate(prompts):
            engine.add_request(f"load{i}", p, greedy(3))
        engine.step()  # two seats: two run, two wait (one with the cached prefix)
        got = wait_load(index, engine)
        sched = engine.scheduler
        assert (
            (got.num_running, got.num_waiting)
            == (2, 2)
            == (
                sched.num_running,
                sched.num_waiting,
            )
        )
        # the waiting ones' tokens less the prefix the engine holds for them (32 cached for
        # the prefix's request, none for the other), the running ones' uncomputed beyond one
        waiting = sum(
            r.num_tokens - (32 if r.all_token_ids[:32] == prefix else 0) for r in sched.waiting
        )
        running = sum(
            r.num_tokens - r.num_computed_tokens
            for r in sched.running
            if r.num_tokens - r.num_computed_tokens > 1
        )
        assert got.queued_prefill_tokens == waiting + running
        assert waiting < sum(r.num_tokens for r in sched.waiting)  # the hit is netted out
        assert got.kv_blocks_used == engine.kv_cache_manager.pool.num_used
        assert got.kv_blocks_total == 48 and got.last_seq == engine.kv_events.collector.last_seq
        while engine.has_unfinished_requests():
            engine.step()
        done = wait_load(index, engine)
        assert (done.num_running, done.num_waiting, done.queued_prefill_tokens) == (0, 0, 0)
        mirrors(index, engine)  # the reports never disturbed the batches
        st = index.stats()["replicas"]["e0"]
        assert st["bad_batches"] == 0 and st["load_reports"] >= 3 and st["load"] == done
        # the engine counts what it published: the reports the index received (the publisher
        # counts one just after sending it, and a report sent just after the index was read
        # arrives a moment later: wait until the two agree), at most the reports made (the
        # publisher sends the latest of those made since its last wake-up)
        deadline = time.monotonic() + 30
        while True:
            received = index.stats()["replicas"]["e0"]["load_reports"]
            published = engine.stats()["kv_events_load_reports"]
            if received == published:
                break
            assert time.monotonic() < deadline, (engine.stats(), index.stats())
            time.sleep(0.01)
        assert received == published <= engine._load_n
    quiet = engines(kv_events_load_interval_s=0)
    with index_for(quiet) as index:
        run(quiet, [prefix])
        wait_synced(index, quiet)
        assert index.load("e0") is None and quiet.stats()["kv_events_load_reports"] == 0


def test_parse_batch_reads_vllm_layouts():
    h1, h2 = (1 << 63) + 5, 42

    class Cleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
        pass

    legacy = msgspec.msgpack.encode(
        _LegacyBatch(
            1.5,
            [
                Cleared(),
                _LegacyStored([h1, h2], None, [1] * 8, 4, None, "GPU"),
                _LegacyRemoved([h2], "GPU"),
            ],
        )
    )
    maps = msgspec.msgpack.encode(
        {
            "ts": 2.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"x" * 32],
                    "parent_block_hash": None,
                    "token_ids": [1, 2],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
                {"type": "BlockMigrated", "block_hashes": [b"y"]},  # unknown: skipped
            ],
        }
    )
    ts, events = parse_batch(legacy)
    assert ts == 1.5 and [e.kind for e in events] == ["cleared", "stored", "removed"]
    assert events[1].block_hashes == (h1, h2) and events[1].block_size == 4
    assert events[2].block_hashes == (h2,)
    ts, events = parse_batch(maps)
    assert ts == 2.0 and len(events) == 1 and events[0].block_hashes == (b"x" * 32,)
    with pytest.raises(ValueError):
        parse_batch(b"\xc1")
    with pytest.raises(ValueError):
        parse_batch(msgspec.msgpack.encode({"ts": "x", "events": 3}))


class _LegacyStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list
    parent_block_hash: int | None
    token_ids: list
    block_size: int
    lora_id: int | None
    medium: str | None


class _LegacyRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list
    medium: str | None


class _LegacyBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list


class VLLMStub:
    """A publisher that behaves as vLLM's ZmqEventPublisher: legacy ``array_like`` batches with
    64-bit int hashes, sequence numbers from 0, a replay socket that knows no snapshot (the
    snapshot frame reads as a start sequence far ahead: only the end marker comes back)."""

    def __init__(self, topic: bytes | None = None) -> None:
        """``topic``: ``None`` answers replays as vLLM before 0.32 (``[b"", seq, payload]``);
        bytes as vLLM 0.32 (``[b"", topic, seq, payload]``, the end ``[b"", b"", END, b""]``),
        and PUB messages carry it as their first frame."""
        import threading

        import zmq

        self.topic = topic

        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoints = (
            self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
            self.router.getsockopt_string(zmq.LAST_ENDPOINT),
        )
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def publish(self, *events) -> None:
        payload = msgspec.msgpack.encode(_LegacyBatch(time.time(), list(events)))
        with self.lock:
            seq = len(self.buffer)
            self.buffer.append((seq, payload))
        self.pub.send_multipart((self.topic or b"", seq.to_bytes(8, "big"), payload))

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self.lock:
                batches = [b for b in self.buffer if b[0] >= first]
            end = (-1).to_bytes(8, "big", signed=True)
            if self.topic is None:
                for seq, payload in batches:
                    self.router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                self.router.send_multipart((client, b"", end, b""))
                continue
            for seq, payload in batches:
                self.router.send_multipart(
                    (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                )
            self.router.send_multipart((client, b"", b"", end, b""))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def test_index_follows_a_vllm_publisher():
    """Legacy layout, int hashes, no snapshot support: the index rebuilds from the replay
    buffer (an inexact resync, counted), then follows live; a removed copy of a hash stored
    twice leaves the other copy held."""
    stub = VLLMStub()
    h = [(1 << 63) + i for i in range(5)]
    stub.publish(_LegacyStored(h[:3], None, list(range(12)), 4, None, "GPU"))
    stub.publish(_LegacyStored(h[:1], None, list(range(4)), 4, None, "GPU"))  # a second copy
    try:
        with KVIndex({"v": stub.endpoints}, probe_interval_s=0.1) as index:
            deadline = time.monotonic() + 30
            while index.applied_seq("v") != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            st = index.stats()["replicas"]["v"]
            assert st["inexact_resyncs"] == 1 and st["snapshots"] == 0
            assert index.match(h) == {"v": 3}
            stub.publish(
                _LegacyRemoved(h[:1], "GPU"), _LegacyStored(h[3:5], h[2], [0] * 8, 4, None, "GPU")
            )
            while index.applied_seq("v") != 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert index.match(h) == {"v": 5}
            assert index.blocks("v") == Counter(h)
            stub.publish(_LegacyRemoved(h[:1], "GPU"))
            while index.applied_seq("v") != 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert index.match(h) == {"v": 0}
            assert index.stats()["unknown_removals"] == 0
    finally:
        stub.close()


def test_replica_without_replay_endpoint_follows_inexactly():
    """Only a PUB endpoint: the index follows from the first batch it gets; a gap cannot be
    closed, so it is counted (gaps, inexact_resyncs) and the stream is followed on."""
    stub = VLLMStub()
    h = [7, 8, 9]
    try:
        with KVIndex({"v": stub.endpoints[0]}, probe_interval_s=0.1) as index:
            deadline = time.monotonic() + 30
            while index.applied_seq("v") is None and time.monotonic() < deadline:
                stub.publish(_LegacyStored(h[:1], None, [0] * 4, 4, None, "GPU"))
                time.sleep(0.05)
            seq = index.applied_seq("v")
            assert seq is not None and index.match(h) == {"v": 1}
            with stub.lock:  # a batch that never reaches the subscriber
                stub.buffer.append((len(stub.buffer), b""))
            stub.publish(_LegacyStored(h[1:], h[0], [0] * 8, 4, None, "GPU"))
            while index.applied_seq("v") == seq and time.monotonic() < deadline:
                time.sleep(0.02)
            st = index.stats()["replicas"]["v"]
            assert st["gaps"] == 1 and st["inexact_resyncs"] == 2 and st["resync_failures"] == 0
            assert index.match(h) == {"v": 3}
    finally:
        stub.close()


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError):
        prompt_block_hashes("abc", BS)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        prompt_block_hashes([1, -2], BS)
    with pytest.raises(ValueError):
        prompt_block_hashes([1, 2], 0)
    with pytest.raises(TypeError):
        prompt_block_hashes([1, 2], BS, cache_salt=3)  # type: ignore[arg-type]
    index = KVIndex(start=False)
    with pytest.raises(ValueError):
        index.add_replica("", "tcp://127.0.0.1:1")
    index.add_replica("x", "tcp://127.0.0.1:1")
    with pytest.raises(ValueError):
        index.add_replica("x", "tcp://127.0.0.1:2")
    with pytest.raises(KeyError):
        index.remove_replica("nope")
    index.close()
    from prefixgate.engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_events"):
        EngineConfig(kv_events="http://x:1")
    with pytest.raises(ValueError, match="port"):
        EngineConfig(kv_events="tcp://127.0.0.1")
    with pytest.raises(ValueError, match="kv_events_replay needs"):
        EngineConfig(kv_events_replay="tcp://127.0.0.1:5")
    with pytest.raises(ValueError, match="runner='generate'"):
        EngineConfig(kv_events="tcp://127.0.0.1:5557", runner="pooling")
    with pytest.raises(ValueError, match="kv_events_queue_size"):
        EngineConfig(kv_events="tcp://127.0.0.1:5557", kv_events_queue_size=0)
    with pytest.raises(ValueError, match="kv_events_load_interval_s"):
        EngineConfig(kv_events_load_interval_s=-0.1)
    with pytest.raises(TypeError, match="kv_events_load_interval_s"):
        EngineConfig(kv_events_load_interval_s="0.1")  # type: ignore[arg-type]
    from prefixgate.engine.kv_events import parse_load

    with pytest.raises(ValueError, match="load report"):
        parse_load(msgspec.msgpack.encode({"ts": 1.0}))


def test_modules_import_without_torch(tmp_path):
    blocked = ("torch", "safetensors", "tokenizers", "jinja2", "numpy", "triton", "transformers")
    (tmp_path / "sitecustomize.py").write_text(
        f"import sys\nfor n in {blocked!r}:\n    sys.modules[n] = None\n"
    )
    code = textwrap.dedent(
        """
        from prefixgate.gateway.proxy.kv_index import KVIndex, prompt_block_keys
        from prefixgate.engine.block_hash import prompt_block_hashes
        import prefixgate.engine.kv_events
        print(len(prompt_block_keys(list(range(40)), 8, "s")))
        KVIndex(start=False).close()
        try:
            import torch
        except ModuleNotFoundError:
            print("no torch")
        """
    )
    import os

    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "no", "torch"]
