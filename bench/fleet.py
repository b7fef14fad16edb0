"""``python -m bench fleet``: routing policies over a simulated fleet with prefix caches.

Nothing here is timed on the machine: the run is a discrete-event simulation on Trio's mock
clock (virtual seconds, jumped whenever every task waits), so its figures do not depend on the
2 shared cores and one run takes seconds of real time.

What is real: the gateway's routing. Each request is a chat body planned by the core
(``CHAT.prepare``: template rendering, the prefix-affinity key) and placed by a real
:class:`sieproxy.fleet.pool.ModelPool` (``acquire``/``release``, its health watcher reading each
replica's load every ``load_interval``). Two pools stand for two gateway processes sharing
nothing; the turns of one conversation alternate between them, as behind a load balancer.

What is simulated — each replica (:class:`SimEngine`):

- a prefix cache: the prompt is a chain of token blocks (32 tokens, aligned to messages, each
  block's identity the hash of everything before it), kept in an LRU bounded in tokens; a hit is
  the run of leading blocks present; the prompt's and the answer's blocks are inserted, as
  SGLang's radix cache keeps generated tokens;
- a bounded running batch (``max_running``) with a FIFO queue behind it;
- prefill on one lane per replica: ``overhead + uncached tokens / prefill rate`` (time to first
  token = queue wait + prefill wait + prefill);
- decode at a fixed inter-token latency.

Workload: conversations over a few shared system prompts; each turn resends the whole history
(system prompt, every earlier question and answer) plus a new question; a fixed number of
client sessions each run conversations one after another, with a think time between turns.
"""

from __future__ import annotations

import collections
import hashlib
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
import trio.testing

from sieproxy.core.request.profile import ModelProfile
from sieproxy.fleet.pool import ModelPool, RouteHints
from sieproxy.settings.load import EngineSpec, GatewaySettings
from sieproxy.surfaces import CHAT

MODEL = "sim"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BLOCK = 32
MODES = ("prefix", "least_loaded", "key_only")


@dataclass
class Params:
    replicas: int = 6
    gateways: int = 2
    conversations: int = 400
    sessions: int = 96
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (600, 1500)
    turns: tuple[int, int] = (3, 8)
    question_tokens: tuple[int, int] = (20, 150)
    answer_tokens: tuple[int, int] = (100, 400)
    think: tuple[float, float] = (0.5, 3.0)
    max_running: int = 16
    cache_tokens: int = 48_000
    prefill_tokens_per_s: float = 20_000.0
    prefill_overhead: float = 0.004
    itl: float = 0.025
    health_interval: float = 5.0  # the gateway's defaults
    load_interval: float = 1.0
    seed: int = 7


# ---------------------------------------------------------------------------- the engines


