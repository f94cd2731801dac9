"""The exact prefix-cache index: which blocks each engine replica holds, from its KV events.

``KVIndex`` subscribes to the KV event endpoints of a model's engine replicas (prefixgate's
``--kv-events``, or vLLM's ``--kv-events-config``: the format is vLLM's, ``engine/kv_events.py``)
and keeps, per replica, the multiset of block hashes it holds (``BlockStored`` adds one entry per
hash, ``BlockRemoved`` takes one away, ``AllBlocksCleared`` empties it), plus the inverted
index hash -> replicas. ``match(block_hashes)`` answers, for every replica, how many leading
blocks of a request it holds; ``load(name)`` is the replica's latest load report (``kv_events.EngineLoad``: the same
numbers in every gateway that follows the engine). ``predict(token_ids, block_size,
cache_salt)`` hashes a prompt exactly as a prefixgate engine does
(``block_hash.prompt_block_hashes``, the one function both sides share) and turns the match into the prompt tokens the engine will serve from its cache.
One index serves one model (the same tokens hash the same under every model).

Exactness: every batch carries a sequence number (+1 per batch). A replica's batches are
applied strictly in order; a gap (a batch dropped by the engine's bounded queue or ZeroMQ's
high-water mark, or missed while the consumer was stopped) is detected by its number and
resynced: first by replay (the engine's ROUTER sends its buffered batches from the first
missing one), and when the replay cannot cover the gap (batches dropped before they were
published, or rolled out of the buffer) by a snapshot of every block the engine holds, after
which the batches that follow it are applied. A replica with no state (a consumer that starts
late) starts from a snapshot. A sequence that steps back is an engine restart: snapshot. A
probe every ``probe_interval_s`` (a replay request from the next batch) catches a lost last batch
on an engine that has gone idle. vLLM engines answer a snapshot request with nothing: the
index then rebuilds from their replay buffer (counted as ``inexact_resyncs``). Replay answers
come in two layouts (``replay_frames``: vLLM 0.32 repeats the topic frame); a resync that
fails is logged (the first of a run, then every tenth) as well as counted.

Hashes: each replica's ``BlockStored`` events tell how it hashes blocks (``hash_scheme``):
prefixgate's 16-byte keys, or vLLM's sha256 hashes (64-bit ints by default), verified on the
first event that starts a chain (``detect_hash_scheme``, ``vllm_block_hash``); a replica whose
hashes verify as neither is ``HASH_UNKNOWN`` (logged) and routed without prediction.

The consumer runs in one daemon thread (pyzmq; no asyncio, no torch): ``match`` / ``predict``
/ ``stats`` are thread-safe and never wait on the network. Counters (``stats()``) are the
metrics: batches and events applied, gaps, resyncs (replays, snapshots), restarts, failures,
removals of unknown hashes (0 when exact), lag.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from prefixgate.engine.block_hash import (
    BLOCK_KEY_BYTES,
    block_key_bytes,
    num_reusable_blocks,
    prompt_block_hashes,
)
from prefixgate.engine.config import derive_replay_endpoint
from prefixgate.engine.kv_events import (
    END_SEQ,
    LOAD_SEQ,
    SNAPSHOT_REQUEST,
    EngineLoad,
    ParsedEvent,
    parse_batch,
    parse_load,
)
from prefixgate.gateway.proxy.urls import normalize_url
from prefixgate.gateway.proxy.vllm_block_hash import (
    DEFAULT_NONE_HASH_SEED,
    vllm_block_hash,
    vllm_external_hash,
)

__all__ = [
    "parse_kv_events_spec",
    "HASH_PREFIXGATE",
    "HASH_UNKNOWN",
    "HASH_VLLM_BYTES",
    "HASH_VLLM_INT",
    "BlockHash",
    "KVIndex",
    "detect_hash_scheme",
    "prompt_block_keys",
    "replay_frames",
]

logger = logging.getLogger(__name__)

BlockHash = bytes | int
"""A block hash as KV events carry it: ``bytes`` (prefixgate: 16 bytes; vLLM: a digest) or an
``int`` (vLLM's 64-bit form)."""

_RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # backoff after a failed resync


def prompt_block_keys(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """The block hashes a prefixgate engine will look up for a prompt, as its events publish
    them: the first ``num_reusable_blocks(len(token_ids), block_size)`` full blocks (the engine
    always computes the last token, so a prompt of exactly k blocks reuses at most k - 1).

    Raises:
        TypeError / ValueError: see ``block_hash.prompt_block_hashes``.
    """
    keys = prompt_block_hashes(token_ids, block_size, cache_salt)
    return [block_key_bytes(k) for k in keys[: num_reusable_blocks(len(token_ids), block_size)]]


def replay_frames(frames: Sequence[bytes]) -> tuple[bytes, bytes]:
    """``(seq frame, payload)`` of one replay answer as a DEALER receives it.

    Two layouts are in use: ``[b"", seq, payload]`` (prefixgate's engine, vLLM before 0.32)
    and ``[b"", topic, seq, payload]`` (vLLM 0.32: the answer repeats the PUB message's
    three frames, the end marker as ``[b"", b"", END_SEQ, b""]``).

    Raises:
        ValueError: any other layout.
    """
    if len(frames) == 3 and frames[0] == b"":
        return frames[1], frames[2]
    if len(frames) == 4 and frames[0] == b"":
        return frames[2], frames[3]
    raise ValueError(f"unknown replay answer layout ({len(frames)} frames)")


HASH_PREFIXGATE = "prefixgate"
"""A replica whose events carry prefixgate's 16-byte keys (``block_hash.block_key_bytes``)."""
HASH_VLLM_INT = "vllm"
"""A vLLM replica: sha256 hashes, the events' low-64-bit ints (``vllm_block_hash``)."""
HASH_VLLM_BYTES = "vllm-bytes"
"""A vLLM replica publishing the 32-byte hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""
HASH_UNKNOWN = "unknown"
"""Hashes this gateway cannot reproduce (another algorithm or seed): no prediction."""


def _vllm_extra(keys: Any) -> tuple[bool, tuple[Any, ...] | None]:
    """``(verifiable, vLLM's tagged extra keys)`` of a block 0 from the event's untagged
    entry; not verifiable when it holds more than a cache salt (LoRA, multimodal)."""
    if keys is None:
        return True, None
    if isinstance(keys, list | tuple) and len(keys) == 1 and isinstance(keys[0], str):
        return True, (("cache_salt", keys[0]),)
    return False, None


def detect_hash_scheme(ev: ParsedEvent, seed: str = DEFAULT_NONE_HASH_SEED) -> str | None:
    """The hash scheme a ``BlockStored`` event shows, or ``None`` when it cannot tell.

    prefixgate's keys are 16 bytes. A vLLM hash (an int, or 32 bytes) is verified on an
    event that starts a chain (no parent): its first block is hashed as vLLM does
    (``vllm_block_hash``, ``seed``) and compared; a mismatch is ``HASH_UNKNOWN``."""
    if ev.kind != "stored" or not ev.block_hashes:
        return None
    first = ev.block_hashes[0]
    if isinstance(first, bytes) and len(first) == BLOCK_KEY_BYTES:
        return HASH_PREFIXGATE
    if ev.parent_block_hash is not None or len(ev.token_ids) < ev.block_size or ev.block_size < 1:
        return None
    verifiable, extra = _vllm_extra(ev.extra_keys[0] if ev.extra_keys else None)
    if not verifiable:
        return None
    digest = vllm_block_hash(None, ev.token_ids[: ev.block_size], extra, seed)
    as_int = isinstance(first, int)
    if vllm_external_hash(digest, as_int) == first:
        return HASH_VLLM_INT if as_int else HASH_VLLM_BYTES
    return HASH_UNKNOWN


@dataclass(slots=True)
class _Replica:
    """One engine's endpoints, blocks and sync state (mutated by the consumer thread)."""

    name: str
    endpoint: str
    replay_endpoint: str | None
    counts: dict[BlockHash, int] = field(default_factory=dict)
    applied_seq: int | None = None  # last batch applied (or the snapshot's)
    has_state: bool = False  # a snapshot / replay has given a starting point
    last_live_seq: int | None = None  # last sequence number seen on the PUB stream
    latest_seq: int | None = None  # the engine's latest batch, as its last replay answer said
    needs_sync: bool = True
    next_probe: float = 0.0
    failures: int = 0
    block_size: int = 0
    hash_scheme: str | None = None  # detect_hash_scheme's verdict (None: not known yet)
    counters: Counter[str] = field(default_factory=Counter)
    lag_s: float = 0.0
    load: EngineLoad | None = None  # the engine's latest load report
    load_at: float = 0.0  # time.monotonic() when it arrived
    sub: Any = None
    dealer: Any = None


class KVIndex:
    """Exact index of the KV blocks a model's engine replicas hold, fed by their KV events.

    Args:
        replicas: replica name -> PUB endpoint, or ``(endpoint, replay_endpoint)``
            (``replay_endpoint`` ``None``: no replay or snapshot; the index then follows the
            stream from the first batch it receives and cannot close gaps: each is counted in
            ``gaps`` and ``inexact_resyncs``).
            More can be added with ``add_replica``.
        topic: topic prefix to subscribe to (vLLM's ``topic``; ``""`` = all).
        request_timeout_s: seconds to wait for each message of a replay / snapshot answer.
        probe_interval_s: seconds between catch-up probes of a replica (replay from its next
            batch), so a lost last batch is found even when the engine goes idle.
        start: start the consumer thread now (else call ``start()``).

    Raises:
        TypeError / ValueError: a bad replica name or endpoint.
    """

    def __init__(
        self,
        replicas: Mapping[str, str | tuple[str, str | None]] | None = None,
        *,
        topic: str = "",
        request_timeout_s: float = 1.0,
        probe_interval_s: float = 5.0,
        start: bool = True,
    ) -> None:
        if not request_timeout_s > 0 or not probe_interval_s > 0:
            raise ValueError("request_timeout_s and probe_interval_s must be > 0 seconds")
        self.topic = topic
        self.request_timeout_s = float(request_timeout_s)
        self.probe_interval_s = float(probe_interval_s)
        self._lock = threading.Lock()  # guards the data below (match vs. the consumer thread)
        self._replicas: dict[str, _Replica] = {}
        self._holders: dict[BlockHash, set[str]] = {}
        self._commands: list[tuple[str, Any]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._owned: list[Any] = []  # every socket the consumer thread opened
        for name, spec in (replicas or {}).items():
            endpoint, replay = (spec, None) if isinstance(spec, str) else spec
            self.add_replica(name, endpoint, replay)
        if start:
            self.start()

    # ---- replicas ---------------------------------------------------------------------------
    def add_replica(self, name: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Follow one more engine (its blocks are known once its snapshot has arrived).

        Raises:
            TypeError: non-string name or endpoint. ValueError: empty or duplicate name.
        """
        if not isinstance(name, str) or not isinstance(endpoint, str):
            raise TypeError("replica name and endpoint must be strings")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise TypeError("replay_endpoint must be a string or None")
        if not name:
            raise ValueError("replica name must not be empty")
        with self._lock:
            if name in self._replicas:
                raise ValueError(f"replica {name!r} is already indexed")
            self._replicas[name] = _Replica(name, endpoint, replay_endpoint)
            self._commands.append(("connect", name))

    def remove_replica(self, name: str) -> None:
        """Stop following ``name`` and forget its blocks.

        Raises:
            KeyError: unknown replica.
        """
        with self._lock:
            rep = self._replicas.pop(name)
            self._clear(rep)
            self._commands.append(("close", rep))

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    # ---- queries ----------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For every replica, how many leading blocks of ``block_hashes`` it holds.

        Args:
            block_hashes: a request's block hashes in chain order, in the form the replicas'
                events use (``prompt_block_keys`` for prefixgate engines).

        Returns:
            ``{replica: n}`` with ``block_hashes[:n]`` all held by that replica (0 when the
            first is not, or before the replica's first sync).
        """
        with self._lock:
            out = dict.fromkeys(self._replicas, 0)
            alive: set[str] | None = None
            for i, h in enumerate(block_hashes):
                holders = self._holders.get(h)
                if not holders:
                    break
                alive = set(holders) if alive is None else alive & holders
                if not alive:
                    break
                for name in alive:
                    out[name] = i + 1
            return out

    def predict(
        self, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
    ) -> dict[str, int]:
        """Prompt tokens each prefixgate replica will serve from its prefix cache.

        Args:
            token_ids: the prompt's token ids exactly as the engine receives them.
            block_size: the engines' block size.
            cache_salt: the engine request's cache salt (the gateway's ``effective_salt``).

        Returns:
            ``{replica: cached tokens}`` (a multiple of ``block_size``).

        Raises:
            TypeError / ValueError: see ``block_hash.prompt_block_hashes``.
        """
        keys = prompt_block_keys(token_ids, block_size, cache_salt)
        return {name: n * block_size for name, n in self.match(keys).items()}

    def blocks(self, name: str) -> Counter[BlockHash]:
        """The multiset of block hashes replica ``name`` holds (a copy).

        Raises:
            KeyError: unknown replica.
        """
        with self._lock:
            return Counter(self._replicas[name].counts)

    def block_size(self, name: str) -> int:
        """Tokens per block of replica ``name``, as its ``BlockStored`` events said (0 before
        its first stored block, or for an unknown replica)."""
        with self._lock:
            rep = self._replicas.get(name)
            return rep.block_size if rep is not None else 0

    def hash_scheme(self, name: str) -> str | None:
        """How replica ``name`` hashes blocks, as its events showed: ``HASH_PREFIXGATE``,
        ``HASH_VLLM_INT``, ``HASH_VLLM_BYTES``, ``HASH_UNKNOWN``, or ``None`` before a
        ``BlockStored`` event told (or an unknown replica)."""
        with self._lock:
            rep = self._replicas.get(name)
            return rep.hash_scheme if rep is not None else None

    def load(self, name: str) -> tuple[EngineLoad, float] | None:
        """Replica ``name``'s latest load report and when it arrived (``time.monotonic()``),
        or ``None`` before its first (an engine without load reports, or an unknown
        replica)."""
        with self._lock:
            rep = self._replicas.get(name)
            if rep is None or rep.load is None:
                return None
            return rep.load, rep.load_at

    def applied_seq(self, name: str) -> int | None:
        """The last batch applied for ``name`` (``None`` before its first sync).

        Raises:
            KeyError: unknown replica.
        """
        with self._lock:
            return self._replicas[name].applied_seq

    def readiness(self) -> dict[str, tuple[bool, str | None, int]]:
        """Per replica ``(synced, hash_scheme, block_size)``: what ``stats()`` says of each
        (``synced``, ``hash_scheme``) and ``block_size``, under one lock and without the
        counters (a routing pick reads it once per request)."""
        with self._lock:
            return {
                name: (rep.has_state and not rep.needs_sync, rep.hash_scheme, rep.block_size)
                for name, rep in self._replicas.items()
            }

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: ``replicas`` (per replica: ``synced``, ``applied_seq``,
        ``blocks`` (distinct hashes), ``batches_applied``, ``events_applied``, ``gaps``,
        ``resyncs``, ``replays``, ``snapshots``, ``inexact_resyncs``, ``restarts``,
        ``resync_failures``, ``bad_batches``, ``unknown_removals``, ``load_reports``,
        ``load`` (the latest ``EngineLoad`` or ``None``), ``lag_s`` (seconds from
        the last applied batch's step to its application), ``seq_lag`` (batches seen on the
        stream but not applied)) and the same counters summed over replicas (``lag_s``: the
        largest)."""
        with self._lock:
            per: dict[str, dict[str, Any]] = {}
            total: Counter[str] = Counter()
            lag = 0.0
            for name, rep in self._replicas.items():
                c = {k: rep.counters[k] for k in _COUNTERS}
                total.update(c)
                lag = max(lag, rep.lag_s)
                live, applied = rep.last_live_seq, rep.applied_seq
                per[name] = {
                    "synced": rep.has_state and not rep.needs_sync,
                    "hash_scheme": rep.hash_scheme,
                    "applied_seq": applied,
                    "blocks": len(rep.counts),
                    **c,
                    "load": rep.load,
                    "lag_s": rep.lag_s,
                    "seq_lag": 0 if live is None or applied is None else max(0, live - applied),
                }
            return {"replicas": per, **{k: total[k] for k in _COUNTERS}, "lag_s": lag}

    def apply_local(
        self, name: str, seq: int, events: Sequence[ParsedEvent], load: EngineLoad | None = None
    ) -> None:
        """Apply batch ``seq`` of replica ``name`` handed over in-process (``prefixgate sim``:
        no sockets, no consumer thread), in order, and ``load`` (its latest load report, if
        one came with it); the replica counts as synced from its first batch.

        Raises:
            KeyError: unknown replica.
        """
        with self._lock:
            rep = self._replicas[name]
            if events:
                self._apply_events(rep, list(events))
                rep.applied_seq = seq
                rep.counters["batches_applied"] += 1
            rep.has_state = True
            rep.needs_sync = False
            if load is not None:
                rep.load, rep.load_at = load, time.monotonic()
                rep.counters["load_reports"] += 1

    def request_sync(self, name: str) -> None:
        """Ask the consumer to catch ``name`` up now (a replay from its next batch).

        Raises:
            KeyError: unknown replica.
        """
        with self._lock:
            self._replicas[name].next_probe = 0.0
        self._commands.append(("wake", None))

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start (or restart after ``stop``) the consumer thread; each replica is caught up
        first (a replay from its next batch, or a snapshot when it has no state)."""
        if self._thread is not None:
            return
        self._stop.clear()
        with self._lock:
            for rep in self._replicas.values():
                rep.next_probe = 0.0
                self._commands.append(("connect", rep.name))
        self._thread = threading.Thread(target=self._run, name="prefixgate-kv-index", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the consumer thread and close its sockets; the blocks known are kept (a later
        ``start`` catches up on what was missed meanwhile)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()

    def close(self) -> None:
        """``stop`` and forget every replica."""
        self.stop()
        with self._lock:
            for rep in self._replicas.values():
                self._clear(rep)
            self._replicas.clear()
            self._commands.clear()

    def __enter__(self) -> KVIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the consumer thread ----------------------------------------------------------------
    def _run(self) -> None:
        ctx = zmq.Context()
        poller = zmq.Poller()
        socks: dict[Any, _Replica] = {}
        try:
            while not self._stop.is_set():
                self._commands_step(ctx, poller, socks)
                now = time.monotonic()
                with self._lock:
                    due = [
                        r
                        for r in self._replicas.values()
                        if r.sub is not None and r.next_probe <= now
                    ]
                for rep in due:
                    self._catch_up(ctx, rep, None)
                for sock, _ in poller.poll(50):
                    source = socks.get(sock)
                    if source is None:
                        continue
                    for _ in range(1000):  # bounded per round: other replicas get their turn
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if len(frames) == 3 and frames[1] == LOAD_SEQ:
                            self._on_load(source, frames[2])
                        elif len(frames) == 3:
                            seq = int.from_bytes(frames[1], "big")
                            self._on_live(ctx, source, seq, frames[2])
        finally:
            for sock in self._owned:
                sock.close(linger=0)
            self._owned = []
            with self._lock:
                for rep in self._replicas.values():
                    rep.sub = None
                    if rep.dealer is not None:
                        rep.dealer.close(linger=0)
                        rep.dealer = None
            ctx.term()

    def _socket(self, ctx: Any, kind: int) -> Any:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._owned = [s for s in self._owned if not s.closed]
        self._owned.append(sock)
        return sock

    def _commands_step(self, ctx: Any, poller: Any, socks: dict[Any, _Replica]) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for kind, arg in commands:
            if kind == "connect":
                with self._lock:
                    rep = self._replicas.get(arg)
                if rep is None or rep.sub is not None:
                    continue
                sub = self._socket(ctx, zmq.SUB)
                sub.setsockopt(zmq.RCVHWM, 0)  # no receive-side bound: ZeroMQ never drops here
                sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode("utf-8"))
                sub.connect(rep.endpoint)
                rep.sub = sub
                socks[sub] = rep
                poller.register(sub, zmq.POLLIN)
            elif kind == "close":
                rep = arg
                if rep.sub is not None:
                    poller.unregister(rep.sub)
                    socks.pop(rep.sub, None)
                    rep.sub.close(linger=0)
                    rep.sub = None
                if rep.dealer is not None:
                    rep.dealer.close(linger=0)
                    rep.dealer = None

    def _on_load(self, rep: _Replica, payload: bytes) -> None:
        """A load report from the PUB stream: kept as the replica's latest."""
        try:
            load = parse_load(payload)
        except ValueError:
            self._count(rep, "bad_batches")
            return
        with self._lock:
            rep.load, rep.load_at = load, time.monotonic()
            rep.counters["load_reports"] += 1

    def _on_live(self, ctx: Any, rep: _Replica, seq: int, payload: bytes) -> None:
        """A batch from the PUB stream."""
        last = rep.last_live_seq
        rep.last_live_seq = seq
        if last is not None and seq <= last:  # the stream stepped back: the engine restarted
            self._count(rep, "restarts", "gaps")
            rep.latest_seq = None
            with self._lock:
                self._clear(rep)
                rep.has_state = False
                rep.load = None
            self._catch_up(ctx, rep, None)
            return
        if rep.needs_sync or not rep.has_state:
            return  # the pending catch-up covers it
        if rep.applied_seq is not None and seq <= rep.applied_seq:
            return  # already applied (by a replay or snapshot)
        if rep.applied_seq is None or seq == rep.applied_seq + 1:
            if self._apply(rep, seq, payload):
                return
            self._count(rep, "bad_batches")
        self._count(rep, "gaps")
        if rep.replay_endpoint is None:  # no way to close the gap: carry on, inexact
            self._count(rep, "inexact_resyncs")
            if not self._apply(rep, seq, payload):
                self._count(rep, "bad_batches")
            return
        self._catch_up(ctx, rep, seq)

    def _catch_up(self, ctx: Any, rep: _Replica, known_seq: int | None) -> None:
        """Replay from the next batch; when that cannot close the gap, a snapshot.

        ``known_seq``: a batch seen on the stream that must be covered (``None``: a probe)."""
        rep.next_probe = time.monotonic() + self.probe_interval_s
        if rep.replay_endpoint is None:  # nothing to ask: follow the stream from here, inexact
            if not rep.has_state:
                with self._lock:
                    self._clear(rep)
                    rep.applied_seq, rep.has_state = None, True
                self._count(rep, "inexact_resyncs")
                self._synced(rep)
            return
        if not rep.has_state or rep.applied_seq is None:
            self._snapshot(ctx, rep)
            return
        start = rep.applied_seq + 1
        batches = self._request(ctx, rep, start.to_bytes(8, "big"))
        if batches is None:
            return
        contiguous = all(seq == start + i for i, (seq, _) in enumerate(batches))
        last = batches[-1][0] if batches else start - 1
        # every batch known to exist must be covered (a dropped last batch shows only here)
        need = max(known_seq or 0, rep.last_live_seq or 0, rep.latest_seq or 0)
        if contiguous and last >= need:
            if batches and known_seq is None:
                self._count(rep, "gaps")  # a probe found missed batches
            for seq, payload in batches:
                if not self._apply(rep, seq, payload):
                    self._count(rep, "bad_batches")
                    self._snapshot(ctx, rep)
                    return
            if batches or rep.needs_sync:
                self._count(rep, "resyncs", "replays")
            self._synced(rep)
            return
        if known_seq is None:
            self._count(rep, "gaps")
        self._snapshot(ctx, rep)

    def _snapshot(self, ctx: Any, rep: _Replica) -> None:
        answer = self._request(ctx, rep, SNAPSHOT_REQUEST)
        if answer is None:
            return
        if not answer:  # no snapshot support (a vLLM engine): rebuild from its replay buffer
            answer = self._request(ctx, rep, (0).to_bytes(8, "big"))
            if answer is None:
                return
            with self._lock:
                self._clear(rep)
            rep.applied_seq = None
            for seq, payload in answer:
                self._apply(rep, seq, payload)
            self._count(rep, "resyncs", "inexact_resyncs")
            rep.has_state = True
            self._synced(rep)
            return
        seq = answer[0][0]
        parsed: list[ParsedEvent] = []
        try:
            for s, payload in answer:
                if s != seq:
                    raise ValueError("snapshot messages of different sequence numbers")
                parsed.extend(parse_batch(payload)[1])
        except ValueError:
            self._count(rep, "bad_batches")
            self._failed(rep, "bad snapshot")
            return
        with self._lock:
            self._clear(rep)
            self._apply_events(rep, parsed)
            rep.applied_seq = seq
            rep.has_state = True
        self._count(rep, "resyncs", "snapshots")
        self._synced(rep)

    def _request(self, ctx: Any, rep: _Replica, frame: bytes) -> list[tuple[int, bytes]] | None:
        """One replay-socket exchange: the ``(seq, payload)`` answers before ``END_SEQ``
        (whose last frame, from a prefixgate engine, names its latest batch: kept in
        ``rep.latest_seq``); ``None`` (counted, retried later) when the replica has no replay
        endpoint or does not answer within ``request_timeout_s`` per message."""
        if rep.replay_endpoint is None:
            self._failed(rep, "no replay endpoint")
            return None
        if rep.dealer is None:
            rep.dealer = self._socket(ctx, zmq.DEALER)
            rep.dealer.connect(rep.replay_endpoint)
        dealer = rep.dealer
        out: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart((b"", frame), zmq.NOBLOCK)
            while True:
                if not dealer.poll(int(self.request_timeout_s * 1000)):
                    raise TimeoutError(
                        f"no answer within {self.request_timeout_s:g} s"
                        + (f" ({len(out)} batches before it)" if out else "")
                    )
                seq_frame, payload = replay_frames(dealer.recv_multipart())
                if seq_frame == END_SEQ:
                    if len(payload) == 8:
                        rep.latest_seq = int.from_bytes(payload, "big")
                    return out
                out.append((int.from_bytes(seq_frame, "big"), payload))
        except (TimeoutError, ValueError, zmq.ZMQError) as exc:
            # a late answer must not be read as the next one's: a fresh socket next time
            dealer.close(linger=0)
            rep.dealer = None
            self._failed(rep, f"replay request to {rep.replay_endpoint} failed: {exc}")
            return None

    def _failed(self, rep: _Replica, why: str = "") -> None:
        """A resync that did not happen: counted, retried with backoff; logged (a warning on
        the first of a run of failures, then every tenth, so a replica that never syncs is
        seen in the log without flooding it)."""
        self._count(rep, "resync_failures")
        rep.needs_sync = True
        rep.next_probe = time.monotonic() + _RETRY_S[min(rep.failures, len(_RETRY_S) - 1)]
        if rep.failures % 10 == 0:
            logger.warning(
                "kv index: replica %s not synced (failure %d in a row): %s",
                rep.name,
                rep.failures + 1,
                why or "no replay endpoint",
            )
        rep.failures += 1

    def _synced(self, rep: _Replica) -> None:
        if rep.failures:
            logger.info("kv index: replica %s synced after %d failures", rep.name, rep.failures)
        rep.needs_sync = False
        rep.failures = 0

    def _count(self, rep: _Replica, *names: str) -> None:
        with self._lock:
            for n in names:
                rep.counters[n] += 1

    # ---- applying events (the lock guards these) -------------------------------------------
    def _apply(self, rep: _Replica, seq: int, payload: bytes) -> bool:
        """Apply one batch in order; False (nothing applied) on a batch that does not parse."""
        try:
            ts, events = parse_batch(payload)
        except ValueError:
            logger.warning("kv index: replica %s sent a bad batch %d", rep.name, seq)
            return False
        with self._lock:
            self._apply_events(rep, events)
            rep.applied_seq = seq
            rep.has_state = True
            rep.counters["batches_applied"] += 1
            rep.lag_s = max(0.0, time.time() - ts)
        return True

    def _apply_events(self, rep: _Replica, events: list[ParsedEvent]) -> None:
        counts, holders, name = rep.counts, self._holders, rep.name
        for ev in events:
            rep.counters["events_applied"] += 1
            if ev.kind == "stored":
                if ev.block_size:
                    rep.block_size = ev.block_size
                if rep.hash_scheme in (None, HASH_UNKNOWN):
                    scheme = detect_hash_scheme(ev)
                    if scheme is not None and scheme != rep.hash_scheme:
                        rep.hash_scheme = scheme
                        if scheme == HASH_UNKNOWN:
                            logger.warning(
                                "kv index: replica %s's block hashes are not prefixgate's "
                                "nor vLLM's sha256 with seed %r (PYTHONHASHSEED unset): its "
                                "prompts are routed without prediction",
                                name,
                                DEFAULT_NONE_HASH_SEED,
                            )
                for h in ev.block_hashes:
                    n = counts.get(h, 0)
                    counts[h] = n + 1
                    if n == 0:
                        holders.setdefault(h, set()).add(name)
            elif ev.kind == "removed":
                for h in ev.block_hashes:
                    n = counts.get(h, 0)
                    if n == 0:
                        rep.counters["unknown_removals"] += 1
                    elif n == 1:
                        del counts[h]
                        self._drop_holder(h, name)
                    else:
                        counts[h] = n - 1
            else:
                self._clear(rep)

    def _clear(self, rep: _Replica) -> None:
        for h in rep.counts:
            self._drop_holder(h, rep.name)
        rep.counts.clear()  # in place: _apply_events holds a reference

    def _drop_holder(self, h: BlockHash, name: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(name)
            if not holders:
                del self._holders[h]


_COUNTERS = (
    "batches_applied",
    "events_applied",
    "gaps",
    "resyncs",
    "replays",
    "snapshots",
    "inexact_resyncs",
    "restarts",
    "resync_failures",
    "bad_batches",
    "unknown_removals",
    "load_reports",
)


def parse_kv_events_spec(spec: str) -> tuple[str, str, str | None]:
    """``URL=PUB[,REPLAY]`` (``--upstream-kv-events``) → ``(upstream URL, PUB, REPLAY)``.

    ``REPLAY`` defaults to prefixgate's own (the PUB port + 1, ``derive_replay_endpoint``);
    ``-`` means none (the index then follows the stream without resync).

    Raises:
        ValueError: no ``=``, a bad URL or endpoint.
    """
    url, sep, rest = spec.partition("=")
    if not sep or not url or not rest:
        raise ValueError(
            f"upstream kv events must look like URL=tcp://host:port[,REPLAY], got {spec!r}"
        )
    pub, _, replay = rest.partition(",")
    pub = pub.strip()
    replay_ep: str | None
    if not replay:
        replay_ep = derive_replay_endpoint(pub)
    elif replay.strip() == "-":
        derive_replay_endpoint(pub)  # checks the PUB endpoint
        replay_ep = None
    else:
        derive_replay_endpoint(pub)
        replay_ep = replay.strip()
        derive_replay_endpoint(replay_ep)
    if pub.endswith(":*"):
        raise ValueError(f"upstream kv events endpoint {pub!r} needs a real port")
    return normalize_url(url), pub, replay_ep
