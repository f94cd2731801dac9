"""``RedisState``: the gateway's shared state in Redis (``--redis-url``), so every gateway
replica on one Redis enforces one set of per-key limits and sees one prefix registry.

Keys (``<k>`` = the first 32 hex digits of the API key's SHA-256; the key itself is never
stored):

* ``pg:rpm:<k>``, ``pg:tpm:<k>`` — token buckets as hashes ``{level, stamp}`` (capacity =
  the per-minute limit, refilled at limit/60 per second, the level may go negative, as
  ``sdk.flow_control.TokenBucket``); absent = full. Taken atomically with the concurrency check by
  one Lua script, stamped with Redis's own clock (``TIME``), so replicas' clocks never meet.
* ``pg:conc:<k>`` — concurrency slots: a sorted set of lease ids scored by their expiry (Redis
  seconds). A lease lives ``lease_ttl_s`` and is renewed every ``lease_ttl_s / 3`` while its
  request runs; a replica killed with ``kill -9`` stops renewing, and its slots are free
  again once their leases expire (at most ``lease_ttl_s`` later).
* ``pg:usage:<k>`` — usage counters (hash: requests, prompt_tokens, completion_tokens).
* ``pg:pfx:<id>`` — a registered prefix (JSON), expiring with the prefix's TTL.
* ``pg:pfxk:<k>`` — the key's live prefixes (its ``max_prefixes`` across replicas): a sorted
  set of prefix ids scored by their expiry (Redis seconds), checked and added by one Lua
  script; a prefix leaves it when deleted or when its expiry passes.

* ``pg:prom:<f>`` — the upstream URL holding a promised place for a refused request (``<f>``:
  the first 32 hex digits of its fingerprint's SHA-256), expiring when the promise lapses.
* ``pg:promises`` — a marker living as long as the longest promise recorded (``PROMISES``);
  every new promise's lifetime (milliseconds) is also published on the channel of that name.
  Each replica listens (``may_hold_promises``): while no promise can be outstanding, its
  proxied requests skip the fingerprint and its lookup. Redis delivers the message to every
  listener before it answers the replica that recorded the promise, so before that replica's
  429 reaches the client; while a replica is not listening (starting, reconnecting) it looks
  every request up. Its watch loop reads the marker too, so a listener cut without notice
  is caught within ``WATCH_S``.

* ``pg:epoch`` — this Redis's life (hash ``{id, until}``): created by the first replica that
  finds it missing. A Redis restarted empty (or flushed) has none, so every replica notices
  the loss (at its next admission, or within ``WATCH_S`` by its watch loop), and then
  publishes again the concurrency leases of the requests it still runs ("leases rebuilt").
  A replica that finds the epoch missing recreates it with ``until = now + SETTLE_S``:
  admissions of a concurrency-limited key wait until then, so every live replica's leases are
  back before one more slot is given (RPM/TPM buckets are not rebuilt: after a restart they
  start full, as on a fresh Redis).

Connections: a bounded pool whose connections are health-checked (a PING before a
connection idle for ``HEALTH_CHECK_S`` is used: a stale connection to a restarted Redis is
replaced before a command goes on it) and retried once on a connection error or timeout
(redis-py ``Retry`` with ``ExponentialBackoff``); waiting for a free connection is local
queueing, not Redis being slow, so it is not timed (a burst of requests admitted on one
replica queues, it does not fall back to local limits); each command (with its retry) has
``2 * timeout_s + 1`` seconds.

Redis unreachable (refused, reset, or slower than that): the request is admitted on the key's
local limits instead (each replica then enforces the full limit by itself), the first failure
is logged once as a warning, ``up`` turns False (``/ready`` and the
``prefixgate_state_backend_up`` gauge show it) and admissions skip Redis for ``retry_s``
seconds at most; the watch loop tries Redis every ``WATCH_S`` seconds, so the fallback ends
as soon as Redis answers again, with this replica's leases (those taken locally meanwhile
too) published again; its return is logged once too. No request fails because of Redis.
The Lua-script pattern follows redis-py's ``Script`` objects (``register_script``: EVALSHA
with a reload on NOSCRIPT).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import secrets
import time
from typing import TYPE_CHECKING, Any, NoReturn

import redis.asyncio as aioredis
from prefixgate.gateway.http.errors import too_many
from prefixgate.gateway.tenancy.shared_state import Lease, LocalState, StateBackend
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

if TYPE_CHECKING:
    from prefixgate.gateway.tenancy.keys import Principal

logger = logging.getLogger("prefixgate.gateway")

EPOCH_KEY = "pg:epoch"
PROMISES = "pg:promises"  # the promises' marker key and channel (module docstring)
WATCH_S = 0.25  # seconds between the watch loop's checks of Redis (its epoch, its return)
SETTLE_S = 1.0  # after a lost epoch, seconds concurrency-limited admissions wait
HEALTH_CHECK_S = 1.0  # a pooled connection idle this long is PINGed before use

# KEYS: epoch hash. ARGV: a new epoch id, settle (s). The current epoch's id; when missing,
# created as ARGV[1] with until = now + settle.
_EPOCH = """
local id = redis.call('HGET', KEYS[1], 'id')
if id then return id end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'until', tostring(now + tonumber(ARGV[2])))
return ARGV[1]
"""

# KEYS: rpm bucket, tpm bucket, concurrency zset, epoch hash.
# ARGV: rpm limit, tpm limit, prompt tokens, max concurrent, lease id, lease ttl (s), epoch id.
# Returns {0} admitted, {1, wc, wr, wk} refused: the wait of each bound that refuses, -1 for
# one that passes (wc: concurrency full, until the first lease expires; wr: rpm; wk: tpm;
# every bound is asked, nothing taken), {4} not the replica's epoch (Redis lost its state),
# {5, wait} concurrency limited and the epoch is settling (leases still being rebuilt).
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm, tpm, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local maxc, ttl = tonumber(ARGV[4]), tonumber(ARGV[6])
local epoch = redis.call('HMGET', KEYS[4], 'id', 'until')
if epoch[1] ~= ARGV[7] then return {4} end
if maxc > 0 and tonumber(epoch[2]) > now then
  return {5, tostring(tonumber(epoch[2]) - now)}
end
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'stamp')
  local lv, st = tonumber(v[1]), tonumber(v[2])
  if lv == nil or st == nil then return cap end
  return math.min(cap, lv + (now - st) * cap / 60)
end
local wc, wr, wk = -1, -1, -1
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= maxc then
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    wc = math.max(0, tonumber(first[2]) - now)
  end
end
local r, k
if rpm > 0 then
  r = level(KEYS[1], rpm)
  if r < 1 then wr = (1 - r) * 60 / rpm end
end
if tpm > 0 then
  k = level(KEYS[2], tpm)
  local need = math.min(n, tpm)
  if k < need then wk = (need - k) * 60 / tpm end
end
if wc >= 0 or wr >= 0 or wk >= 0 then
  return {1, tostring(wc), tostring(wr), tostring(wk)}
end
if rpm > 0 then
  redis.call('HSET', KEYS[1], 'level', tostring(r - 1), 'stamp', tostring(now))
  redis.call('EXPIRE', KEYS[1], 120)
end
if tpm > 0 then
  redis.call('HSET', KEYS[2], 'level', tostring(k - n), 'stamp', tostring(now))
  redis.call('EXPIRE', KEYS[2], 120 + math.ceil(math.max(0, n - k) * 60 / tpm))
end
if maxc > 0 then
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[5])
  redis.call('EXPIRE', KEYS[3], math.ceil(ttl) + 60)
end
return {0}
"""

