"""Admission and settlement of a tenant's requests: per process, or shared through Redis.

:meth:`Limiter.admit` is the one hook every surface calls before it admits a request (chat,
completions and Responses in sieproxy/front/intake.py; any other surface the same way): it
refuses with ``core.quota.RateLimited`` (429) or returns a :class:`Lease`, whose
``headers()`` go on the response and which is settled exactly once at the request's end
(:meth:`Limiter.settle`, callable from synchronous code: the settlement runs in the limiter's
background task).

With ``redis_url`` the counters live in Redis (sieproxy/tenancy/redis_store.py) and hold across
every process that shares it. When Redis does not answer (an error, or no answer within
``REDIS_TIMEOUT``), the process serves with its own per-process counters for that request and
the next ``RETRY_AFTER_DOWN`` seconds, logs one line when Redis goes away and one when it is
back, and exports ``sieproxy_tenant_redis_up``: a rate limiter failing must not take the API
down with it, and each process still enforces the limits on its own share. Leases taken in
Redis before it went away lapse there by themselves; usage counts are kept in the process and
written when Redis is back, so none is lost.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from ..core.tenancy.quota import (
    Decision,
    Limits,
    RateLimited,
    TenantCounters,
    admit,
    anthropic_rate_headers,
    rate_headers,
    settle,
)
from .redis_store import RedisCounters

__all__ = ["REDIS_TIMEOUT", "RETRY_AFTER_DOWN", "Lease", "Limiter"]

log = logging.getLogger("sieproxy.tenancy")

#: Seconds an admission waits for Redis before it counts in the process instead.
REDIS_TIMEOUT = 0.25
#: Seconds the process counts on its own after Redis failed, before it tries Redis again.
RETRY_AFTER_DOWN = 1.0


@dataclass(slots=True)
class Lease:
    """One admitted request's reservation."""

    tenant: str
    limits: Limits
    reserved: int
    decision: Decision
    lease_id: str = ""
    shared: bool = False  # taken in Redis (else in this process)
    settled: bool = False
    at: float = 0.0  # the limiter's time of the admission

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the response."""
        return rate_headers(self.limits, self.decision)

    def anthropic_headers(self) -> dict[str, str]:
        """Anthropic's ``anthropic-ratelimit-*`` headers (the Messages routes)."""
        return anthropic_rate_headers(self.limits, self.decision, self.at)


@dataclass
class Limiter:
    """The tenants' counters of this process, and Redis when configured."""

    redis: RedisCounters | None = None
    clock: Callable[[], float] = time.time
    local: dict[str, TenantCounters] = field(default_factory=dict)
    redis_up: bool = True
    #: Usage not yet written to Redis: (minute, tenant, counter) -> count.
    pending_usage: dict[tuple[int, str, str], int] = field(default_factory=dict)
    #: Redis failures seen (metrics).
    redis_errors: int = 0
    _down_until: float = 0.0
    _settles: tuple[trio.MemorySendChannel[Any], trio.MemoryReceiveChannel[Any]] = field(
        default_factory=lambda: trio.open_memory_channel[Any](math.inf)
    )

    def _counters(self, tenant: str) -> TenantCounters:
        c = self.local.get(tenant)
        if c is None:
            c = self.local[tenant] = TenantCounters()
        return c

    def _use_redis(self) -> bool:
        return self.redis is not None and trio.current_time() >= self._down_until

    def _redis_failed(self, exc: BaseException | None) -> None:
        self.redis_errors += 1
        self._down_until = trio.current_time() + RETRY_AFTER_DOWN
        if self.redis_up:
            self.redis_up = False
            why = "no answer in time" if exc is None else type(exc).__name__
            log.error(
                "redis unreachable (%s): limits are counted per process until it answers", why
            )

    def _redis_ok(self) -> None:
        if not self.redis_up:
            self.redis_up = True
            log.warning("redis answers again: limits are shared through it")

    async def admit(self, tenant: str, limits: Limits, cost: int) -> Lease:
        """Admit one request of ``tenant`` reserving ``cost`` tokens, or raise 429."""
        if limits.unlimited:
            return Lease(tenant, limits, cost, Decision(True))
        now = self.clock()
        if self._use_redis():
            assert self.redis is not None
            lease_id = secrets.token_hex(8)
            d: Decision | None = None
            try:
                with trio.move_on_after(REDIS_TIMEOUT):
                    d = await self.redis.admit(tenant, limits, cost, lease_id, now)
            except Exception as exc:  # any client error: count here instead
                self._redis_failed(exc)
            else:
                if d is None:
                    self._redis_failed(None)
                else:
                    self._redis_ok()
                    if not d.ok:
                        assert d.limit is not None
                        raise RateLimited(d.limit, d.retry_after, limits, d, now)
                    return Lease(tenant, limits, cost, d, lease_id, shared=True, at=now)
        d = admit(self._counters(tenant), limits, cost, now)
        if not d.ok:
            assert d.limit is not None
            raise RateLimited(d.limit, d.retry_after, limits, d, now)
        return Lease(tenant, limits, cost, d, at=now)

    def settle(self, lease: Lease, used: int) -> None:
        """The request ended having used ``used`` tokens (prompt + output); once per lease."""
        if lease.settled or lease.limits.unlimited:
            lease.settled = True
            return
        lease.settled = True
        if lease.shared:
            self._settles[0].send_nowait((lease, used, self.clock()))
        else:
            settle(self._counters(lease.tenant), lease.limits, lease.reserved, used, self.clock())

    def count(self, tenant: str, counter: str, n: int = 1) -> None:
        """Usage for ``sieproxy usage`` (written to Redis by :meth:`run`)."""
        if self.redis is None or not n:
            return
        key = (int(self.clock() // 60), tenant, counter)
        self.pending_usage[key] = self.pending_usage.get(key, 0) + n

    async def run(self, flush_every: float = 1.0) -> None:
        """Background: settle shared leases in Redis; write usage every ``flush_every`` s."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._settle_loop)
            while True:
                await trio.sleep(flush_every)
                await self.flush_usage()

    async def flush_usage(self) -> bool:
        """Write the pending usage to Redis; kept for the next try when Redis fails."""
        if self.redis is None or not self.pending_usage:
            return True
        batch, self.pending_usage = self.pending_usage, {}
        ok = False
        try:
            with trio.move_on_after(5 * REDIS_TIMEOUT):
                await self.redis.add_usage(batch)
                ok = True
        except Exception as exc:
            self._redis_failed(exc)
        if not ok:
            for k, n in batch.items():  # not lost: added to what came meanwhile
                self.pending_usage[k] = self.pending_usage.get(k, 0) + n
        else:
            self._redis_ok()
        return ok

    async def _settle_loop(self) -> None:
        assert self.redis is not None
        async for lease, used, now in self._settles[1]:
            back = lease.reserved - used
            try:
                with trio.move_on_after(5 * REDIS_TIMEOUT):
                    await self.redis.settle(lease.tenant, lease.limits, back, lease.lease_id, now)
            except Exception as exc:  # its lease lapses in Redis; the refund is forgone
                self._redis_failed(exc)

    async def idle(self) -> None:
        """Wait until every queued settlement has been sent (tests)."""
        while self._settles[1].statistics().current_buffer_used:  # noqa: ASYNC110
            await trio.sleep(0.01)
