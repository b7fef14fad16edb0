"""Unit tests of ModelPool: routing, admission, breaker and health watcher (no sockets).

Replicas are plain ``Replica`` objects marked ready by hand; the health watcher is driven
through an ``EngineClient`` on an ``httpx.MockTransport``. Every test runs under Trio (the pool
reads ``trio.current_time``); the waiting ones use the autojump clock.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import trio

from sieproxy.core.errors import InvalidRequest, ServiceUnavailable
from sieproxy.fleet.client import EngineClient, parse_load
from sieproxy.fleet.pool import ModelPool, Replica, RouteHints
from sieproxy.fleet.pool import _score as pool_score
from sieproxy.settings.load import EngineSpec, GatewaySettings

MODEL = "m"


def make_pool(n: int = 3, *, ready: bool = True, routing: str = "prefix", **g: object) -> ModelPool:
    specs = [
        EngineSpec(url=f"http://10.0.0.{i}:3000", pool=f"pool-{i % 2}", machine_profile=f"p{i}")
        for i in range(n)
    ]
    pool = ModelPool(MODEL, specs, GatewaySettings(**g), routing=routing)  # type: ignore[arg-type]
    for r in pool.replicas:
        r.ready = ready
    return pool


async def take(
    mp: ModelPool,
    key: str | None = None,
    k: int = 1,
    *,
    pool: str | None = None,
    machine_profile: str | None = None,
) -> Replica:
    hints = RouteHints(pool=pool, machine_profile=machine_profile, affinity_key=key)
    return await mp.acquire(hints, k)


# ---------------------------------------------------------------------------- least outstanding


async def test_least_outstanding_spreads_evenly() -> None:
    pool = make_pool(3)
    got = [await take(pool) for _ in range(9)]
    assert Counter(r.url for r in got) == {r.url: 3 for r in pool.replicas}
    assert [r.inflight for r in pool.replicas] == [3, 3, 3]


async def test_least_outstanding_counts_candidates_not_requests() -> None:
    pool = make_pool(3)
    big = await take(pool, k=4)
    others = [await take(pool) for _ in range(6)]
    assert big not in others
    assert Counter(r.url for r in others) == {r.url: 3 for r in pool.replicas if r is not big}


async def test_least_outstanding_ties_broken_by_total() -> None:
    pool = make_pool(2)
    a = await take(pool)
    pool.release(a)
    b = await take(pool)
    assert b is not a  # both idle: the one that served less so far
    pool.release(b)


async def test_release_frees_slots() -> None:
    pool = make_pool(1)
    r = await take(pool, k=3)
    assert r.inflight == 3
    pool.release(r, 3)
    assert r.inflight == 0
    assert r.total == 3


# ---------------------------------------------------------------------------- affinity


async def test_same_key_same_replica_when_idle() -> None:
    pool = make_pool(4)
    first = await take(pool, "conversation-42")
    pool.release(first)
    for _ in range(20):
        r = await take(pool, "conversation-42")
        assert r is first
        pool.release(r)


async def test_same_key_same_replica_under_moderate_load() -> None:
    pool = make_pool(4)
    # background load elsewhere does not move a key whose replica is not overloaded
    first = await take(pool, "k")
    pool.release(first)
    for _ in range(4):
        await take(pool)  # one per replica
    for _ in range(10):
        r = await take(pool, "k")
        assert r is first
        pool.release(r)


async def test_keys_spread_over_replicas() -> None:
    pool = make_pool(4)
    owners: Counter[str] = Counter()
    for i in range(400):
        r = await take(pool, f"key-{i}")
        owners[r.url] += 1
        pool.release(r)
    assert set(owners) == {r.url for r in pool.replicas}
    assert min(owners.values()) > 50  # roughly uniform (expected 100 each)


async def test_key_ranking_is_independent_of_replica_order() -> None:
    a = make_pool(4)
    b = make_pool(4)
    b.replicas.reverse()
    for i in range(50):
        ra = await take(a, f"key-{i}")
        rb = await take(b, f"key-{i}")
        assert ra.url == rb.url
        a.release(ra)
        b.release(rb)


async def test_key_moves_when_replica_out_and_comes_back() -> None:
    pool = make_pool(4)
    home = await take(pool, "sticky")
    pool.release(home)
    home.ready = False
    moved = await take(pool, "sticky")
    assert moved is not home
    pool.release(moved)
    again = await take(pool, "sticky")
    assert again is moved  # the fallback is itself stable
    pool.release(again)
    home.ready = True
    back = await take(pool, "sticky")
    assert back is home
    pool.release(back)


async def test_removing_a_replica_only_moves_its_keys() -> None:
    pool = make_pool(4)
    before = {}
    for i in range(100):
        r = await take(pool, f"key-{i}")
        before[i] = r
        pool.release(r)
    gone = pool.replicas[1]
    gone.ready = False
    for i in range(100):
        r = await take(pool, f"key-{i}")
        if before[i] is not gone:
            assert r is before[i], "consistent hashing: unaffected keys stay put"
        else:
            assert r is not gone
        pool.release(r)


async def test_hot_key_is_bounded() -> None:
    pool = make_pool(3)
    held = [await take(pool, "hot") for _ in range(30)]
    counts = Counter(r.url for r in held)
    assert len(counts) == 3, "a hot key spills to the other replicas"
    # bounded loads: no replica goes above bound × (mean + 1)
    assert max(r.inflight for r in pool.replicas) <= math.ceil(1.25 * (30 / 3 + 1))
    home = held[0]
    assert counts[home.url] == max(counts.values())


async def test_affinity_respects_hints() -> None:
    pool = make_pool(4)
    for i in range(40):
        r = await take(pool, f"key-{i}", pool="pool-1")
        assert r.pool == "pool-1"
        pool.release(r)


# ---------------------------------------------------------------------------- hints


async def test_hint_filtering() -> None:
    pool = make_pool(4)
    for _ in range(8):
        r = await take(pool, pool="pool-0")
        assert r.pool == "pool-0"
    for _ in range(4):
        r = await take(pool, machine_profile="p3")
        assert r.machine_profile == "p3"
    r = await take(pool, pool="pool-0", machine_profile="p2")
    assert r.machine_profile == "p2"


async def test_check_hints_names_the_header() -> None:
    pool = make_pool(2)
    pool.check_hints(RouteHints(pool="pool-1", machine_profile="p1"))
    with pytest.raises(InvalidRequest) as e1:
        pool.check_hints(RouteHints(pool="nope"))
    assert e1.value.param == "X-SIE-Pool"
    with pytest.raises(InvalidRequest) as e2:
        pool.check_hints(RouteHints(machine_profile="nope"))
    assert e2.value.param == "X-SIE-MACHINE-PROFILE"


async def test_pool_and_profile_that_never_meet_are_a_400_naming_both() -> None:
    """pool-1 and p0 each exist (replicas 1 and 0) but never on one replica: a retry can never
    succeed, so the answer is 400, not 503 model_loading."""
    pool = make_pool(2)
    with pytest.raises(InvalidRequest) as info:
        pool.check_hints(RouteHints(pool="pool-1", machine_profile="p0"))
    err = info.value
    assert err.status == 400 and err.code == "invalid_request" and err.param == "X-SIE-Pool"
    for word in ("X-SIE-Pool", "X-SIE-MACHINE-PROFILE", "'pool-1'", "'p0'"):
        assert word in err.message
    # A config reload that puts the two labels on one replica makes the pair servable.
    pool.set_engines([EngineSpec(url="http://10.0.0.9:3000", pool="pool-1", machine_profile="p0")])
    pool.check_hints(RouteHints(pool="pool-1", machine_profile="p0"))


async def test_matching_replica_not_ready_is_still_503() -> None:
    """When a replica carries both labels but is not ready, a retry can succeed: 503."""
    pool = make_pool(2)
    pool.replicas[0].ready = False
    hints = RouteHints(pool="pool-0", machine_profile="p0")
    pool.check_hints(hints)
    with pytest.raises(ServiceUnavailable) as info:
        await pool.acquire(hints, 1)
    assert info.value.code == "model_loading"
    assert info.value.headers.get("Retry-After") == "2"


async def test_exclude() -> None:
    pool = make_pool(2)
    a = pool.replicas[0]
    for _ in range(5):
        r = await pool.acquire(RouteHints(), 1, exclude=a)
        assert r is not a
    with pytest.raises(ServiceUnavailable):
        await pool.acquire(RouteHints(machine_profile="p0"), 1, exclude=a)


# ---------------------------------------------------------------------------- admission


async def test_full_then_503_with_retry_after(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(2, replica_max_inflight=2, admission_wait=0.5, retry_after=7)
    for _ in range(4):
        await take(pool)
    t0 = trio.current_time()
    with pytest.raises(ServiceUnavailable) as exc:
        await take(pool)
    assert trio.current_time() - t0 == pytest.approx(0.5)
    assert exc.value.status == 503
    assert exc.value.headers["Retry-After"] == "7"
    assert exc.value.code != "model_loading"


async def test_full_then_waits_for_room(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(1, replica_max_inflight=2, admission_wait=5)
    a = await take(pool)
    await take(pool)
    got: list[Replica] = []

    async def waiter() -> None:
        got.append(await take(pool))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(1)
        assert not got
        pool.release(a)
    assert got == [a]
    assert a.inflight == 2


async def test_capacity_counts_every_candidate_of_a_request(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A replica holds at most replica_max_inflight candidates (fleet/pool.py docstring).

    With 3 of 4 slots used, an n=4 request must wait (and here get 503), not push the replica
    to 7 candidates.
    """
    pool = make_pool(1, replica_max_inflight=4, admission_wait=0.5)
    for _ in range(3):
        await take(pool)
    with contextlib.suppress(ServiceUnavailable):
        await take(pool, k=4)
    assert pool.replicas[0].inflight <= 4


