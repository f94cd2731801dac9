"""KV cache events: what the prefix cache stores and drops, published in vLLM's event format.

Wire format (vLLM ``vllm/distributed/kv_events.py``, so one consumer follows prefixgate and
vLLM engines alike):

- a ZeroMQ PUB socket sends one message per engine step that changed the cache, three frames:
  ``[topic, seq, payload]``; ``seq`` is 8 bytes big-endian, +1 per batch; ``payload`` is a
  msgspec msgpack ``KVEventBatch(ts, events)`` (an array, as vLLM's): ``ts`` Unix seconds of the step, ``events``
  tagged (``"type"``) ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``;
- ``BlockStored.block_hashes`` are the engine's own chained block keys
  (``block_hash.hash_block_tokens``: parent key, token ids, and the cache salt in block 0),
  each as ``block_key_bytes`` (16 bytes, big-endian: vLLM's ``bytes`` form of a hash); a run of
  consecutive blocks of one chain is one event (``parent_block_hash`` the key before the run,
  ``token_ids`` the run's tokens, ``block_size`` tokens per block); ``lora_id`` /
  ``lora_name`` are ``None``; ``medium`` is ``"GPU"``, vLLM's name of the engine's own KV
  cache (the tier attention reads), on every device;
- a ZeroMQ ROUTER socket (the replay endpoint) answers a DEALER/REQ request ``[b"", start]``
  (``start``: 8 bytes big-endian) with ``[b"", seq, payload]`` for each buffered batch with
  ``seq >= start``, then ``[b"", END_SEQ, latest]`` (vLLM's replay; vLLM sends ``b""`` as
  the end's last frame, prefixgate the 8-byte number of its latest batch, published or
  dropped, so a consumer learns of a dropped last batch without waiting for the next one);
- prefixgate's addition, the snapshot: the request ``[b"", SNAPSHOT_REQUEST]`` is answered
  with ``[b"", seq, payload]`` messages all carrying the same ``seq`` S, whose events (the first
  is ``AllBlocksCleared``) store every block the cache holds after batch S, then ``END_SEQ``.
  A consumer that starts late, or whose replay cannot cover a gap, applies the snapshot and
  continues from batch S + 1. A vLLM engine answers it with ``END_SEQ`` alone (no snapshot
  support: the 8 bytes read as a start sequence far ahead).

Load reports (prefixgate's addition, so every gateway learns each engine's load, not only
the requests it sent itself; as NVIDIA Dynamo's engines publish ``ForwardPassMetrics``): the
same PUB socket sends ``[topic, LOAD_SEQ, payload]``, ``payload`` a msgpack ``EngineLoad``
(requests running and waiting, prefill tokens queued net of the prefix cache, KV blocks used,
the measured token rates) measured in the engine thread at the end of a step whenever the
number of running or waiting requests changed, else at most every ``load_interval_s`` while
it is busy (``EngineConfig.kv_events_load_interval_s``; 0: none). Load reports carry no batch
sequence number, are not replayed and never advance the batches' sequence; a consumer that
reads only vLLM's events skips the ``LOAD_SEQ`` frame (or the engine is run with reports
off).

Sequence numbers start at the publisher's start time in microseconds (Unix), so a restarted
engine's batches never continue an old sequence: a consumer sees a gap (or a step back) and
resyncs rather than stacking a new cache on the old one. The first batch holds
``AllBlocksCleared`` (the pool starts empty).

The step loop never waits on the network: ``KVEventCollector`` (engine thread) gathers a step's
changes, numbers the batch and hands it to a bounded queue (``put_nowait``); a full queue drops
the batch, counted in ``dropped_batches`` / ``dropped_events``, and its sequence number is
skipped so consumers see the gap. ``ZmqEventPublisher``'s thread encodes, publishes, keeps the
last ``buffer_steps`` batches for replay and serves replay and snapshot requests. The snapshot
comes from the collector's mirror of the cache (every stored entry not yet removed, updated as
batches are numbered, dropped ones included), copied under a lock the engine thread takes once
per step that changed the cache.

Torch-free (pyzmq and msgspec only): the gateway's index imports the format from here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from prefixgate.engine.block_hash import BlockContent, block_key_bytes
from prefixgate.engine.config import derive_replay_endpoint

__all__ = [
    "END_SEQ",
    "LOAD_SEQ",
    "MEDIUM_GPU",
    "SNAPSHOT_REQUEST",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineLoad",
    "KVEventBatch",
    "KVEventCollector",
    "ParsedEvent",
    "ZmqEventPublisher",
    "derive_replay_endpoint",
    "parse_batch",
    "parse_load",
]

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
"""vLLM's ``medium`` of the engine's own KV cache (the one attention reads)."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-answer marker (vLLM's)."""

