"""``python -m bench fleet --workloads ...``: cache-aware routing against the other policies on
a simulated fleet, three workloads, on Trio's mock clock (virtual seconds; see bench/fleet.py).

What is real: the gateway's routing — two :class:`sieproxy.fleet.pool.ModelPool`s (two gateway
processes sharing nothing; the requests alternate between them), with their health watchers
reading each replica's load every ``load_interval``; for ``cache_aware`` each pool has its
real :class:`sieproxy.fleet.cache_route.CacheAwarePolicy`, fed the prompt's token ids, and either no
events (``approx``: the gateway's approximate index alone) or each replica's KV events
(``events``: every cache change is published as an SGLang batch, msgpack-encoded, and fed to
both gateways' streams at once).

What is simulated — each replica: a prefix cache of token blocks (16 tokens, chained from the
prompt's start, an LRU bounded in tokens, refreshed deepest first), the prompt's blocks stored
after its prefill and the answer's after the request; a running batch with a FIFO queue; one
prefill lane, ``overhead + uncached tokens / rate``; decode at a fixed inter-token latency.

Workloads (token ids are synthetic, one fixed list per segment):

- ``shared``: many users, a few long system prompts, one or two short turns each;
- ``multiturn``: conversations over shared system prompts, each turn resending its history;
- ``agent``: agent sessions sharing a long preamble, each step adding a tool result and a reply,
  the context growing to tens of thousands of tokens.

The oracle: one cache holding the whole fleet's memory, fed the same requests in the same
order: the cached tokens no routing can beat. Each policy's cached tokens are reported as a
share of the prompt tokens and against the oracle of its own run.
"""

from __future__ import annotations

import collections
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
import trio.testing

from sieproxy.core.planning.affinity import prefix_key
from sieproxy.core.routing.kvindex import EventStream, chain_keys
from sieproxy.fleet.cache_route import CacheAwarePolicy, Route
from sieproxy.fleet.pool import ModelPool, RouteHints
from sieproxy.settings.load import EngineSpec, GatewaySettings, ModelSettings

MODEL = "sim"
BLOCK = 16
POLICIES = ("least_loaded", "prefix", "approx", "events")
WORKLOADS = ("shared", "multiturn", "agent")


@dataclass
class Params:
    workload: str = "multiturn"
    replicas: int = 6
    gateways: int = 2
    sessions: int = 96
    conversations: int = 400
    cache_tokens: int = 48_000
    max_running: int = 16
    prefill_tokens_per_s: float = 20_000.0
    prefill_overhead: float = 0.004
    itl: float = 0.025
    think: tuple[float, float] = (0.5, 3.0)
    health_interval: float = 5.0
    load_interval: float = 1.0
    spill_delay: float = 0.5
    seed: int = 7


def params_for(workload: str, **kw: Any) -> Params:
    base: dict[str, Any] = {
        "shared": {"conversations": 600, "sessions": 96},
        "multiturn": {"conversations": 400, "sessions": 96},
        "agent": {"conversations": 48, "sessions": 24, "cache_tokens": 400_000},
    }[workload]
    return Params(workload=workload, **{**base, **kw})


# ---------------------------------------------------------------------------- tokens