class LRU:
    """Token blocks of one replica's prefix cache, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.size = 0

    def hit(self, blocks: list[tuple[int, int]]) -> int:
        """Tokens of the leading run of ``blocks`` present (touched, deepest first)."""
        n = 0
        for key, _ in blocks:
            if key not in self.blocks:
                break
            n += 1
        for key, _ in reversed(blocks[:n]):  # a prefix outlives its extensions, as in a radix tree
            self.blocks.move_to_end(key)
        return sum(t for _, t in blocks[:n])

    def insert(self, blocks: list[tuple[int, int]]) -> None:
        for key, tokens in reversed(blocks):
            if key in self.blocks:
                self.blocks.move_to_end(key)
            else:
                self.blocks[key] = tokens
                self.size += tokens
        while self.size > self.capacity and self.blocks:
            _, tokens = self.blocks.popitem(last=False)
            self.size -= tokens


class SimEngine:
    def __init__(self, url: str, p: Params) -> None:
        self.url = url
        self.p = p
        self.cache = LRU(p.cache_tokens)
        self.slots = trio.Semaphore(p.max_running)
        self.prefill = trio.Lock()  # one prefill at a time (fair: FIFO)
        self.running = 0
        self.waiting = 0
        self.served = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    async def generate(self, prompt: list[tuple[int, int]], answer: list[tuple[int, int]],
                       answer_tokens: int) -> float:
        """Run one request; returns the virtual time its first token was ready."""
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            async with self.prefill:
                tokens = sum(t for _, t in prompt)
                cached = self.cache.hit(prompt)
                self.prompt_tokens += tokens
                self.cached_tokens += cached
                await trio.sleep(self.p.prefill_overhead
                                 + (tokens - cached) / self.p.prefill_tokens_per_s)
                self.cache.insert(prompt)
            first = trio.current_time()
            await trio.sleep(self.p.itl * max(0, answer_tokens - 1))
            self.cache.insert(prompt + answer)
            self.served += 1
            return first
        finally:
            self.running -= 1
            self.slots.release()


class SimClient:
    """The pool's health watcher's view of the simulated engines (``EngineClient`` subset)."""

    def __init__(self, engines: dict[str, SimEngine]) -> None:
        self.engines = engines

    async def health(self, url: str, paths: tuple[str, ...] = ("/health",)) -> bool:
        return True

    async def server_info(self, url: str) -> dict[str, Any]:
        return {"incremental_streaming_output": True,
                "max_running_requests": self.engines[url].p.max_running}

    async def load(self, url: str) -> tuple[int, int] | None:
        e = self.engines[url]
        return e.running, e.waiting


# ---------------------------------------------------------------------------- the workload


def _blocks(prev: int, seg: str, tokens: int) -> tuple[int, list[tuple[int, int]]]:
    """``tokens`` of segment ``seg`` after a chain ending in ``prev``, as (key, tokens) blocks."""
    out = []
    for i in range(math.ceil(tokens / BLOCK)):
        h = hashlib.blake2b(f"{prev}/{seg}/{i}".encode(), digest_size=8).digest()
        prev = int.from_bytes(h, "big")
        out.append((prev, min(BLOCK, tokens - i * BLOCK)))
    return prev, out


@dataclass
class Conversation:
    cid: int
    system: int
    turns: list[tuple[int, int]]  # (question tokens, answer tokens)


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    started: float = 0.0
    ended: float = 0.0


def workload(p: Params) -> tuple[list[int], list[Conversation]]:
    rnd = random.Random(p.seed)
    systems = [rnd.randint(*p.system_tokens) for _ in range(p.system_prompts)]
    convs = [
        Conversation(
            cid=c,
            system=rnd.randrange(p.system_prompts),
            turns=[(rnd.randint(*p.question_tokens), rnd.randint(*p.answer_tokens))
                   for _ in range(rnd.randint(*p.turns))],
        )
        for c in range(p.conversations)
    ]
    return systems, convs


async def _run_mode(mode: str, p: Params) -> dict[str, Any]:
    systems, convs = workload(p)
    urls = [f"http://replica-{i}:30000" for i in range(p.replicas)]
    engines = {u: SimEngine(u, p) for u in urls}
    g = GatewaySettings(health_interval=p.health_interval, load_interval=p.load_interval,
                        replica_max_inflight=4096, admission_wait=600.0)
    pools = [ModelPool(MODEL, [EngineSpec(url=u) for u in urls], g, routing=mode)
             for _ in range(p.gateways)]
    profiles = {MODEL: ModelProfile(name=MODEL, chat_template=CHATML)}
    client = SimClient(engines)
    res = Result()
    rnd = random.Random(p.seed + 1)
    todo = collections.deque(convs)
    think = [rnd.uniform(*p.think) for _ in range(sum(len(c.turns) for c in convs))]
    seq = iter(range(10**9))

    async def turn(c: Conversation, t: int, messages: list[dict[str, str]],
                   prompt: list[tuple[int, int]], answer: list[tuple[int, int]]) -> None:
        pool = pools[(c.cid + t) % p.gateways]  # the load balancer alternates gateways
        raw = msgspec.json.encode({"model": MODEL, "messages": messages})
        plan = CHAT.prepare(raw, profiles, request_id=f"c{c.cid}t{t}", created=0)
        hints = RouteHints(affinity_key=plan.affinity_key, prefix_key=plan.prefix_key)
        sent = trio.current_time()
        r = await pool.acquire(hints, 1)
        try:
            first = await engines[r.url].generate(prompt, answer, c.turns[t][1])
        finally:
            pool.release(r)
        res.ttft.append(first - sent)
        res.completion_tokens += c.turns[t][1]

    async def session(delay: float) -> None:
        await trio.sleep(delay)  # sessions arrive over the first think time, not all at once
        while todo:
            c = todo.popleft()
            chain, prompt = _blocks(0, f"system-{c.system}", systems[c.system])
            messages = [{"role": "system", "content": f"System prompt {c.system}: be helpful."}]
            for t, (q, a) in enumerate(c.turns):
                chain, qb = _blocks(chain, f"c{c.cid}-q{t}", q)
                prompt = prompt + qb
                messages.append({"role": "user", "content": f"Conversation {c.cid}, question {t}"})
                end, ab = _blocks(chain, f"c{c.cid}-a{t}", a)
                await turn(c, t, messages, prompt, ab)
                chain, prompt = end, prompt + ab
                messages.append({"role": "assistant", "content": f"Answer {t} of {c.cid}"})
                await trio.sleep(think[next(seq)])

    async with trio.open_nursery() as watchers:
        for pool in pools:
            watchers.start_soon(pool.run_health_checks, client)
        await trio.sleep(p.health_interval)  # every replica ready
        res.started = trio.current_time()
        async with trio.open_nursery() as clients:
            for _ in range(p.sessions):
                clients.start_soon(session, rnd.uniform(0, p.think[1]))
        res.ended = trio.current_time()
        watchers.cancel_scope.cancel()

    served = [e.served for e in engines.values()]
    prompt_tokens = sum(e.prompt_tokens for e in engines.values())
    cached = sum(e.cached_tokens for e in engines.values())
    q = statistics.quantiles(res.ttft, n=100)
    span = res.ended - res.started
    return {
        "mode": mode,
        "requests": len(res.ttft),
        "ttft_p50_ms": round(statistics.median(res.ttft) * 1000, 2),
        "ttft_p99_ms": round(q[98] * 1000, 2),
        "cache_hit_rate": round(cached / prompt_tokens, 4),
        "throughput_tok_s": round(res.completion_tokens / span, 1),
        "requests_per_s": round(len(res.ttft) / span, 2),
        "virtual_seconds": round(span, 1),
        "served_per_replica": served,
        "busiest_over_least": round(max(served) / max(1, min(served)), 3),
    }


def run(p: Params, modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    """Each mode on a fresh fleet, same workload and seed, on the mock clock."""
    out = []
    for mode in modes:
        clock = trio.testing.MockClock(autojump_threshold=0)
        out.append(trio.run(_run_mode, mode, p, clock=clock))
    return out
