"""``routing = "cache_aware"``: the policy object in a real ModelPool (no sockets here; the ZMQ
stream is tests/shell/test_kv_events.py). Prompts come as ``input_ids`` bodies, so no
tokenizer is needed; events are fed to each replica's stream as an engine publishes them."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import msgspec
import trio

from sieproxy.core.planning.affinity import prefix_key
from sieproxy.core.routing.kvindex import EventStream
from sieproxy.fleet.cache_route import CacheAwarePolicy, Route
from sieproxy.fleet.pool import ModelPool, Replica, RouteHints
from sieproxy.settings.load import EngineSpec, GatewaySettings, ModelSettings

MODEL = "m"
URLS = [f"http://10.0.0.{i}:3000" for i in range(4)]


def make(**m: Any) -> tuple[ModelPool, CacheAwarePolicy]:
    ms = ModelSettings(engines=list(URLS), routing="cache_aware", **m)
    pool = ModelPool(MODEL, [EngineSpec(url=u) for u in URLS], GatewaySettings(),
                     routing="cache_aware")
    pool.policy = CacheAwarePolicy(MODEL, ms)
    for r in pool.replicas:
        r.ready = True
    return pool, pool.policy


async def send(pool: ModelPool, tokens: list[int]) -> tuple[Replica, Route]:
    route = await pool.policy.prepare([{"input_ids": tokens}])
    assert route is not None
    hints = RouteHints(prefix_key=prefix_key(",".join(map(str, tokens[:64]))), route=route)
    return await pool.acquire(hints, 1), route


def finish(pool: ModelPool, r: Replica, route: Route, reported: int | None = None) -> None:
    pool.policy.first_token(route)
    pool.policy.done(route, reported)
    pool.release(r)


def system(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 50_000) for _ in range(n)]


def publish(stream: EventStream, seq: int, tokens: list[int], block: int = 16,
            first_hash: int = 1) -> int:
    """Feed ``stream`` the BlockStored events an engine publishes after caching ``tokens``."""
    parent = None
    for i in range(len(tokens) // block):
        h = first_hash + i
        payload = msgspec.msgpack.encode(
            [0.0, [["BlockStored", [h], parent, tokens[i * block:(i + 1) * block], block, None]]])
        assert stream.receive(seq, payload, trio.current_time()) is None
        parent, seq = h, seq + 1
    return seq


def with_streams(policy: CacheAwarePolicy) -> dict[str, EventStream]:
    out = {}
    for u in URLS:
        rc = policy.cache(u)
        rc.stream = out[u] = EventStream(rc.capacity, policy.m.kv_events_stale)
        rc.stream.receive(0, msgspec.msgpack.encode([0.0, [["AllBlocksCleared"]]]), 0.0)
    return out


async def test_approx_index_keeps_a_shared_system_prompt_on_one_replica() -> None:
    pool, _policy = make()
    shared = system(2000, 1)
    placed = []
    for u in range(30):  # thirty users, one system prompt, different questions, one at a time
        r, route = await send(pool, shared + system(40, 100 + u))
        placed.append(r.url)
        finish(pool, r, route)
    counts = Counter(placed)
    assert len(counts) == 1, counts  # the first request's replica holds it: all follow
    assert route.source == "approx" and route.predicted == 2000


async def test_approx_index_spills_when_the_warm_replica_saturates() -> None:
    # threshold = 1000 tok/s * 0.5 s = 500 pending prefill tokens
    pool, policy = make(prefill_tokens_per_s=1000.0, spill_delay=0.5)
    shared = system(2000, 1)
    r0, first = await send(pool, shared + [1] * 40)
    finish(pool, r0, first)
    held = []
    for u in range(12):  # concurrent: each adds its uncached question to the warm replica
        held.append(await send(pool, shared + system(300, 200 + u)))
    where = Counter(r.url for r, _ in held)
    assert where[r0.url] >= 2 and len(where) > 1, where
    spills = policy.cache(r0.url).spills
    assert spills["prefill"] + spills["load"] == 12 - where[r0.url]
    assert spills["prefill"] >= 1
    for r, route in held:
        finish(pool, r, route)
    assert all(policy.cache(u).pending == 0 for u in URLS)


async def test_no_replica_holds_the_prefix_rendezvous_decides() -> None:
    pool, _policy = make()
    other, _ = make()
    for i in range(6):  # fresh prompts: both gateways pick the same replica, with no events
        toks = system(300, 300 + i)
        a, ra = await send(pool, toks)
        b, rb = await send(other, toks)
        assert a.url == b.url and ra.warm is None
        finish(pool, a, ra)
        finish(other, b, rb)


async def test_events_send_a_request_where_its_longest_prefix_is() -> None:
    pool, policy = make()
    streams = with_streams(policy)
    shared = system(1024, 2)
    publish(streams[URLS[1]], 1, shared[:256])
    publish(streams[URLS[2]], 1, shared)  # the longest
    publish(streams[URLS[3]], 1, shared[:16])  # one block: no affinity
    r, route = await send(pool, [*shared, 5, 6, 7])
    assert r.url == URLS[2] and route.source == "events" and route.predicted == 1024
    finish(pool, r, route, reported=1024)
    rc = policy.cache(URLS[2])
    assert rc.outcomes == {"exact": 1, "over": 0, "under": 0} and rc.reported == 1024
    # the engine evicts the tail: the index follows, and the prediction with it
    payload = msgspec.msgpack.encode([0.0, [["BlockRemoved", list(range(33, 65))]]])
    streams[URLS[2]].receive(65, payload, trio.current_time())
    r, route = await send(pool, [*shared, 8])
    assert r.url == URLS[2] and route.predicted == 512


async def test_two_gateways_fed_the_same_events_route_the_same() -> None:
    a, pa = make()
    b, pb = make()
    sa, sb = with_streams(pa), with_streams(pb)
    prompts = [system(700, 400 + i) for i in range(4)]
    for i, p in enumerate(prompts):
        for s in (sa, sb):
            publish(s[URLS[i % 4]], 1, p)
    for p in prompts:
        ra, routa = await send(a, [*p, 9])
        rb, routb = await send(b, [*p, 9])
        assert ra.url == rb.url == routa.warm == routb.warm
        finish(a, ra, routa)
        finish(b, rb, routb)


async def test_a_replica_out_of_sync_falls_back_to_the_approximate_index() -> None:
    pool, policy = make()
    streams = with_streams(policy)
    shared = system(512, 3)
    publish(streams[URLS[0]], 1, shared)
    r, route = await send(pool, [*shared, 1])
    assert r.url == URLS[0] and route.source == "events"
    finish(pool, r, route)
    # the stream loses a batch it cannot replay: that replica is matched on what was sent
    assert streams[URLS[0]].receive(100, msgspec.msgpack.encode([0.0, []]), 0.0) == 33
    streams[URLS[0]].replay_done()
    assert not streams[URLS[0]].in_sync(trio.current_time())
    r, route = await send(pool, [*shared, 2])
    assert r.url == URLS[0] and route.source == "approx" and route.predicted == 512
    finish(pool, r, route)


async def test_a_silent_stream_goes_stale_and_falls_back(autojump_clock: Any) -> None:
    pool, policy = make(kv_events_stale=1.0)
    streams = with_streams(policy)
    shared = system(512, 4)
    publish(streams[URLS[1]], 1, shared)
    r, route = await send(pool, [*shared, 1])
    assert route.source == "events"
    await trio.sleep(1.5)  # no batch since that request was sent
    r2, route2 = await send(pool, [*shared, 2])
    assert r2.url == URLS[1] and route2.source == "approx"
    finish(pool, r, route)
    finish(pool, r2, route2)


async def test_untokenizable_requests_keep_prefix_routing() -> None:
    _pool, policy = make()
    assert await policy.prepare([{"text": "hello"}]) is None  # no tokenizer
    assert await policy.prepare([]) is None
    assert policy.untokenized == 2
    assert policy.endpoints(URLS[0]) == (None, None)
    _, p2 = make(kv_events_port=5557, kv_events_replay_port=5558)
    assert p2.endpoints(URLS[0]) == ("tcp://10.0.0.0:5557", "tcp://10.0.0.0:5558")
    assert p2.endpoints("http://[::1]:30000") == ("tcp://[::1]:5557", "tcp://[::1]:5558")


def test_endpoints_an_engine_advertises() -> None:
    from sieproxy.fleet.cache_route import advertised_endpoints as adv
    url = "http://10.1.2.3:30000"
    assert adv(url, '{"publisher": "zmq", "endpoint": "tcp://*:5557", '
                    '"replay_endpoint": "tcp://*:5558"}') == ("tcp://10.1.2.3:5557",
                                                              "tcp://10.1.2.3:5558")
    assert adv(url, {"endpoint": "tcp://0.0.0.0:7"}) == ("tcp://10.1.2.3:7", None)
    assert adv(url, {"endpoint": "tcp://127.0.0.1:9", "replay_endpoint": "tcp://127.0.0.1:10"}) \
        == ("tcp://127.0.0.1:9", "tcp://127.0.0.1:10")
    assert adv("http://[::1]:1", {"endpoint": "tcp://*:7"}) == ("tcp://[::1]:7", None)
    for off in (None, "", "{", '{"publisher": "null"}', {"endpoint": "http://x"}, 5):
        assert adv(url, off) == (None, None)