class Segments:
    """Fixed synthetic token ids per named segment."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._cache: dict[str, list[int]] = {}

    def __call__(self, name: str, n: int) -> list[int]:
        toks = self._cache.get(name)
        if toks is None or len(toks) != n:
            rnd = random.Random(f"{self.seed}/{name}")
            toks = self._cache[name] = [rnd.randrange(1, 100_000) for _ in range(n)]
        return toks


@dataclass
class Turn:
    added: list[tuple[str, int]]  # segments the prompt adds before this turn's answer
    answer: int


@dataclass
class Session:
    sid: int
    opening: tuple[str, int]  # the shared prefix (system prompt / preamble)
    turns: list[Turn]


def sessions(p: Params) -> list[Session]:
    rnd = random.Random(p.seed)
    out = []
    for c in range(p.conversations):
        if p.workload == "shared":
            s = rnd.randrange(16)
            opening = (f"system-{s}", 3000 + 331 * s)  # 3,000-8,000 tokens: 88,000 in all
            turns = [Turn([(f"c{c}-q{t}", rnd.randint(30, 200))], rnd.randint(50, 200))
                     for t in range(rnd.randint(1, 2))]
        elif p.workload == "multiturn":
            s = rnd.randrange(8)
            opening = (f"system-{s}", 600 + 113 * s)
            turns = [Turn([(f"c{c}-q{t}", rnd.randint(20, 150))], rnd.randint(100, 400))
                     for t in range(rnd.randint(3, 8))]
        else:  # agent
            s = rnd.randrange(2)
            opening = (f"preamble-{s}", 5000 + 2000 * s)
            steps = rnd.randint(10, 24)
            turns = [Turn([(f"c{c}-task", rnd.randint(100, 400))], rnd.randint(50, 200))]
            turns += [Turn([(f"c{c}-tool{t}", rnd.randint(500, 3000))], rnd.randint(50, 250))
                      for t in range(steps)]
        out.append(Session(c, opening, turns))
    return out


# ---------------------------------------------------------------------------- engines


class Cache:
    """One replica's prefix cache: chained 16-token blocks in an LRU bounded in tokens."""

    def __init__(self, capacity_tokens: int,
                 publish: Callable[[list[Any]], None] | None = None) -> None:
        self.capacity = capacity_tokens // BLOCK
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.publish = publish

    def hit(self, keys: list[int], prompt_tokens: int) -> int:
        n = 0
        for k in keys:
            if k not in self.lru:
                break
            n += 1
        for k in reversed(keys[:n]):
            self.lru.move_to_end(k)
        return min(n * BLOCK, (prompt_tokens - 1) // BLOCK * BLOCK)

    def insert(self, tokens: list[int], keys: list[int]) -> None:
        present = 0
        for k in keys:
            if k not in self.lru:
                break
            present += 1
        for k in reversed(keys[:present]):  # the path extended is the most recent: kept
            self.lru.move_to_end(k)
        new = keys[present:max(present, self.capacity)]
        removed = []
        while new and len(self.lru) + len(new) > self.capacity:
            gone, _ = self.lru.popitem(last=False)
            removed.append(gone)
        for k in new:
            self.lru[k] = None
        if self.publish is not None and (new or removed):
            events: list[Any] = []
            if removed:
                events.append(["BlockRemoved", removed])
            if new:
                start = present * BLOCK
                events.append(["BlockStored", new, keys[present - 1] if present else None,
                               tokens[start:start + len(new) * BLOCK], BLOCK, None])
            self.publish(events)


class SimEngine:
    def __init__(self, url: str, p: Params, publish: Callable[[list[Any]], None] | None) -> None:
        self.url = url
        self.p = p
        self.cache = Cache(p.cache_tokens, publish)
        self.slots = trio.Semaphore(p.max_running)
        self.prefill = trio.Lock()
        self.running = self.waiting = self.served = 0
        self.prompt_tokens = self.cached_tokens = 0

    async def generate(self, tokens: list[int], keys: list[int], answer: list[int],
                       full_keys: list[int], first: Callable[[int], None]) -> None:
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            async with self.prefill:
                cached = self.cache.hit(keys, len(tokens))
                self.prompt_tokens += len(tokens)
                self.cached_tokens += cached
                await trio.sleep(self.p.prefill_overhead
                                 + (len(tokens) - cached) / self.p.prefill_tokens_per_s)
                self.cache.insert(tokens, keys)
            first(cached)
            await trio.sleep(self.p.itl * max(0, len(answer) - 1))
            self.cache.insert(tokens + answer, full_keys)
            self.served += 1
        finally:
            self.running -= 1
            self.slots.release()


class SimClient:
    def __init__(self, engines: dict[str, SimEngine]) -> None:
        self.engines = engines

    async def health(self, url: str, paths: tuple[str, ...] = ("/health",)) -> bool:
        return True

    async def server_info(self, url: str) -> dict[str, Any]:
        return {"max_running_requests": self.engines[url].p.max_running}

    async def load(self, url: str) -> tuple[int, int] | None:
        e = self.engines[url]
        return e.running, e.waiting


# ---------------------------------------------------------------------------- a run


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    order: list[tuple[list[int], list[int], int]] = field(default_factory=list)


def oracle(p: Params, order: list[tuple[list[int], list[int], int]]) -> int:
    """Cached tokens of one cache of the fleet's whole memory, same requests, same order."""
    cache = Cache(p.cache_tokens * p.replicas)
    total = 0
    for keys, full_keys, n in order:
        total += cache.hit(keys, n)
        cache.lru.update((k, None) for k in full_keys)
        for k in reversed(full_keys):
            cache.lru.move_to_end(k)
        while len(cache.lru) > cache.capacity:
            cache.lru.popitem(last=False)
    return total


async def _run(policy: str, p: Params) -> dict[str, Any]:
    urls = [f"http://replica-{i}:30000" for i in range(p.replicas)]
    routing = "cache_aware" if policy in ("approx", "events") else policy
    g = GatewaySettings(health_interval=p.health_interval, load_interval=p.load_interval,
                        replica_max_inflight=4096, admission_wait=600.0)
    ms = ModelSettings(engines=list(urls), routing="cache_aware", cache_tokens=p.cache_tokens,
                       prefill_tokens_per_s=p.prefill_tokens_per_s, spill_delay=p.spill_delay)
    pools = []
    for _ in range(p.gateways):
        pool = ModelPool(MODEL, [EngineSpec(url=u) for u in urls], g, routing=routing)
        if routing == "cache_aware":
            pool.policy = CacheAwarePolicy(MODEL, ms)
        pools.append(pool)
    streams: dict[str, list[EventStream]] = {u: [] for u in urls}
    if policy == "events":
        for pool in pools:
            for u in urls:
                rc = pool.policy.cache(u)
                rc.stream = EventStream(p.cache_tokens, ms.kv_events_stale)
                streams[u].append(rc.stream)
    seqs = dict.fromkeys(urls, 0)

    def publisher(url: str) -> Callable[[list[Any]], None] | None:
        if policy != "events":
            return None

        def publish(events: list[Any]) -> None:
            payload = msgspec.msgpack.encode([trio.current_time(), events])
            for s in streams[url]:
                s.receive(seqs[url], payload, trio.current_time())
            seqs[url] += 1
        return publish

    engines = {u: SimEngine(u, p, publisher(u)) for u in urls}
    client = SimClient(engines)
    seg = Segments(p.seed)
    res = Result()
    rnd = random.Random(p.seed + 1)
    todo = collections.deque(sessions(p))
    counter = iter(range(10**9))

    async def request(s: Session, t: int, tokens: list[int], answer: list[int]) -> None:
        pool = pools[(s.sid + t) % p.gateways]
        keys = chain_keys(tokens, BLOCK)
        full_keys = chain_keys(tokens + answer, BLOCK)
        res.order.append((keys, full_keys, len(tokens)))
        route: Route | None = None
        if pool.policy is not None:
            route = await pool.policy.prepare([{"input_ids": tokens}])
        hints = RouteHints(prefix_key=prefix_key(f"{s.opening[0]}/{s.sid}/{s.turns[0].added}"),
                           route=route)
        sent = trio.current_time()
        r = await pool.acquire(hints, 1)
        got: list[float] = []

        def first(cached: int) -> None:
            got.append(trio.current_time())
            if route is not None:
                route.policy.first_token(route)
                route.policy.done(route, cached)

        try:
            await engines[r.url].generate(tokens, keys, answer, full_keys, first)
        finally:
            pool.release(r)
        res.ttft.append(got[0] - sent)
        res.completion_tokens += len(answer)

    async def session(delay: float) -> None:
        await trio.sleep(delay)
        while todo:
            s = todo.popleft()
            tokens = list(seg(*s.opening))
            for t, turn in enumerate(s.turns):
                for name, n in turn.added:
                    tokens = tokens + seg(name, n)
                answer = seg(f"{s.sid}-a{t}", turn.answer)
                await request(s, t, tokens, answer)
                tokens = tokens + answer
                await trio.sleep(rnd.uniform(*p.think) if next(counter) >= 0 else 0)

    async with trio.open_nursery() as watchers:
        for pool in pools:
            watchers.start_soon(pool.run_health_checks, client)
        await trio.sleep(p.health_interval)
        started = trio.current_time()
        async with trio.open_nursery() as clients:
            for _ in range(p.sessions):
                clients.start_soon(session, rnd.uniform(0, p.think[1]))
        ended = trio.current_time()
        watchers.cancel_scope.cancel()

    served = [e.served for e in engines.values()]
    prompt = sum(e.prompt_tokens for e in engines.values())
    cached = sum(e.cached_tokens for e in engines.values())
    best = oracle(p, res.order)
    q = statistics.quantiles(res.ttft, n=100)
    span = ended - started
    spills = 0
    predicted = reported = 0
    for pool in pools:
        if pool.policy is not None:
            for rc in pool.policy.caches.values():
                spills += sum(rc.spills.values())
                predicted += rc.predicted
                reported += rc.reported
    return {
        "workload": p.workload,
        "policy": policy,
        "requests": len(res.ttft),
        "ttft_p50_ms": round(statistics.median(res.ttft) * 1000, 2),
        "ttft_p99_ms": round(q[98] * 1000, 2),
        "cached_share": round(cached / prompt, 4),
        "oracle_share": round(best / prompt, 4),
        "vs_oracle": round(cached / best, 4) if best else 1.0,
        "throughput_tok_s": round(res.completion_tokens / span, 1),
        "virtual_seconds": round(span, 1),
        "served_per_replica": served,
        "busiest_over_least": round(max(served) / max(1, min(served)), 3),
        "spills": spills,
        "predicted_over_reported": round(predicted / reported, 4) if reported else None,
    }


def run(p: Params, policies: tuple[str, ...] = POLICIES) -> list[dict[str, Any]]:
    """Each policy on a fresh fleet, same workload and seed, on the mock clock."""
    out = []
    for policy in policies:
        clock = trio.testing.MockClock(autojump_threshold=0)
        out.append(trio.run(_run, policy, p, clock=clock))
    return out