async def test_request_larger_than_capacity_runs_alone(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(1, replica_max_inflight=2, admission_wait=0.5)
    r = await take(pool, k=3)  # an idle replica still takes an oversized request
    assert r.inflight == 3


async def test_no_ready_replica_is_model_loading(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(2, ready=False, retry_after=3)
    assert not pool.any_ready()
    with pytest.raises(ServiceUnavailable) as exc:
        await take(pool)
    assert exc.value.code == "model_loading"
    assert exc.value.headers["Retry-After"] == "3"


async def test_gate_closed_is_not_ready() -> None:
    """While the chat template is being discovered the model is "loading", not "at capacity"."""
    pool = make_pool(2)
    pool.gate_open = False
    assert not pool.any_ready()
    with pytest.raises(ServiceUnavailable) as exc:
        await take(pool)
    assert exc.value.code == "model_loading"
    pool.gate_open = True
    assert pool.any_ready()


# ---------------------------------------------------------------------------- breaker


async def test_breaker_opens_after_streak_and_backs_off(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(1, breaker_failures=3, breaker_backoff=2.0, breaker_backoff_max=5.0)
    r = pool.replicas[0]
    pool.record_failure(r)
    pool.record_failure(r)
    assert r.available(trio.current_time())
    pool.record_failure(r)
    assert not r.available(trio.current_time())
    assert not pool.any_ready()
    await trio.sleep(2.01)
    assert r.available(trio.current_time())
    for _ in range(3):
        pool.record_failure(r)
    assert r.out_until - trio.current_time() == pytest.approx(4.0)  # doubled
    await trio.sleep(4.01)
    for _ in range(3):
        pool.record_failure(r)
    assert r.out_until - trio.current_time() == pytest.approx(5.0)  # capped


async def test_success_resets_streak() -> None:
    pool = make_pool(1, breaker_failures=3)
    r = pool.replicas[0]
    pool.record_failure(r)
    pool.record_failure(r)
    pool.record_success(r)
    pool.record_failure(r)
    pool.record_failure(r)
    assert r.available(trio.current_time())


async def test_open_breaker_moves_keys(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(3, breaker_failures=1, breaker_backoff=1.0)
    home = await take(pool, "k")
    pool.release(home)
    pool.record_failure(home)
    r = await take(pool, "k")
    assert r is not home
    pool.release(r)
    await trio.sleep(1.01)
    r = await take(pool, "k")
    assert r is home


# ---------------------------------------------------------------------------- health watcher

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def client_with(handler: Handler, g: GatewaySettings) -> EngineClient:
    return EngineClient(g, transport=httpx.MockTransport(handler))


class FakeHealth:
    """/health answers from a per-host table; /server_info advertises incremental output."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.hang: set[str] = set()
        self.delay = 0.0
        self.checks: Counter[str] = Counter()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/health":
            self.checks[host] += 1
            if host in self.hang:
                await trio.sleep_forever()
            await trio.sleep(self.delay)
            return httpx.Response(self.status.get(host, 200))
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"incremental_streaming_output": True})
        return httpx.Response(404)


async def test_watcher_marks_ready_and_out(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(2, ready=False, health_interval=0.5, health_timeout=1.0)
    fake = FakeHealth()
    client = client_with(fake, pool._g)
    a, b = pool.replicas
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.run_health_checks, client)
        await trio.sleep(0.1)
        assert a.ready and b.ready
        assert a.incremental and a.info_loaded
        fake.status["10.0.0.0"] = 503
        await trio.sleep(1.0)
        assert not a.ready and b.ready
        assert pool.any_ready()
        fake.status["10.0.0.0"] = 200
        await trio.sleep(1.0)
        assert a.ready
        nursery.cancel_scope.cancel()


async def test_watcher_times_out_a_hanging_check(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(2, ready=False, health_interval=0.5, health_timeout=1.0)
    fake = FakeHealth()
    client = client_with(fake, pool._g)
    a, b = pool.replicas
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.run_health_checks, client)
        await trio.sleep(0.1)
        assert a.ready
        fake.hang.add("10.0.0.0")
        await trio.sleep(2.0)
        assert not a.ready
        assert b.ready  # one hanging replica does not stall the others' checks
        checks_b = fake.checks["10.0.0.1"]
        await trio.sleep(2.0)
        assert fake.checks["10.0.0.1"] > checks_b
        fake.hang.clear()
        await trio.sleep(3.0)
        assert a.ready
        nursery.cancel_scope.cancel()


async def test_passing_health_check_closes_the_breaker(autojump_clock: trio.abc.Clock) -> None:
    """docs/CONFIGURATION.md: "A successful health check puts it back at once". With a 30 s
    backoff and checks passing every second, the replica is back after one check, not 30 s;
    half-open, so one more failed request opens the breaker again, for the doubled backoff."""
    pool = make_pool(
        2, ready=False, health_interval=1.0, breaker_failures=2, breaker_backoff=30.0,
        breaker_backoff_max=100.0,
    )  # fmt: skip
    a = pool.replicas[0]
    async with watched(pool):
        pool.record_failure(a)  # two failed requests in a row
        pool.record_failure(a)
        opened = trio.current_time()
        assert not a.available(opened)
        await wait_for(lambda: a.available(trio.current_time()))
        assert trio.current_time() - opened <= 1.0  # the next check, not the 30 s backoff
        pool.record_failure(a)  # half-open: one failure is enough
        assert a.out_until - trio.current_time() == pytest.approx(60.0)  # doubled
        await wait_for(lambda: a.available(trio.current_time()))
        pool.record_success(a)  # closed for good: a streak is needed again
        pool.record_failure(a)
        assert a.available(trio.current_time())


async def test_check_in_flight_when_the_breaker_opens_does_not_close_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Only a check that started after the breaker opened speaks for the replica since then."""
    pool = make_pool(1, ready=False, health_interval=1.0, breaker_failures=1, breaker_backoff=30.0)
    a = pool.replicas[0]
    async with watched(pool) as fake:
        fake.delay = 0.8
        await trio.sleep(0.6)  # the second check started at 1.0 and answers at 1.8
        pool.record_failure(a)  # opens at 1.1, while that check is in flight
        await trio.sleep(0.8)
        assert fake.checks["10.0.0.0"] == 2
        assert not a.available(trio.current_time()), "a check begun before the opening closed it"
        await trio.sleep(2.0)  # the third check began at 2.8 and passed at 3.6
        assert a.available(trio.current_time())


@contextlib.asynccontextmanager
async def watched(pool: ModelPool) -> AsyncIterator[FakeHealth]:
    """The pool's health watchers running against a FakeHealth, every replica ready (0.5 s)."""
    fake = FakeHealth()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.run_health_checks, client_with(fake, pool._g))
        await trio.sleep(0.5)
        assert all(r.ready for r in pool.replicas)
        yield fake
        nursery.cancel_scope.cancel()


async def wait_for(pred: Callable[[], bool], timeout: float = 100.0) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


# ---------------------------------------------------------------------------- prefix affinity


def prefix_hints(key: str) -> RouteHints:
    return RouteHints(prefix_key=key)


async def test_same_prefix_same_replica_from_independent_pools() -> None:
    """Two gateway processes share nothing: the choice depends on the key and the URLs only
    (even listed in another order)."""
    a, b = make_pool(4), make_pool(4)
    b.replicas.reverse()
    for i in range(40):
        key = f"prefix:{i}"
        ra, rb = await a.acquire(prefix_hints(key), 1), await b.acquire(prefix_hints(key), 1)
        assert ra.url == rb.url
        a.release(ra)
        b.release(rb)
    used = Counter([(await a.acquire(prefix_hints(f"prefix:{i}"), 1)).url for i in range(40)])
    assert len(used) == 4  # prefixes spread over the replicas


async def test_prefix_moves_when_its_replica_dies_and_comes_back() -> None:
    pool = make_pool(4)
    home = await pool.acquire(prefix_hints("prefix:conv"), 1)
    pool.release(home)
    home.ready = False
    away = await pool.acquire(prefix_hints("prefix:conv"), 1)
    assert away is not home
    pool.release(away)
    again = await pool.acquire(prefix_hints("prefix:conv"), 1)
    assert again is away  # stable while the replica is out
    pool.release(again)
    home.ready = True
    assert await pool.acquire(prefix_hints("prefix:conv"), 1) is home


async def test_hot_prefix_spills_over_at_the_load_bound() -> None:
    pool = make_pool(4)
    got = [await pool.acquire(prefix_hints("prefix:hot"), 1) for _ in range(40)]
    counts = Counter(r.url for r in got)
    home = got[0].url
    assert counts[home] == max(counts.values())
    assert len(counts) >= 3, counts
    assert max(counts.values()) <= math.ceil(1.25 * (40 / 4 + 1)), counts


async def test_routing_modes_choose_the_key() -> None:
    both = RouteHints(affinity_key="client-key", prefix_key="prefix:p")
    only_prefix = RouteHints(prefix_key="prefix:p")
    modes = ("prefix", "key_only", "least_loaded")
    prefix, key_only, least = (make_pool(4, routing=m) for m in modes)
    assert prefix._key(both) == "client-key"  # the client's key wins
    assert prefix._key(only_prefix) == "prefix:p"
    assert key_only._key(both) == "client-key"
    assert key_only._key(only_prefix) is None
    assert least._key(both) is None
    # least_loaded spreads one repeated prompt; prefix keeps it together
    assert len({(await least.acquire(only_prefix, 1)).url for _ in range(4)}) == 4
    assert len({(await prefix.acquire(only_prefix, 1)).url for _ in range(2)}) == 1


# ---------------------------------------------------------------------------- engine load


async def test_reported_queue_gets_less_new_work() -> None:
    pool = make_pool(3)
    busy = pool.replicas[0]
    busy.engine_load, busy.inflight_at_read = 30, 0  # other gateways' work queued there
    got = Counter([(await take(pool)).url for _ in range(12)])
    assert busy.url not in got
    # and a prefix whose home reports a long queue spills to the next replica in its ranking
    for i in range(50):
        key = f"prefix:{i}"
        ranked = sorted(pool.replicas, key=lambda r: pool_score(key, r.url))
        if ranked[0] is busy:
            break
    r = await pool.acquire(prefix_hints(key), 1)
    assert r is ranked[1]


async def test_engine_load_plus_own_change_since_the_read() -> None:
    r = Replica(url="http://x", ready=True)
    assert r.load() == 0
    r.inflight = 2
    r.engine_load, r.inflight_at_read = 5, 2  # the engine counted our 2 and 3 others
    r.inflight = 4
    assert r.load() == 7
    r.inflight = 0  # ours finished since: the others remain
    assert r.load() == 3
    r.engine_load = 0
    r.inflight = 3
    assert r.load() == 3  # never below the own count


@contextlib.asynccontextmanager
async def watching(pool: ModelPool, fake: FakeHealth) -> AsyncIterator[None]:
    """The pool's health watchers running against ``fake`` until the block ends."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.run_health_checks, client_with(fake, pool._g))
        yield
        nursery.cancel_scope.cancel()


class LoadHealth(FakeHealth):
    """FakeHealth plus /v1/loads from a per-host table (absent host: 404, no load report)."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: dict[str, tuple[int, int]] = {}
        self.legacy: set[str] = set()
        self.hang_loads = False
        self.load_reads = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        self.load_reads += path in ("/v1/loads", "/get_load")
        if self.hang_loads and path in ("/v1/loads", "/get_load"):
            await trio.sleep_forever()
        if host in self.loads and path == "/v1/loads" and host not in self.legacy:
            run, wait = self.loads[host]
            body = {"loads": [{"dp_rank": 0, "num_running_reqs": run, "num_waiting_reqs": wait}]}
            return httpx.Response(200, json=body)
        if host in self.loads and path == "/get_load" and host in self.legacy:
            run, wait = self.loads[host]
            return httpx.Response(200, json=[{"num_reqs": run + wait, "num_waiting_reqs": wait}])
        return await super().__call__(request)


async def test_watcher_reads_the_engine_load(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(3, ready=False, health_interval=0.5)
    fake = LoadHealth()
    fake.loads = {"10.0.0.0": (4, 20), "10.0.0.1": (1, 2)}
    fake.legacy = {"10.0.0.1"}
    a, b, c = pool.replicas
    async with watching(pool, fake):
        await wait_for(lambda: a.engine_load == 24 and b.engine_load == 3)
        assert c.engine_load is None  # reports nothing: its own counts
        got = Counter([(await take(pool)).url for _ in range(3)])
        assert got == {c.url: 2, b.url: 1} or got == {c.url: 3}
        fake.loads["10.0.0.0"] = (0, 0)  # the queue drained
        await wait_for(lambda: a.engine_load == 0)
        fake.status["10.0.0.0"] = 503  # a replica that fails its check reports nothing
        await wait_for(lambda: not a.ready)
        assert a.engine_load is None


def test_parse_load_shapes() -> None:
    assert parse_load({"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 1}] * 2}) == (6, 2)
    assert parse_load([{"num_reqs": 5, "num_waiting_reqs": 2}]) == (3, 2)
    assert parse_load({"loads": [{"unrelated": 1}]}) is None
    assert parse_load({"detail": "Not Found"}) is None
    assert parse_load("nope") is None


async def test_affinity_passes_over_a_full_engine_batch() -> None:
    """Below the load bound but at the engine's max_running_requests: the next in ranking."""
    pool = make_pool(3)
    for r in pool.replicas:
        r.max_running = 2
    home = await pool.acquire(prefix_hints("prefix:k"), 1)
    assert await pool.acquire(prefix_hints("prefix:k"), 1) is home  # 1 < 2: still home
    third = await pool.acquire(prefix_hints("prefix:k"), 1)
    assert third is not home and home.load() == 2


async def test_load_is_read_between_health_checks(autojump_clock: trio.abc.Clock) -> None:
    pool = make_pool(1, ready=False, health_interval=10.0, load_interval=0.5)
    fake = LoadHealth()
    fake.loads = {"10.0.0.0": (1, 0)}
    (a,) = pool.replicas
    async with watching(pool, fake):
        await wait_for(lambda: a.engine_load == 1)
        fake.loads["10.0.0.0"] = (3, 4)
        t0 = trio.current_time()
        await wait_for(lambda: a.engine_load == 7)
        assert trio.current_time() - t0 <= 0.6  # the next load read, not the next check
        assert fake.checks["10.0.0.0"] == 1


async def test_a_hanging_load_read_drops_the_report_not_the_replica(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = make_pool(1, ready=False, health_interval=10.0, health_timeout=1.0, load_interval=0.5)
    fake = LoadHealth()
    fake.loads = {"10.0.0.0": (5, 5)}
    (a,) = pool.replicas
    async with watching(pool, fake):
        await wait_for(lambda: a.engine_load == 10)
        fake.hang_loads = True
        await wait_for(lambda: a.engine_load is None, timeout=2.0)
        assert a.ready  # a load read is no health verdict
        fake.hang_loads = False
        await wait_for(lambda: a.engine_load == 10, timeout=2.0)


async def test_an_engine_without_load_endpoint_is_asked_once_per_check(
    autojump_clock: trio.abc.Clock,
) -> None:
    pool = make_pool(1, ready=False, health_interval=5.0, load_interval=0.5)
    fake = LoadHealth()  # no entry in fake.loads: /v1/loads and /get_load answer 404
    async with watching(pool, fake):
        await trio.sleep(9.0)  # checks at 0 and 5
        assert fake.checks["10.0.0.0"] == 2
        assert fake.load_reads == 4  # both paths, once per check; not every 0.5 s
        assert pool.replicas[0].engine_load is None