LOAD_SEQ = (-2).to_bytes(8, "big", signed=True)
"""The sequence frame of a load report (``EngineLoad``; not a batch, never replayed)."""

SNAPSHOT_REQUEST = b"SNAPSHOT"
"""The request frame (8 bytes) that asks the replay socket for a full snapshot."""

_SNAPSHOT_CHUNK = 512  # blocks per snapshot message
_LOAD_WAKE = "load"  # the queue item that tells the publisher a load report is waiting


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's payload: ``ts`` (Unix seconds) and its events, a msgpack
    array ``[ts, events]`` as vLLM's ``EventBatch`` (``array_like``: vLLM's own decoder
    refuses a map); the events are tagged maps."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events (tagged union: ``"type"`` is the class name)."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one chain entered the prefix cache.

    ``block_hashes[i]`` keys the ``i``-th block, whose tokens are
    ``token_ids[i * block_size:(i + 1) * block_size]``; ``parent_block_hash`` keys the block
    before ``block_hashes[0]`` (``None``: the chain's first block).
    """

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Cache entries left the prefix cache (one entry per hash; a hash cached twice, e.g. a
    chain recomputed after its parent was evicted, is removed once per entry)."""

    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The cache holds nothing (before this event's batch continues)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class EngineLoad(msgspec.Struct, gc=False, frozen=True):
    """One engine's load at the end of a step (a load report's payload).

    Attributes:
        ts: Unix seconds of the measurement.
        n: report number (+1 per report of this publisher; restarts at 0 with the engine).
        num_running: requests running (prefilling or decoding), pin jobs included.
        num_waiting: requests waiting for a seat (preempted ones included).
        queued_prefill_tokens: prompt tokens still to compute: a waiting request's tokens
            beyond the prefix its engine holds now, a running request's uncomputed tokens
            beyond one (the scheduler's ``queued_prefill_tokens`` net of cache hits).
        running_decodes: running requests past their prefill.
        kv_blocks_used: KV blocks held by requests and pins.
        kv_blocks_total: KV blocks in the pool.
        prefill_tokens_per_s, decode_tokens_per_s: the scheduler's measured rates (``None``
            before measured).
        last_seq: the last KV event batch numbered when measured.
    """

    ts: float
    n: int
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    running_decodes: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    last_seq: int = -1


def parse_load(payload: bytes) -> EngineLoad:
    """Decode a load report's payload.

    Raises:
        ValueError: not msgpack, or not an ``EngineLoad``.
    """
    try:
        return msgspec.msgpack.decode(payload, type=EngineLoad)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not an engine load report: {exc}") from None


# ---- the engine side ------------------------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    """A numbered batch on its way to the publisher thread."""

    seq: int
    ts: float
    events: list[tuple[str, list[BlockContent]]]  # ("stored" | "removed" | "cleared", entries)


class KVEventCollector:
    """Engine-thread side: gathers the pool's changes and numbers one batch per flush.

    Installed as ``BlockPool.events``; ``flush()`` runs once per engine step. Nothing here
    waits on I/O: a full queue drops the batch (counted; its sequence number is skipped).

    Args:
        block_size: tokens per block (``BlockStored.block_size``).
        max_queue_batches: bound of the queue to the publisher thread (batches, >= 1).
        first_seq: sequence number of the first batch (``None``: now in Unix microseconds).

    Attributes:
        queue: the bounded queue of numbered batches (the publisher thread's input).
        last_seq: the last batch's sequence number (published or dropped).
        last_dropped_seq: the last dropped batch's number (``None``: none dropped).
        dropped_batches, dropped_events: batches (and their events) dropped on a full queue.
        load_reports, dropped_load_reports: load reports made / dropped on a full queue.
    """

    def __init__(
        self, block_size: int, max_queue_batches: int, first_seq: int | None = None
    ) -> None:
        if max_queue_batches < 1:
            raise ValueError(f"max_queue_batches must be >= 1, got {max_queue_batches}")
        self.block_size = block_size
        self.queue: queue.Queue[_Pending | str | None] = queue.Queue(maxsize=max_queue_batches)
        self._events: list[tuple[str, list[BlockContent]]] = []
        self._mirror: dict[int, BlockContent] = {}  # cache uid -> content (what a snapshot shows)
        self._lock = threading.Lock()
        start = time.time_ns() // 1000 if first_seq is None else first_seq
        self.last_seq = start - 1
        self.last_dropped_seq: int | None = None
        self.dropped_batches = 0
        self.dropped_events = 0
        self.load_reports = 0
        self.dropped_load_reports = 0
        self._latest_load: EngineLoad | None = None
        self._load_queued = False
        self._events.append(("cleared", []))

    # BlockEventSink
    def stored(self, content: BlockContent) -> None:
        """Record a newly cached block (runs of one chain merge into one event)."""
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "stored" and last[1][-1].key == content.parent_key:
            last[1].append(content)
        else:
            self._events.append(("stored", [content]))

    def removed(self, content: BlockContent) -> None:
        """Record a dropped cache entry."""
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "removed":
            last[1].append(content)
        else:
            self._events.append(("removed", [content]))

    def flush(self) -> None:
        """Number the changes since the last flush as one batch and queue it (never blocks)."""
        if not self._events:
            return
        events, self._events = self._events, []
        mirror = self._mirror
        with self._lock:
            for kind, entries in events:
                if kind == "stored":
                    for c in entries:
                        mirror[c.uid] = c
                elif kind == "removed":
                    for c in entries:
                        mirror.pop(c.uid, None)
                else:
                    mirror.clear()
            self.last_seq += 1
            item = _Pending(self.last_seq, time.time(), events)
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.dropped_batches += 1
            self.last_dropped_seq = item.seq
            self.dropped_events += len(events)

    def report_load(self, load: EngineLoad) -> None:
        """Hand the publisher a load report (never blocks). At most one wake-up for load
        reports is in the queue at a time and the publisher sends the latest report when it
        takes it, so reports take at most one of the queue's places; a full queue drops it
        (counted in ``dropped_load_reports``)."""
        with self._lock:
            self._latest_load = load
            self.load_reports += 1
            queued, self._load_queued = self._load_queued, True
        if queued:
            return
        try:
            self.queue.put_nowait(_LOAD_WAKE)
        except queue.Full:
            with self._lock:
                self._load_queued = False
                self.dropped_load_reports += 1

    def take_load(self) -> EngineLoad | None:
        """The latest load report (the publisher thread, on a wake-up)."""
        with self._lock:
            self._load_queued = False
            return self._latest_load

    def snapshot(self) -> tuple[int, list[BlockContent]]:
        """``(S, entries)``: every cache entry held after batch ``S`` (any thread)."""
        with self._lock:
            return self.last_seq, list(self._mirror.values())


def _stored_event(entries: list[BlockContent], block_size: int) -> BlockStored:
    parent = entries[0].parent_key
    return BlockStored(
        block_hashes=[block_key_bytes(c.key) for c in entries],
        parent_block_hash=None if parent is None else block_key_bytes(parent),
        token_ids=[t for c in entries for t in c.token_ids],
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
    )


def _to_events(
    events: Iterable[tuple[str, list[BlockContent]]], block_size: int
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for kind, entries in events:
        if kind == "stored":
            out.append(_stored_event(entries, block_size))
        elif kind == "removed":
            out.append(BlockRemoved([block_key_bytes(c.key) for c in entries], MEDIUM_GPU))
        else:
            out.append(AllBlocksCleared())
    return out


def _snapshot_chunks(entries: list[BlockContent], block_size: int) -> Iterator[list[Any]]:
    """The snapshot's events in messages of at most ``_SNAPSHOT_CHUNK`` blocks; the first
    starts with ``AllBlocksCleared``; a chain's consecutive entries share one event."""
    chunk: list[Any] = [AllBlocksCleared()]
    n = 0
    run: list[BlockContent] = []
    for c in entries:
        if run and (run[-1].key != c.parent_key or n >= _SNAPSHOT_CHUNK):
            chunk.append(_stored_event(run, block_size))
            run = []
        if n >= _SNAPSHOT_CHUNK:
            yield chunk
            chunk, n = [], 0
        run.append(c)
        n += 1
    if run:
        chunk.append(_stored_event(run, block_size))
    yield chunk


class ZmqEventPublisher:
    """Publishes a ``KVEventCollector``'s batches on ZeroMQ and serves replay and snapshots.

    Both sockets bind (the engine is the stable side; consumers connect). A ``*`` port binds
    an ephemeral one: ``endpoint`` / ``replay_endpoint`` are the bound addresses.

    Args:
        collector: the engine's collector (its queue is this publisher's input).
        endpoint: PUB address to bind (``tcp://host:port``, ``tcp://host:*``, ``ipc://``,
            ``inproc://``).
        replay_endpoint: ROUTER address to bind (``None``: ``derive_replay_endpoint``).
        buffer_steps: batches kept for replay (>= 1).
        topic: the first frame of each message (subscribers filter on its prefix).
        hwm: ZeroMQ send high-water mark of the PUB socket (messages per subscriber; beyond
            it ZeroMQ drops for that subscriber, who sees the gap).

    Raises:
        ValueError: an endpoint that cannot be bound (in use, bad address).
    """

    def __init__(
        self,
        collector: KVEventCollector,
        endpoint: str,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        topic: str = "",
        hwm: int = 100_000,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self.collector = collector
        self._topic = topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        replay = derive_replay_endpoint(endpoint) if replay_endpoint is None else replay_endpoint
        try:
            self._pub.bind(endpoint)
            self._router.bind(replay)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events: cannot bind {endpoint!r} / {replay!r}: {exc}") from None
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.published_batches = 0
        self.published_load_reports = 0
        self.last_published_seq: int | None = None
        self.replays_served = 0
        self.snapshots_served = 0
        self._running = True
        self._held = threading.Event()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefixgate-kv-events", daemon=True)
        self._thread.start()

    # ---- control --------------------------------------------------------------------------
    def hold(self) -> None:
        """Stop taking batches off the queue (replay and snapshots are still served): the
        queue fills and further batches are dropped, as under a stalled publisher."""
        self._held.set()

    def release(self) -> None:
        """Undo ``hold``."""
        self._held.clear()

    def close(self, timeout_s: float = 1.0) -> None:
        """Publish what is queued (at most ``timeout_s`` seconds), stop the thread, close."""
        if not self._running:
            return
        self._held.clear()
        self._running = False
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("kv events publisher did not stop within %.1f s", timeout_s)
        self._close_sockets()

    def stats(self) -> dict[str, int]:
        """Counters: batches published / dropped (and dropped events), replays and snapshots
        served, the last sequence number, load reports published / dropped."""
        c = self.collector
        return {
            "kv_events_published_batches": self.published_batches,
            "kv_events_dropped_batches": c.dropped_batches,
            "kv_events_dropped_events": c.dropped_events,
            "kv_events_replays": self.replays_served,
            "kv_events_snapshots": self.snapshots_served,
            "kv_events_last_seq": c.last_seq,
            "kv_events_load_reports": self.published_load_reports,
            "kv_events_dropped_load_reports": c.dropped_load_reports,
        }

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()

    # ---- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        q = self.collector.queue
        while True:
            try:
                while self._router.poll(0):
                    self._serve(encoder)
            except zmq.ZMQError:
                logger.exception("kv events: replay request failed")
            if self._held.is_set():
                time.sleep(0.01)
                continue
            try:
                item = q.get(timeout=0.02)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if item is None:
                return
            if isinstance(item, str):  # _LOAD_WAKE
                load = self.collector.take_load()
                try:
                    if load is not None:
                        self._pub.send_multipart((self._topic, LOAD_SEQ, encoder.encode(load)))
                        self.published_load_reports += 1
                except zmq.ZMQError:
                    logger.exception("kv events: a load report was not published")
                continue
            try:
                events = _to_events(item.events, self.collector.block_size)
                payload = encoder.encode(KVEventBatch(ts=item.ts, events=events))
                self._pub.send_multipart((self._topic, item.seq.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 - never let one batch stop the publisher
                logger.exception("kv events: batch %d not published", item.seq)
                continue
            self._buffer.append((item.seq, payload))
            self.published_batches += 1
            self.last_published_seq = item.seq

    def _serve(self, encoder: msgspec.msgpack.Encoder) -> None:
        frames = self._router.recv_multipart()
        if len(frames) != 3:
            logger.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        client, _, request = frames
        send = self._router.send_multipart
        if request == SNAPSHOT_REQUEST:
            seq, entries = self.collector.snapshot()
            seq_bytes = seq.to_bytes(8, "big")
            for events in _snapshot_chunks(entries, self.collector.block_size):
                payload = encoder.encode(KVEventBatch(ts=time.time(), events=events))
                send((client, b"", seq_bytes, payload))
            self.snapshots_served += 1
        elif len(request) == 8:
            start = int.from_bytes(request, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    send((client, b"", seq.to_bytes(8, "big"), payload))
            self.replays_served += 1
        else:
            logger.warning("kv events: malformed replay request %r", request[:16])
        known = [
            q for q in (self.last_published_seq, self.collector.last_dropped_seq) if q is not None
        ]
        send((client, b"", END_SEQ, max(known).to_bytes(8, "big") if known else b""))


# ---- the consumer side -------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ParsedEvent:
    """One event of a batch, whatever the layout it came in.

    Attributes:
        kind: ``"stored"``, ``"removed"`` or ``"cleared"``.
        block_hashes: the hashes as sent (``bytes`` or ``int``).
        parent_block_hash: ``BlockStored``'s parent (``None`` otherwise or for a first block).
        block_size: ``BlockStored``'s tokens per block (0 otherwise).
        medium: the storage tier (``None`` when not sent).
        token_ids: ``BlockStored``'s tokens (``block_size`` per hash; ``()`` otherwise).
        extra_keys: ``BlockStored``'s per-block extra keys as vLLM publishes them (untagged:
            a cache salt is the bare string; ``None`` when not sent, as prefixgate's).
    """

    kind: str
    block_hashes: tuple[bytes | int, ...] = ()
    parent_block_hash: bytes | int | None = None
    block_size: int = 0
    medium: str | None = None
    token_ids: tuple[int, ...] = ()
    extra_keys: tuple[Any, ...] | None = None


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
)
_REMOVED_FIELDS = ("block_hashes", "medium")


def _event_fields(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        return str(raw.get("type")), raw
    if isinstance(raw, list | tuple) and raw:
        tag = str(raw[0])
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        return tag, dict(zip(names, raw[1:], strict=False))
    raise ValueError(f"not a KV event: {raw!r:.80}")


def parse_batch(payload: bytes) -> tuple[float, list[ParsedEvent]]:
    """Decode a batch payload in any of vLLM's layouts (maps, or the legacy ``array_like``
    batch and events), skipping event types it does not know.

    Returns:
        ``(ts, events)``: the batch's Unix time and its events in order.

    Raises:
        ValueError: not msgpack, or not a batch.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a msgpack KV event batch: {exc}") from None
    if isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
    else:
        raise ValueError("not a KV event batch")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise ValueError("not a KV event batch (ts, events)")
    out: list[ParsedEvent] = []
    for item in events:
        tag, f = _event_fields(item)
        if tag == "BlockStored":
            hashes = f.get("block_hashes")
            if not isinstance(hashes, list):
                raise ValueError("BlockStored.block_hashes is not a list")
            tokens = f.get("token_ids")
            extra = f.get("extra_keys")
            out.append(
                ParsedEvent(
                    "stored",
                    tuple(hashes),
                    f.get("parent_block_hash"),
                    int(f.get("block_size") or 0),
                    f.get("medium"),
                    tuple(tokens) if isinstance(tokens, list) else (),
                    tuple(extra) if isinstance(extra, list) else None,
                )
            )
        elif tag == "BlockRemoved":
            hashes = f.get("block_hashes")
            if not isinstance(hashes, list):
                raise ValueError("BlockRemoved.block_hashes is not a list")
            out.append(ParsedEvent("removed", tuple(hashes), medium=f.get("medium")))
        elif tag == "AllBlocksCleared":
            out.append(ParsedEvent("cleared"))
    return float(ts), out
