"""The tenants' counters in Redis: the arithmetic of ``core.quota`` as atomic Lua scripts.

Per tenant, two keys that share a hash tag (one cluster slot):

- ``sieproxy:{<tenant>}:q`` — a hash with each bucket's level and the time it was read
  (``rl``/``rt`` requests, ``tl``/``tt`` tokens). It expires 120 s after its last write: a
  bucket untouched for 60 s is full again, so a missing key means exactly "full".
- ``sieproxy:{<tenant>}:c`` — a sorted set of the running requests' leases (member: a random
  lease id, score: the time it lapses). A gateway process that dies without settling leaves its
  leases to lapse after ``lease`` seconds instead of holding the slots forever.

Times are the gateways' wall clocks (seconds since the epoch, passed by the caller): every
process that shares a Redis must keep its clock in sync (NTP), as any rate limit across hosts
needs. Usage per tenant and minute goes to ``sieproxy:usage:<minute>`` hashes (fields
``<tenant>|<counter>``), kept ``USAGE_RETENTION`` seconds.
"""

from __future__ import annotations

import math
from typing import Any

from ..core.tenancy.quota import Decision, Limits

__all__ = [
    "ADMIT_LUA",
    "SETTLE_LUA",
    "USAGE_RETENTION",
    "RedisCounters",
    "decision_from",
    "usage_key",
]

#: Seconds a minute of usage is kept in Redis (``sieproxy usage`` reads at most this far back).
USAGE_RETENTION = 8 * 24 * 3600

ADMIT_LUA = """
local h, z = KEYS[1], KEYS[2]
local now = tonumber(ARGV[1])
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, lease, lease_until = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local function level(lf, tf, cap)
  if cap <= 0 then return nil end
  local l = tonumber(redis.call('HGET', h, lf))
  local t = tonumber(redis.call('HGET', h, tf))
  if l == nil or t == nil then return cap end
  if now > t then l = math.min(cap, l + (now - t) * cap / 60) end
  return l
end
local rl = level('rl', 'rt', rpm)
local tl = level('tl', 'tt', tpm)
local function out(ok, which, wait)
  return {ok, which, tostring(wait), tostring(rl or ''), tostring(tl or '')}
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', z, '-inf', now)
  if redis.call('ZCARD', z) >= conc then return out(0, 'concurrency', 1) end
end
local wait, which = 0, ''
if rl ~= nil and rl + 1e-6 < 1 then wait, which = (1 - rl) * 60 / rpm, 'requests' end
if tl ~= nil then
  local need = math.min(cost, tpm)
  if tl + 1e-6 < need then
    local w = (need - tl) * 60 / tpm
    if w > wait then wait, which = w, 'tokens' end
  end
end
if wait > 0 then return out(0, which, wait) end
if rl ~= nil then
  rl = math.max(0, rl - 1)
  redis.call('HSET', h, 'rl', tostring(rl), 'rt', tostring(now))
end
if tl ~= nil then
  tl = math.max(0, tl - cost)
  redis.call('HSET', h, 'tl', tostring(tl), 'tt', tostring(now))
end
if rl ~= nil or tl ~= nil then redis.call('PEXPIRE', h, 120000) end
if conc > 0 then
  redis.call('ZADD', z, lease_until, lease)
  redis.call('PEXPIRE', z, math.ceil((lease_until - now) * 1000) + 1000)
end
return out(1, '', 0)
"""

SETTLE_LUA = """
local h, z = KEYS[1], KEYS[2]
local now, tpm, back, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if lease ~= '' then redis.call('ZREM', z, lease) end
if tpm > 0 and back ~= 0 then
  local l = tonumber(redis.call('HGET', h, 'tl'))
  local t = tonumber(redis.call('HGET', h, 'tt'))
  if l == nil or t == nil then l, t = tpm, now end
  if now > t then l = math.min(tpm, l + (now - t) * tpm / 60) end
  l = math.max(0, math.min(tpm, l + back))
  redis.call('HSET', h, 'tl', tostring(l), 'tt', tostring(math.max(now, t)))
  redis.call('PEXPIRE', h, 120000)
end
return 1
"""


def _keys(tenant: str) -> list[str]:
    return [f"sieproxy:{{{tenant}}}:q", f"sieproxy:{{{tenant}}}:c"]


def usage_key(minute: int) -> str:
    return f"sieproxy:usage:{minute}"


def _snap(raw: Any, cap: int | None) -> tuple[int, float] | None:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    if cap is None or not text:
        return None
    level = float(text)
    return max(0, math.floor(level)), max(0.0, (cap - level) * 60.0 / cap)


def decision_from(reply: list[Any], limits: Limits) -> Decision:
    """The admission script's reply as a ``core.quota.Decision``."""
    ok, which, wait, rl, tl = reply
    which = which.decode() if isinstance(which, bytes) else str(which)
    wait_s = float(wait.decode() if isinstance(wait, bytes) else wait)
    return Decision(
        bool(int(ok)),
        which or None,
        min(wait_s, 60.0),
        _snap(rl, limits.rpm),
        _snap(tl, limits.tpm),
    )


class RedisCounters:
    """Admission and settlement against one Redis (``client``: a connected ``coredis.Redis``);
    every call raises the client's errors (the caller falls back: sieproxy/tenancy/limiter.py)."""

    def __init__(self, client: Any, lease: float = 3600.0) -> None:
        self.client = client
        self.lease = lease
        self._admit = client.register_script(ADMIT_LUA)
        self._settle = client.register_script(SETTLE_LUA)

    async def admit(
        self, tenant: str, limits: Limits, cost: int, lease_id: str, now: float
    ) -> Decision:
        args = [
            repr(now),
            str(limits.rpm or 0),
            str(limits.tpm or 0),
            str(limits.concurrency or 0),
            str(cost),
            lease_id,
            repr(now + self.lease),
        ]
        reply = await self._admit(keys=_keys(tenant), args=args)
        return decision_from(list(reply), limits)

    async def settle(
        self, tenant: str, limits: Limits, back: int, lease_id: str, now: float
    ) -> None:
        """Give ``back`` tokens to the tenant's bucket (negative: take) and drop the lease."""
        lease = lease_id if limits.concurrency else ""
        args = [repr(now), str(limits.tpm or 0), str(back), lease]
        await self._settle(keys=_keys(tenant), args=args)

    async def add_usage(self, counts: dict[tuple[int, str, str], int]) -> None:
        """Add ``(minute, tenant, counter) -> n`` to the usage hashes, in one round trip."""
        async with self.client.pipeline(transaction=False) as pipe:
            for (minute, tenant, counter), n in counts.items():
                pipe.hincrby(usage_key(minute), f"{tenant}|{counter}", n)
            for minute in {m for m, _, _ in counts}:
                pipe.expire(usage_key(minute), USAGE_RETENTION)

    async def read_usage(self, minutes: range) -> dict[str, dict[str, int]]:
        """Usage per tenant and counter summed over ``minutes``."""
        totals: dict[str, dict[str, int]] = {}
        for m in minutes:
            raw = await self.client.hgetall(usage_key(m))
            for field, value in raw.items():
                f = field.decode() if isinstance(field, bytes) else field
                tenant, _, counter = f.rpartition("|")
                row = totals.setdefault(tenant, {})
                row[counter] = row.get(counter, 0) + int(value)
        return totals
