"""Counters shared through a real Redis: the Lua scripts agree with core.quota, two limiters
on one Redis enforce one limit exactly, and Redis killed mid-test gives per-process limits,
then shared ones again, with no usage lost."""

from __future__ import annotations

import trio

from sieproxy.core.tenancy.quota import Limits, RateLimited
from sieproxy.front.tenants import redis_client
from sieproxy.tenancy.limiter import Limiter
from sieproxy.tenancy.redis_store import RedisCounters
from tests.tenancy.conftest import RedisServer


async def _admitted(limiter: Limiter, tenant: str, limits: Limits, cost: int) -> bool:
    try:
        await limiter.admit(tenant, limits, cost)
    except RateLimited:
        return False
    return True


async def test_two_limiters_on_one_redis_enforce_one_limit_exactly(
    redis_server: RedisServer,
) -> None:
    now = [5_000_000.0]
    limits = Limits(rpm=10, tpm=1000, concurrency=4)
    with trio.fail_after(30):
        a_client, b_client = redis_client(redis_server.url), redis_client(redis_server.url)
        async with a_client, b_client:
            a = Limiter(RedisCounters(a_client), clock=lambda: now[0])
            b = Limiter(RedisCounters(b_client), clock=lambda: now[0])
            results = []
            for i in range(12):  # alternately through either "process"
                results.append(await _admitted(a if i % 2 else b, "t", limits, 10))
            assert results.count(True) == 4  # the concurrency limit, across both
            # a request settled through one process frees its slot for both
            now[0] += 60.0
            leases = [await b.admit("u", limits, 100) for _ in range(4)]
            assert not await _admitted(a, "u", limits, 100)
            a.settle(leases[0], 20)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(a._settle_loop)
                await a.idle()
                with trio.fail_after(5):
                    while not await _admitted(b, "u", limits, 100):
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
            assert a.redis_up and b.redis_up and not a.local and not b.local


async def test_requests_per_minute_across_two_limiters(redis_server: RedisServer) -> None:
    now = [6_000_000.0]
    limits = Limits(rpm=7)
    with trio.fail_after(30):
        a_client, b_client = redis_client(redis_server.url), redis_client(redis_server.url)
        async with a_client, b_client:
            a = Limiter(RedisCounters(a_client), clock=lambda: now[0])
            b = Limiter(RedisCounters(b_client), clock=lambda: now[0])
            got = [await _admitted(a if i % 3 else b, "t", limits, 1) for i in range(20)]
            assert got.count(True) == 7
            try:
                await a.admit("t", limits, 1)
            except RateLimited as exc:
                assert exc.headers["Retry-After"] == "9"  # one request per 60/7 s
                now[0] += 9
            assert await _admitted(b, "t", limits, 1)


async def test_redis_killed_mid_test_falls_back_then_recovers_no_usage_lost(
    redis_server: RedisServer,
) -> None:
    now = [7_000_000.0]
    limits = Limits(rpm=3)
    with trio.fail_after(60):
        client = redis_client(redis_server.url)
        async with client:
            lim = Limiter(RedisCounters(client), clock=lambda: now[0])
            assert await _admitted(lim, "t", limits, 1)
            lim.count("t", "requests", 1)
            redis_server.kill()
            # Redis gone: the process counts on its own (a fresh bucket of 3), no error
            got = [await _admitted(lim, "t", limits, 1) for _ in range(5)]
            assert got == [True, True, True, False, False]
            assert not lim.redis_up and lim.redis_errors >= 1
            lim.count("t", "requests", 3)
            assert not await lim.flush_usage()  # kept for later, not lost
            assert lim.pending_usage
            redis_server.start()  # back, on the same port
            with trio.fail_after(20):
                while not await lim.flush_usage():
                    await trio.sleep(0.1)
            assert lim.redis_up and not lim.pending_usage
            totals = await lim.redis.read_usage(range(int(now[0] // 60), int(now[0] // 60) + 1))  # type: ignore[union-attr]
            assert totals == {"t": {"requests": 4}}
            # shared again (the restarted Redis starts empty: a full bucket)
            with trio.fail_after(10):
                while not lim._use_redis():
                    await trio.sleep(0.05)
            assert await _admitted(lim, "t2", limits, 1)
            assert "t2" not in lim.local
