"""The exact index following vLLM 0.32's KV events, and vLLM's block hashes reproduced.

A stub publisher speaks vLLM 0.32's wire (``tests/gateway/test_kv_index.VLLMStub`` with a
topic: replay answers ``[b"", topic, seq, payload]``, the end ``[b"", b"", END_SEQ, b""]``;
``array_like`` batches of tagged-map events carrying ``extra_keys``); the hashes are vLLM's own,
pinned from vLLM 0.32 (``hash_block_tokens`` under ``sha256`` with the default seed,
``maybe_convert_block_hash``). The live check against a real vLLM is ``tests/interop``.
"""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
import zmq
from prefixgate.engine.kv_events import ParsedEvent, parse_batch
from prefixgate.gateway.proxy.kv_index import (
    HASH_PREFIXGATE,
    HASH_UNKNOWN,
    HASH_VLLM_BYTES,
    HASH_VLLM_INT,
    KVIndex,
    detect_hash_scheme,
    replay_frames,
)
from prefixgate.gateway.proxy.policies.precise_routing import PreciseRoute
from prefixgate.gateway.proxy.vllm_block_hash import (
    vllm_block_hash,
    vllm_external_hash,
    vllm_prompt_block_hashes,
)

from tests.gateway.test_kv_index import VLLMStub, _LegacyRemoved, _LegacyStored

# vLLM 0.32 (PYTHONHASHSEED unset): hash_block_tokens(sha256, parent, range(16k, 16k+16), extra)
GOLDEN_BLOCK0 = 3262291359910021016
GOLDEN_BLOCK1 = 7142137847444424233
GOLDEN_SALTED_BLOCK0 = 12616911002861201973  # extra keys (("cache_salt", "tenant-a"),)


class _Stored(_LegacyStored, array_like=False, tag="BlockStored", omit_defaults=True):
    """vLLM 0.32's ``BlockStored``: a tagged map, the legacy fields and three more."""

    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class _Removed(_LegacyRemoved, array_like=False, tag="BlockRemoved", omit_defaults=True):
    group_idx: int | None = None


def test_vllm_block_hashes_equal_vllms():
    ids = list(range(40))
    assert vllm_prompt_block_hashes(ids, 16) == [GOLDEN_BLOCK0, GOLDEN_BLOCK1]
    assert vllm_prompt_block_hashes(ids, 16, "tenant-a")[0] == GOLDEN_SALTED_BLOCK0
    assert vllm_prompt_block_hashes(ids, 16, "")[0] == GOLDEN_BLOCK0  # empty salt: none
    as_bytes = vllm_prompt_block_hashes(ids, 16, as_int=False)
    assert [int.from_bytes(b, "big") & (2**64 - 1) for b in as_bytes] == [
        GOLDEN_BLOCK0,
        GOLDEN_BLOCK1,
    ]
    with pytest.raises(ValueError):
        vllm_prompt_block_hashes(ids, 0)


def test_hash_scheme_is_told_by_the_events():
    digest = vllm_block_hash(None, range(16))
    vllm = ParsedEvent("stored", (GOLDEN_BLOCK0,), None, 16, "GPU", tuple(range(16)), None)
    assert detect_hash_scheme(vllm) == HASH_VLLM_INT
    raw = ParsedEvent("stored", (digest,), None, 16, "GPU", tuple(range(16)), None)
    assert detect_hash_scheme(raw) == HASH_VLLM_BYTES
    salted = ParsedEvent(
        "stored", (GOLDEN_SALTED_BLOCK0,), None, 16, None, tuple(range(16)), (("tenant-a",),)
    )
    assert detect_hash_scheme(salted) == HASH_VLLM_INT
    other_seed = vllm_external_hash(vllm_block_hash(None, range(16), seed="42"))
    assert other_seed != GOLDEN_BLOCK0
    ev = ParsedEvent("stored", (other_seed,), None, 16, None, tuple(range(16)), None)
    assert detect_hash_scheme(ev) == HASH_UNKNOWN
    child = ParsedEvent("stored", (GOLDEN_BLOCK1,), GOLDEN_BLOCK0, 16, None, tuple(range(16)))
    assert detect_hash_scheme(child) is None  # no parent bytes: cannot tell yet
    assert detect_hash_scheme(ParsedEvent("stored", (b"k" * 16,), None, 4)) == HASH_PREFIXGATE


def test_replay_frames_layouts():
    end = (-1).to_bytes(8, "big", signed=True)
    assert replay_frames([b"", b"S" * 8, b"p"]) == (b"S" * 8, b"p")
    assert replay_frames([b"", b"kv", b"S" * 8, b"p"]) == (b"S" * 8, b"p")
    assert replay_frames([b"", b"", end, b""]) == (end, b"")
    with pytest.raises(ValueError):
        replay_frames([b"", b"a", b"b", b"c", b"d"])


def _wait(pred, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_index_follows_vllm_032_events_and_routes_on_their_hashes():
    """vLLM 0.32's replay layout (a topic frame) syncs (no failures); the index holds vLLM's
    hashes, the scheme is verified, and a route's keys for that replica are vLLM's."""
    stub = VLLMStub(topic=b"kv")
    ids = list(range(40))
    h = vllm_prompt_block_hashes(ids, 16, "tenant-a")
    stub.publish(_Stored(h, None, ids[:32], 16, None, "GPU", None, [("tenant-a",), None]))
    try:
        with KVIndex({"v": stub.endpoints}, topic="kv", probe_interval_s=0.1) as index:
            _wait(lambda: index.applied_seq("v") == 0)
            st = index.stats()["replicas"]["v"]
            assert st["synced"] and st["resync_failures"] == 0 and st["blocks"] == 2
            assert index.hash_scheme("v") == HASH_VLLM_INT
            route = PreciseRoute(None, [])
            route.token_ids = ids
            keys = route.keys("tenant-a", 16, index.hash_scheme("v"))
            assert keys == h and index.match(keys) == {"v": 2}
            assert index.match(route.keys(None, 16, HASH_VLLM_INT)) == {"v": 0}
            stub.publish(_Removed(h[1:], "GPU"))  # live, with the topic frame
            _wait(lambda: index.applied_seq("v") == 1)
            assert index.match(keys) == {"v": 1}
    finally:
        stub.close()


def test_parse_batch_reads_vllm_032_events():
    class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    payload = msgspec.msgpack.encode(
        Batch(1.0, [_Stored([5], None, [1, 2], 2, None, "GPU", None, [("s",)])], 0)
    )
    _, events = parse_batch(payload)
    assert events[0].token_ids == (1, 2) and events[0].extra_keys == (["s"],)


def test_a_replay_that_never_answers_is_logged(caplog):
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind("tcp://127.0.0.1:*")
    router.bind("tcp://127.0.0.1:*")
    eps = (pub.getsockopt_string(zmq.LAST_ENDPOINT), router.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        with caplog.at_level(logging.WARNING, logger="prefixgate.gateway.proxy.kv_index"):
            with KVIndex({"v": eps}, request_timeout_s=0.2) as index:
                _wait(lambda: index.stats()["resync_failures"] >= 1, 10)
        assert any("not synced" in r.getMessage() for r in caplog.records)
    finally:
        pub.close(linger=0)
        router.close(linger=0)
        ctx.term()