# KEYS: rpm bucket, tpm bucket, concurrency zset, usage hash.
# ARGV: lease id, rpm limit, tpm limit, rpm delta, tpm delta (signed: negative gives back,
# capped at the capacity), served (1: count usage), prompt tokens, completion tokens.
_RELEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function charge(key, cap, delta)
  if cap <= 0 or delta == 0 then return end
  local v = redis.call('HMGET', key, 'level', 'stamp')
  local lv, st = tonumber(v[1]), tonumber(v[2])
  if lv == nil or st == nil then lv = cap else lv = math.min(cap, lv + (now - st) * cap / 60) end
  lv = math.min(cap, lv - delta)
  redis.call('HSET', key, 'level', tostring(lv), 'stamp', tostring(now))
  redis.call('EXPIRE', key, 120 + math.ceil(math.max(0, -lv) * 60 / cap))
end
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[3], ARGV[1]) end
charge(KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[4]))
charge(KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[5]))
if ARGV[6] == '1' then
  redis.call('HINCRBY', KEYS[4], 'requests', 1)
  redis.call('HINCRBY', KEYS[4], 'prompt_tokens', tonumber(ARGV[7]))
  redis.call('HINCRBY', KEYS[4], 'completion_tokens', tonumber(ARGV[8]))
end
return 0
"""

# KEYS: the key's prefix zset. ARGV: max prefixes, prefix id, ttl (s).
# Returns {0} reserved, {1, wait} full (wait: seconds until its next prefix expires).
_RESERVE_PREFIX = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local maxp, ttl = tonumber(ARGV[1]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= maxp then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {1, tostring(math.max(1, tonumber(first[2]) - now))}
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[2])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(last[2])) + 1)
return {0}
"""

