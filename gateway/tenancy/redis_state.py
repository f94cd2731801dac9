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

Redis unreachable (refused, reset, or slower than ``timeout_s``): the request is admitted on
the key's local limits instead (each replica then enforces the full limit by itself), the
first failure is logged once as a warning, ``up`` turns False (``/ready`` and the
``prefixgate_state_backend_up`` gauge show it) and Redis is tried again at most every
``retry_s`` seconds; its return is logged once too. No request fails because of Redis.
The Lua-script pattern follows redis-py's ``Script`` objects (``register_script``: EVALSHA
with a reload on NOSCRIPT).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from prefixgate.gateway.http.errors import too_many
from prefixgate.gateway.tenancy.shared_state import Lease, LocalState, StateBackend
from redis.exceptions import RedisError

if TYPE_CHECKING:
    from prefixgate.gateway.tenancy.keys import Principal

logger = logging.getLogger("prefixgate.gateway")

# KEYS: rpm bucket, tpm bucket, concurrency zset.
# ARGV: rpm limit, tpm limit, prompt tokens, max concurrent, lease id, lease ttl (s).
# Returns {0} admitted, {1, wait} concurrency full (wait: until the first lease expires),
# {2, wait} rpm, {3, wait} tpm.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm, tpm, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local maxc, ttl = tonumber(ARGV[4]), tonumber(ARGV[6])
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'stamp')
  local lv, st = tonumber(v[1]), tonumber(v[2])
  if lv == nil or st == nil then return cap end
  return math.min(cap, lv + (now - st) * cap / 60)
end
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= maxc then
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    return {1, tostring(math.max(0, tonumber(first[2]) - now))}
  end
end
local r, k
if rpm > 0 then
  r = level(KEYS[1], rpm)
  if r < 1 then return {2, tostring((1 - r) * 60 / rpm)} end
end
if tpm > 0 then
  k = level(KEYS[2], tpm)
  local need = math.min(n, tpm)
  if k < need then return {3, tostring((need - k) * 60 / tpm)} end
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

# KEYS: concurrency zset. ARGV: ttl (s), lease ids... Renews the leases still present.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])) + 60)
return 0
"""

_FAILURES = (RedisError, OSError, asyncio.TimeoutError)


class RedisState:
    """Shared state in Redis (see the module docstring).

    Args:
        url: ``redis://[:password@]host:port/db`` (or ``rediss://``, ``unix://``).
        lease_ttl_s: seconds a concurrency slot outlives its replica (renewed every third).
        timeout_s: connect, command and pool-wait timeout (seconds): a slower Redis counts
            as down.
        retry_s: while down, seconds between attempts to use Redis again.
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
        # A bounded pool: a burst of requests queues for a connection (up to timeout_s)
        # instead of opening one connection per request in flight.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=True,
        )
        self._client = aioredis.Redis(connection_pool=pool)
        self._acquire = self._client.register_script(_ACQUIRE)
        self._release = self._client.register_script(_RELEASE)
        self._renew = self._client.register_script(_RENEW)
        self._reserve_prefix = self._client.register_script(_RESERVE_PREFIX)
        self.up = True
        self.fallbacks = 0  # requests admitted on local limits because Redis was down
        self._retry_at = 0.0
        self._held: dict[str, dict[str, float]] = {}  # key id -> {lease id: 1}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._renewer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Check Redis once (logs when unreachable) and start renewing leases."""
        await self._call(self._client.ping())
        self._renewer = asyncio.create_task(self._renew_loop())

    async def close(self) -> None:
        """Free the leases this replica holds, then disconnect."""
        if self._renewer is not None:
            self._renewer.cancel()
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
        result = await self._call(
            self._acquire(
                keys=["pg:rpm:" + k, "pg:tpm:" + k, "pg:conc:" + k],
                args=[
                    spec.requests_per_minute,
                    spec.tokens_per_minute,
                    prompt_tokens,
                    spec.max_concurrent,
                    lease_id,
                    self.lease_ttl_s,
                ],
            )
        )
        if result is None:  # Redis down: this replica's own limits
            self.fallbacks += 1
            return Lease(lease_id, False, prompt_tokens, principal.acquire(prompt_tokens))
        code = int(result[0])
        if code == 1:
            # Retry-After: this replica's estimate of when one of its own leases of the key
            # ends, bounded by when the first lease expires unrenewed (a replica's leases
            # stranded by a Redis stall free the key then, not "in 1 s")
            expiry = float(result[1])
            wait = min(expiry, principal.slots.wait(1)) if principal.slots.held else expiry
            raise too_many(
                f"key {spec.name} already has {spec.max_concurrent} requests in flight "
                f"across the gateway replicas (max_concurrent={spec.max_concurrent})",
                wait,
            )
        if code == 2:
            raise too_many(
                f"key {spec.name} is over {spec.requests_per_minute} requests per minute",
                float(result[1]),
            )
        if code == 3:
            raise too_many(
                f"key {spec.name} is over {spec.tokens_per_minute} tokens per minute",
                float(result[1]),
            )
        if spec.max_concurrent:
            self._held.setdefault(k, {})[lease_id] = 1.0
            return Lease(lease_id, True, prompt_tokens, slot=principal.slots.take())
        return Lease(lease_id, True, prompt_tokens)

    def settle(
        self, principal: Principal, lease: Lease, prompt_tokens: int, completion_tokens: int
    ) -> None:
        if lease.charge is not None:  # admitted on local limits while Redis was down
            lease.charge.settle(prompt_tokens, completion_tokens)
            return
        if principal.spec is None:
            return
        self._held.get(principal.key_id, {}).pop(lease.id, None)
        if lease.slot is not None:
            principal.slots.give(lease.slot)
        delta = prompt_tokens + completion_tokens - lease.prompt_tokens
        self._spawn(self._end(principal, lease, 0, delta, (prompt_tokens, completion_tokens)))

    def refund(self, principal: Principal, lease: Lease) -> None:
        if lease.charge is not None:
            lease.charge.refund()
            return
        if principal.spec is None:
            return
        self._held.get(principal.key_id, {}).pop(lease.id, None)
        if lease.slot is not None:
            principal.slots.give(lease.slot)
        self._spawn(self._end(principal, lease, -1, -lease.prompt_tokens, None))

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

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            for key_id, leases in list(self._held.items()):
                if leases:
                    await self._call(
                        self._renew(keys=["pg:conc:" + key_id], args=[self.lease_ttl_s, *leases])
                    )

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

    # -- health ------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {"backend": "redis", "shared": self.up, "fallbacks": self.fallbacks}

    async def _call(self, coro: Any) -> Any:
        """Await a Redis command; None (and ``up`` False) when Redis fails."""
        if not self.up and time.monotonic() < self._retry_at:
            coro.close()
            return None
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                result = await coro
        except _FAILURES as exc:
            self._retry_at = time.monotonic() + self.retry_s
            if self.up:
                self.up = False
                logger.warning(
                    "redis unreachable (%s): serving on this replica's local limits; "
                    "retrying every %g s",
                    type(exc).__name__ + (f": {exc}" if str(exc) else ""),
                    self.retry_s,
                )
            return None
        if not self.up:
            self.up = True
            logger.warning("redis reachable again: limits shared across replicas")
        return result

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


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
