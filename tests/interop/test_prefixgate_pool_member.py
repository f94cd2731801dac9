"""prefixgate's engine as a member of a vLLM pool: vLLM's own event classes decode its KV
events (live stream and replay), and its ``/metrics`` carry vLLM's pool metric names.

A script run by the vLLM environment's python subscribes to a prefixgate engine's PUB socket
(aidreams-260k, 8-token blocks), decodes every batch with ``msgspec.msgpack.Decoder(type=
vllm.distributed.kv_events.KVEventBatch)``, then asks the replay socket for every batch from
0 and decodes those too. Load reports (prefixgate's addition, sequence ``-2``) are not vLLM
batches: the script skips them by their sequence frame, as a vLLM consumer must (or the
engine runs with ``kv_events_load_interval_s=0``). The blocks vLLM's classes read equal the
engine's cached blocks.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import httpx
import pytest
from prefixgate.engine.block_hash import block_key_bytes
from prefixgate.gateway.local.serving import LOCAL
from support.kv_replicas import serve_kv_replicas

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

DECODER = textwrap.dedent(
    """
    import json, sys
    import msgspec, zmq
    from vllm.distributed.kv_events import (
        AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch)

    pub, replay = sys.argv[1], sys.argv[2]
    LOAD = (-2).to_bytes(8, "big", signed=True)
    END = (-1).to_bytes(8, "big", signed=True)
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    print("ready", flush=True)
    sys.stdin.readline()  # the test's traffic is done
    live, loads, kinds = [], 0, {}
    while sub.poll(1000):
        topic, seq, payload = sub.recv_multipart()
        if seq == LOAD:
            loads += 1
            continue
        batch = dec.decode(payload)
        live.append(int.from_bytes(seq, "big"))
        for ev in batch.events:
            kinds[type(ev).__name__] = kinds.get(type(ev).__name__, 0) + 1
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    held, replayed = {}, []
    while True:
        assert dealer.poll(10000), "no replay answer"
        frames = dealer.recv_multipart()
        seq, payload = frames[-2], frames[-1]
        if seq == END:
            break
        replayed.append(int.from_bytes(seq, "big"))
        for ev in dec.decode(payload).events:
            if isinstance(ev, BlockStored):
                assert ev.block_size > 0 and len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                for h in ev.block_hashes:
                    held[h.hex()] = held.get(h.hex(), 0) + 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    held[h.hex()] -= 1
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
    held = {h: n for h, n in held.items() if n}
    print(json.dumps({"live": live, "replayed": replayed, "loads": loads,
                      "kinds": kinds, "held": held}), flush=True)
    """
)


@pytest.fixture(scope="module")
def engine_server(aidreams_path):
    yield from serve_kv_replicas(aidreams_path, "aidreams-260k", 8, 24, [{}])


def test_vllm_classes_decode_prefixgate_events(vllm_server, engine_server, tmp_path):
    (srv,) = engine_server
    pub = srv.app[LOCAL].engine.engine.kv_events
    script = tmp_path / "decode.py"
    script.write_text(DECODER)
    proc = subprocess.Popen(
        [str(vllm_server.python), str(script), pub.endpoint, pub.replay_endpoint],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        for i in range(12):  # a 24-block pool: later prompts evict earlier ones
            body = {
                "model": "aidreams-260k",
                "prompt": f"Once upon a time {i % 5} " * 6,
                "max_tokens": 2,
            }
            assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
        out, err = proc.communicate("done\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    assert got["live"] and set(got["live"]) <= set(got["replayed"])
    assert got["kinds"].get("BlockStored") and got["kinds"].get("BlockRemoved")
    engine = srv.app[LOCAL].engine.engine  # idle now: its pool is still
    want: dict[str, int] = {}
    for c in engine.kv_cache_manager.pool.cached_contents():
        k = block_key_bytes(c.key).hex()
        want[k] = want.get(k, 0) + 1
    assert got["held"] == want


def test_pool_metric_names(engine_server):
    (srv,) = engine_server
    text = httpx.get(f"{srv.url}/metrics").text
    samples = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0]
            samples[name] = (line, float(line.rsplit(" ", 1)[1]))
    assert {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    } <= set(samples)
    assert 0.0 <= samples["vllm:kv_cache_usage_perc"][1] <= 1.0
    info = samples["vllm:cache_config_info"][0]
    assert 'block_size="8"' in info and 'num_gpu_blocks="24"' in info
    assert 'model_name="aidreams-260k"' in samples["vllm:num_requests_waiting"][0]