# KEYS: concurrency zset. ARGV: ttl (s), mode, lease ids... Mode "XX" renews the leases still
# present; mode "" adds them too (rebuilding them after Redis lost them).
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 3, #ARGV do
  if ARGV[2] == 'XX' then
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
  else
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
  end
end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])) + 60)
return 0
"""

# KEYS: the promise's key, the promises' marker. ARGV: the upstream URL, its lifetime (ms).
# The marker lives as long as the longest promise; the lifetime is published to every replica.
_PUT_PROMISE = """
local px = tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', px)
if redis.call('PTTL', KEYS[2]) < px then redis.call('SET', KEYS[2], '1', 'PX', px) end
redis.call('PUBLISH', KEYS[2], ARGV[2])
return 0
"""

_FAILURES = (RedisError, OSError, asyncio.TimeoutError)


class RedisState:
    """Shared state in Redis (see the module docstring).

    Args:
        url: ``redis://[:password@]host:port/db`` (or ``rediss://``, ``unix://``).
        lease_ttl_s: seconds a concurrency slot outlives its replica (renewed every third).
        timeout_s: connect and socket timeout of one Redis command (seconds); a command with
            its one retry that takes over ``2 * timeout_s + 1`` counts Redis as down.
        retry_s: while down, seconds admissions skip Redis at most (the watch loop tries it
            every ``WATCH_S`` and ends the fallback as soon as it answers).
        max_connections: connections to Redis at most (commands beyond wait for one).

    Raises:
        ValueError: a malformed URL (``lease_ttl_s > 0`` is ``GatewaySettings``'s check).
    """

    kind = "redis"

    def __init__(
        self,
        url: str,
        lease_ttl_s: float = 10.0,
        timeout_s: float = 2.0,
        retry_s: float = 2.0,
        max_connections: int = 32,
    ) -> None:
        self.url = url
        self.lease_ttl_s = lease_ttl_s
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        # A bounded pool: a burst of requests queues for a connection (on _slots, untimed)
        # instead of opening one connection per request in flight.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=None,  # never waits: _slots admits at most max_connections commands
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            socket_keepalive=True,
            health_check_interval=HEALTH_CHECK_S,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=1),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            decode_responses=True,
            # no CLIENT SETINFO handshake: Redis before 7.2 answers it with an error, which
            # redis-py drops on connect, but the suite on the lowest versions (redis-py 5.0.1,
            # Redis 7.0) once read it as a later command's ("unknown subcommand 'SETINFO'")
            # just after a Redis restart, and fell back to local limits for a Redis that was up
            lib_name=None,
            lib_version=None,
        )
        self._client = aioredis.Redis(connection_pool=pool)
        self._slots = asyncio.Semaphore(max_connections)
        self._deadline_s = 2 * timeout_s + 1.0
        self._epoch = self._client.register_script(_EPOCH)
        self._acquire = self._client.register_script(_ACQUIRE)
        self._release = self._client.register_script(_RELEASE)
        self._renew = self._client.register_script(_RENEW)
        self._reserve_prefix = self._client.register_script(_RESERVE_PREFIX)
        self._put_promise = self._client.register_script(_PUT_PROMISE)
        # the promises' listener: its own connection (it blocks reading), no command timeout,
        # no silent reconnection (a cut ends the subscription: _promise_loop subscribes anew)
        self._listen_client = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=timeout_s,
            socket_keepalive=True,
            decode_responses=True,
            retry=Retry(NoBackoff(), 0, supported_errors=()),
            lib_name=None,  # no CLIENT SETINFO (above)
            lib_version=None,
        )
        self._promises_known = False  # listening: _promises_until is this replica's view
        self._promises_until = 0.0  # time.monotonic() when every promise known has lapsed
        self._listener: asyncio.Task[None] | None = None
        self.up = True
        self.fallbacks = 0  # requests admitted on local limits because Redis was down
        self.rebuilds = 0  # times this replica published its leases again (Redis lost them)
        self._retry_at = 0.0
        self._epoch_id = ""  # the epoch this replica's leases are published in
        self._resync = True  # publish the held leases again before the next admission
        self._sync_lock = asyncio.Lock()
        self._held: dict[str, dict[str, float]] = {}  # key id -> {lease id: 1}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Check Redis once (logs when unreachable), join its epoch (a fresh Redis: no
        settling, nobody holds leases yet) and start the watch loop (epoch, return after a
        failure, lease renewals)."""
        await self._sync(settle_s=0.0)
        self._watcher = asyncio.create_task(self._watch_loop())
        self._listener = asyncio.create_task(self._promise_loop())

    async def close(self) -> None:
        """Free the leases this replica holds, then disconnect."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.wait([self._listener], timeout=self._deadline_s)
        with contextlib.suppress(*_FAILURES):
            async with asyncio.timeout(self._deadline_s):
                await self._listen_client.aclose()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for key_id, leases in list(self._held.items()):
            if leases:
                await self._call(self._client.zrem("pg:conc:" + key_id, *leases))
        self._held.clear()
        await self._client.aclose()

    # -- limits ------------------------------------------------------------------------

    async def acquire(self, principal: Principal, prompt_tokens: int) -> Lease:
        spec = principal.spec
        if spec is None or not (
            spec.requests_per_minute or spec.tokens_per_minute or spec.max_concurrent
        ):
            return Lease("", True, prompt_tokens)  # nothing to hold; usage still counted
        k = principal.key_id
        lease_id = secrets.token_hex(8)
        result = None
        for _ in range(3):  # a lost epoch: rebuild, then again; settling: wait, then again
            if self._resync and self.up:
                await self._sync(SETTLE_S)
            result = await self._call(
                self._acquire(
                    keys=["pg:rpm:" + k, "pg:tpm:" + k, "pg:conc:" + k, EPOCH_KEY],
                    args=[
                        spec.requests_per_minute,
                        spec.tokens_per_minute,
                        prompt_tokens,
                        spec.max_concurrent,
                        lease_id,
                        self.lease_ttl_s,
                        self._epoch_id,
                    ],
                )
            )
            if result is None:
                break
            code = int(result[0])
            if code == 4:
                self._resync = True
            elif code == 5:
                await asyncio.sleep(min(float(result[1]), SETTLE_S))
            else:
                break
        else:
            result = None  # the epoch changed under every attempt (Redis flushed repeatedly)
        if result is None:  # Redis down: this replica's own limits
            self.fallbacks += 1
            if spec.max_concurrent:  # published to Redis once it is back (see _sync)
                self._held.setdefault(k, {})[lease_id] = 1.0
            return Lease(lease_id, False, prompt_tokens, principal.acquire(prompt_tokens))
        if int(result[0]) == 1:
            self._refuse(principal, *(float(w) for w in result[1:4]))
        if spec.max_concurrent:
            self._held.setdefault(k, {})[lease_id] = 1.0
            return Lease(lease_id, True, prompt_tokens, slot=principal.slots.take())
        return Lease(lease_id, True, prompt_tokens)

    @staticmethod
    def _refuse(principal: Principal, conc: float, rpm: float, tpm: float) -> NoReturn:
        """The 429 of a refused acquire: each bound that refused (a wait >= 0) named, with
        ``Retry-After`` the longest of their waits (a client told the first bound's wait came
        back to meet the next)."""
        spec = principal.spec
        assert spec is not None
        refusals: list[tuple[str, float]] = []
        if conc >= 0:
            # this replica's estimate of when one of its own leases of the key ends, bounded
            # by when the first lease expires unrenewed (a replica's leases stranded by a
            # Redis stall free the key then, not "in 1 s")
            wait = min(conc, principal.slots.wait(1)) if principal.slots.held else conc
            refusals.append(
                (
                    f"already has {spec.max_concurrent} requests in flight across the gateway "
                    f"replicas (max_concurrent={spec.max_concurrent})",
                    wait,
                )
            )
        if rpm >= 0:
            refusals.append((f"is over {spec.requests_per_minute} requests per minute", rpm))
        if tpm >= 0:
            refusals.append((f"is over {spec.tokens_per_minute} tokens per minute", tpm))
        reasons = " and ".join(reason for reason, _ in refusals)
        raise too_many(f"key {spec.name} {reasons}", max(w for _, w in refusals))

    def settle(
        self, principal: Principal, lease: Lease, prompt_tokens: int, completion_tokens: int
    ) -> None:
        if lease.charge is not None:  # admitted on local limits while Redis was down
            lease.charge.settle(prompt_tokens, completion_tokens)
        if self._let_go(principal, lease):
            delta = prompt_tokens + completion_tokens - lease.prompt_tokens
            self._spawn(self._end(principal, lease, 0, delta, (prompt_tokens, completion_tokens)))

    def refund(self, principal: Principal, lease: Lease) -> None:
        if lease.charge is not None:
            lease.charge.refund()
        if self._let_go(principal, lease):
            self._spawn(self._end(principal, lease, -1, -lease.prompt_tokens, None))

    def _let_go(self, principal: Principal, lease: Lease) -> bool:
        """Let go of ``lease`` on this replica (its ``_held`` entry and concurrency slot, or its
        local admission); True when Redis is still to be told (a Redis lease of a key with
        limits), False when nothing is."""
        if lease.charge is not None:
            self._drop_local(principal, lease)
            return False
        if principal.spec is None:
            return False
        self._held.get(principal.key_id, {}).pop(lease.id, None)
        if lease.slot is not None:
            principal.slots.give(lease.slot)
        return True

    def _drop_local(self, principal: Principal, lease: Lease) -> None:
        """A request admitted on local limits ended: its lease leaves ``_held`` and, had it
        been published since Redis came back, Redis too."""
        if self._held.get(principal.key_id, {}).pop(lease.id, None) is not None and self.up:
            self._spawn(self._call(self._client.zrem("pg:conc:" + principal.key_id, lease.id)))

    async def _end(
        self,
        principal: Principal,
        lease: Lease,
        rpm_delta: int,
        tpm_delta: int,
        usage: tuple[int, int] | None,
    ) -> None:
        spec = principal.spec
        assert spec is not None
        k = principal.key_id
        limited = spec.requests_per_minute or spec.tokens_per_minute or spec.max_concurrent
        await self._call(
            self._release(
                keys=["pg:rpm:" + k, "pg:tpm:" + k, "pg:conc:" + k, "pg:usage:" + k],
                args=[
                    lease.id,
                    spec.requests_per_minute if limited else 0,
                    spec.tokens_per_minute if limited else 0,
                    rpm_delta,
                    tpm_delta,
                    1 if usage is not None else 0,
                    usage[0] if usage else 0,
                    usage[1] if usage else 0,
                ],
            )
        )

    async def usage(self, principal: Principal) -> dict[str, int]:
        """The key's usage counters across replicas (``{}`` when Redis is down)."""
        raw = await self._call(self._client.hgetall("pg:usage:" + principal.key_id))
        return {name: int(v) for name, v in (raw or {}).items()}

    async def _watch_loop(self) -> None:
        """Every ``WATCH_S``: check the epoch (a restarted Redis is noticed, the leases are
        published again; a Redis back after a failure ends the fallback); every third of
        the lease TTL: renew the leases held."""
        renew_at = time.monotonic() + self.lease_ttl_s / 3
        while True:
            await asyncio.sleep(WATCH_S)
            await self._sync(SETTLE_S)
            if self._promises_known:  # a listener cut without notice misses no promise
                self._promises_seen(await self._call(self._client.pttl(PROMISES)))
            if time.monotonic() >= renew_at and self.up:
                renew_at = time.monotonic() + self.lease_ttl_s / 3
                await self._publish("XX")

    async def _sync(self, settle_s: float) -> None:
        """Join Redis's epoch (creating it, settling for ``settle_s``, when missing) and,
        when it is not the one this replica's leases were published in (or Redis was down
        meanwhile), publish the held leases again. Tries Redis even while it counts as down:
        the one way ``up`` turns True again."""
        async with self._sync_lock:
            epoch = await self._call(
                self._epoch(keys=[EPOCH_KEY], args=[secrets.token_hex(8), settle_s]), probe=True
            )
            if epoch is None or (epoch == self._epoch_id and not self._resync):
                return
            if not await self._publish(""):
                return
            if self._epoch_id and epoch != self._epoch_id:
                self.rebuilds += 1
                logger.warning(
                    "redis lost the shared state (restarted or flushed): this replica's "
                    "%d concurrency leases published again",
                    sum(len(v) for v in self._held.values()),
                )
            self._epoch_id = epoch
            self._resync = False

    async def _publish(self, mode: str) -> bool:
        """Renew (``mode="XX"``) or add (``""``) every held lease; False when Redis failed."""
        for key_id, leases in list(self._held.items()):
            if leases:
                done = await self._call(
                    self._renew(keys=["pg:conc:" + key_id], args=[self.lease_ttl_s, mode, *leases]),
                    probe=True,
                )
                if done is None:
                    return False
        return True

    # -- prefixes ----------------------------------------------------------------------

    @property
    def shares_prefixes(self) -> bool:
        return self.up

    async def put_prefix(self, prefix_id: str, record: dict[str, Any], ttl_s: float) -> None:
        px = max(1, int(ttl_s * 1000)) if ttl_s != float("inf") else None
        await self._call(self._client.set("pg:pfx:" + prefix_id, json.dumps(record), px=px))

    async def get_prefix(self, prefix_id: str) -> dict[str, Any] | None:
        raw = await self._call(self._client.get("pg:pfx:" + prefix_id))
        return json.loads(raw) if raw else None

    async def delete_prefix(self, prefix_id: str) -> None:
        await self._call(self._client.delete("pg:pfx:" + prefix_id))

    async def live_prefixes(self, prefix_ids: list[str]) -> set[str] | None:
        live: set[str] = set()
        for i in range(0, len(prefix_ids), 512):  # one MGET per 512 ids
            part = prefix_ids[i : i + 512]
            values = await self._call(self._client.mget(["pg:pfx:" + p for p in part]))
            if values is None:
                return None
            live.update(p for p, v in zip(part, values, strict=True) if v is not None)
        return live

    async def reserve_prefix(
        self, owner: str, prefix_id: str, max_prefixes: int, ttl_s: float
    ) -> float | None:
        result = await self._call(
            self._reserve_prefix(
                keys=["pg:pfxk:" + _owner_id(owner)],
                args=[max_prefixes, prefix_id, min(ttl_s, 10 * 365 * 86_400.0)],
            )
        )
        if result is None:
            return None
        return 0.0 if int(result[0]) == 0 else float(result[1])

    async def release_prefix(self, owner: str, prefix_id: str) -> None:
        await self._call(self._client.zrem("pg:pfxk:" + _owner_id(owner), prefix_id))

    async def put_promise(self, fingerprint: str, upstream: str, ttl_s: float) -> None:
        if ttl_s > 0:
            px = max(1, math.ceil(ttl_s * 1000))
            keys = [_promise_key(fingerprint), PROMISES]
            await self._call(self._put_promise(keys=keys, args=[upstream, px]))

    def may_hold_promises(self) -> bool:
        return not self._promises_known or time.monotonic() < self._promises_until

    async def promised_upstream(self, fingerprint: str) -> str | None:
        raw = await self._call(self._client.get(_promise_key(fingerprint)))
        if raw is None:
            return None
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    async def drop_promise(self, fingerprint: str) -> None:
        await self._call(self._client.delete(_promise_key(fingerprint)))

    async def _promise_loop(self) -> None:
        """Listen on ``PROMISES``: each promise's lifetime extends this replica's view
        (``_promises_until``); on each (re)subscription the marker's remaining life covers
        what was published meanwhile. Not listening (failed, reconnecting): no view, every
        request is looked up."""
        while True:
            pubsub = self._listen_client.pubsub()
            try:
                await pubsub.subscribe(PROMISES)
                async for message in pubsub.listen():
                    if message["type"] == "subscribe":  # from now on every promise is heard
                        ttl = await self._call(self._client.pttl(PROMISES))
                        if ttl is None:
                            break  # the marker not read: no view; subscribe again
                        self._promises_seen(ttl)
                        self._promises_known = True
                    elif message["type"] == "message":
                        self._promises_seen(int(message["data"]))
            except (*_FAILURES, ValueError):
                pass
            finally:
                self._promises_known = False
                with contextlib.suppress(*_FAILURES):
                    async with asyncio.timeout(self._deadline_s):
                        await pubsub.aclose()
            await asyncio.sleep(WATCH_S)

    def _promises_seen(self, ttl_ms: int | None) -> None:
        """A promise lives ``ttl_ms`` more milliseconds (the marker's PTTL: -2 none, -1 no
        expiry; None: Redis did not answer)."""
        if ttl_ms is None:
            return
        ttl_ms = int(ttl_ms)
        if ttl_ms == -1:
            self._promises_until = math.inf
        elif ttl_ms > 0:
            self._promises_until = max(self._promises_until, time.monotonic() + ttl_ms / 1000)

    # -- health ------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {"backend": "redis", "shared": self.up, "fallbacks": self.fallbacks}

    async def _call(self, coro: Any, probe: bool = False) -> Any:
        """Await a Redis command; None (and ``up`` False) when Redis fails. While down,
        commands are skipped (None at once) for ``retry_s`` unless ``probe``."""
        try:
            if not probe and not self.up and time.monotonic() < self._retry_at:
                return None
            async with self._slots:  # queueing for a connection: local, not timed
                if not probe and not self.up and time.monotonic() < self._retry_at:
                    return None
                try:
                    async with asyncio.timeout(self._deadline_s):
                        result = await coro
                except _FAILURES as exc:
                    self._retry_at = time.monotonic() + self.retry_s
                    if self.up:
                        self.up = False
                        self._resync = True
                        logger.warning(
                            "redis unreachable (%s): serving on this replica's local limits; "
                            "retrying every %g s",
                            type(exc).__name__ + (f": {exc}" if str(exc) else ""),
                            WATCH_S,
                        )
                    return None
        finally:
            coro.close()  # never started (skipped, or cancelled while queued): no warning
        if not self.up:
            self.up = True
            logger.warning("redis reachable again: limits shared across replicas")
        return result

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _promise_key(fingerprint: str) -> str:
    return "pg:prom:" + hashlib.sha256(fingerprint.encode()).hexdigest()[:32]


def _owner_id(owner: str) -> str:
    """``<k>`` of a prefix owner (``Principal.id``, ``"key:<k>"``)."""
    return owner.removeprefix("key:")


def make_backend(redis_url: str | None, lease_ttl_s: float = 10.0) -> StateBackend:
    """``RedisState(redis_url)`` when a URL is given, else ``LocalState()``.

    Raises:
        ValueError: a malformed Redis URL (checked at start, not at the first request).
    """
    if not redis_url:
        return LocalState()
    return RedisState(redis_url, lease_ttl_s)
