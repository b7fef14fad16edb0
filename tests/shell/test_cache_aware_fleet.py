"""``routing = "cache_aware"`` end to end on the loopback: real gateways in front of fake engines
that keep a prefix cache and publish KV events over ZMQ (engine/fake_cache.py).

The model's tokenizer is a byte-level one written here (one token per byte), so a prompt's
tokens are predictable and the gateway and the engines tokenize alike. Engines advertise their
event endpoints in ``/server_info``; the gateway finds and follows them. Tests wait on the
gateway's own state (its index, its counters) or the engines' records, under ``fail_after``.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from engine.fake import DefaultScript, FakeEngine
from engine.fake_cache import FakePrefixCache
from sieproxy.fleet.cache_route import CacheAwarePolicy
from sieproxy.settings.load import Settings

from .harness import MODEL, TEMPLATE, Gateway, another_gateway, running_gateway
from .test_health import chat, served_by

EVENTS = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tok")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return d


def engines(tok: Path, n: int = 3, script: Any = None) -> list[FakeEngine]:
    out = []
    for _ in range(n):
        e = FakeEngine(script)
        e.prefix_cache = FakePrefixCache(str(tok / "tokenizer.json"), block_size=16,
                                         capacity_tokens=50_000, kv_events_config=EVENTS)
        out.append(e)
    return out


def cache_aware(tok: Path, **keys: Any) -> Callable[[Settings], None]:
    def hook(s: Settings) -> None:
        for m in s.models.values():
            m.routing = "cache_aware"
            m.tokenizer, m.chat_template = str(tok), None
            for k, v in keys.items():
                setattr(m, k, v)
    return hook


def policy(gw: Gateway) -> CacheAwarePolicy:
    p = gw.state.pools[MODEL].policy
    assert isinstance(p, CacheAwarePolicy)
    return p


def text(seed: int, n: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice(string.ascii_letters + " ") for _ in range(n))


def msgs(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def until(pred: Callable[[], bool]) -> None:
    while not pred():
        await trio.sleep(0.01)


def subscribed(gw: Gateway) -> bool:
    """Every replica's advertised event stream is followed: the gateway connected to it and
    replayed what was published before (:meth:`EventStream.join`)."""
    caches = policy(gw).caches
    return len(caches) == len(gw.engines) and all(
        rc.stream is not None and rc.stream.joined for rc in caches.values())


def holding(gw: Gateway, i: int, blocks: int) -> Callable[[], bool]:
    url = gw.state.pools[MODEL].replicas[i].url
    return lambda: (s := policy(gw).caches[url].stream) is not None and len(s.index) >= blocks


async def served(gw: Gateway, rid: str, **body: Any) -> int:
    r = await chat(gw, request_id=rid, **body)
    assert r.status_code == 200, r.text
    where = served_by(gw, rid)
    assert len(where) == 1
    return where[0]


def close(es: list[FakeEngine]) -> None:
    for e in es:
        e.prefix_cache.close()


async def test_a_repeated_prefix_goes_where_the_engine_holds_it(tokenizer_dir: Path) -> None:
    es = engines(tokenizer_dir)
    try:
        with trio.fail_after(30):
            async with running_gateway(es, settings_hook=cache_aware(tokenizer_dir)) as gw:
                await until(lambda: subscribed(gw))
                system = text(1, 1500)
                home = await served(gw, "warm", messages=msgs(system, "first question"))
                await until(holding(gw, home, 1500 // 16))
                for i in range(5):
                    r = await chat(gw, request_id=f"again-{i}",
                                   messages=msgs(system, f"question {i}"))
                    assert served_by(gw, f"again-{i}") == [home]
                    usage = r.json()["usage"]
                    assert usage["prompt_tokens_details"]["cached_tokens"] >= 1500
                rc = policy(gw).caches[gw.state.pools[MODEL].replicas[home].url]
                # the engine's reported cached tokens are what routing predicted
                assert rc.outcomes["exact"] >= 5 and rc.outcomes["over"] == 0
                metrics = (await gw.client.get("/metrics")).text
                assert "sieproxy_cache_route_predicted_cached_tokens_total" in metrics
                assert 'sieproxy_cache_route_events_in_sync{model="test-model"' in metrics
    finally:
        close(es)


async def test_a_saturated_replica_spills(tokenizer_dir: Path) -> None:
    es = engines(tokenizer_dir, script=DefaultScript(ttft=1.0))
    hook = cache_aware(tokenizer_dir, prefill_tokens_per_s=1000.0, spill_delay=0.5)
    try:
        with trio.fail_after(30):
            async with running_gateway(es, settings_hook=hook) as gw:
                await until(lambda: subscribed(gw))
                system = text(2, 1500)
                home = await served(gw, "warm", messages=msgs(system, "q"))
                await until(holding(gw, home, 1500 // 16))
                async with trio.open_nursery() as nursery:
                    for i in range(6):  # 300 uncached tokens each; the threshold is 500
                        nursery.start_soon(lambda i=i: chat(
                            gw, request_id=f"burst-{i}", messages=msgs(system, text(100 + i, 300))))
                where = [served_by(gw, f"burst-{i}")[0] for i in range(6)]
                assert where.count(home) >= 1 and len(set(where)) > 1, where
                url = gw.state.pools[MODEL].replicas[home].url
                assert policy(gw).caches[url].spills["prefill"] >= 1
    finally:
        close(es)


async def test_two_gateways_fed_by_the_same_events_route_the_same(tokenizer_dir: Path) -> None:
    es = engines(tokenizer_dir)
    try:
        with trio.fail_after(40):
            async with running_gateway(es, settings_hook=cache_aware(tokenizer_dir)) as gw, \
                    another_gateway(gw) as other:
                await until(lambda: subscribed(gw) and subscribed(other))
                systems = [text(10 + i, 800) for i in range(4)]
                homes = [await served(gw, f"warm-{i}", messages=msgs(s, "q"))
                         for i, s in enumerate(systems)]
                for h in homes:
                    await until(holding(gw, h, 1))
                    await until(holding(other, h, 1))
                await until(lambda: all(
                    len(policy(g).caches[r.url].stream.index) == len(es[j].prefix_cache._lru)
                    for g in (gw, other)
                    for j, r in enumerate(g.state.pools[MODEL].replicas)))
                for i, s in enumerate(systems):
                    a = await served(gw, f"a-{i}", messages=msgs(s, "another"))
                    b = await served(other, f"b-{i}", messages=msgs(s, "yet another"))
                    assert a == b == homes[i]
    finally:
        close(es)


async def test_a_replica_out_of_sync_falls_back_and_resyncs(tokenizer_dir: Path) -> None:
    es = engines(tokenizer_dir)
    try:
        with trio.fail_after(30):
            async with running_gateway(es, settings_hook=cache_aware(tokenizer_dir)) as gw:
                await until(lambda: subscribed(gw))
                system = text(3, 1200)
                home = await served(gw, "warm", messages=msgs(system, "q"))
                await until(holding(gw, home, 1200 // 16))
                url = gw.state.pools[MODEL].replicas[home].url
                stream = policy(gw).caches[url].stream
                assert stream is not None
                pub = es[home].prefix_cache.publisher
                pub.skip(1)  # the next batch is lost for good
                await served(gw, "lost", messages=msgs(system, "lost question"))
                await served(gw, "next", messages=msgs(system, "next question"))
                await until(lambda: stream.losses == 1 and stream.replay_from is None)
                assert not stream.in_sync(trio.current_time())
                # routed on what this gateway sent there: the same replica
                assert await served(gw, "fallback", messages=msgs(system, "q3")) == home
                pub.restart()  # the engine restarts: in sync from its sequence 0
                es[home].prefix_cache._lru.clear()
                assert await served(gw, "after", messages=msgs(system, "q4")) == home
                await until(lambda: stream.restarts >= 1 and stream.in_sync(trio.current_time()))
    finally:
        close(es)


async def test_an_engine_restarted_on_new_endpoints_is_followed_there(tokenizer_dir: Path) -> None:
    es = engines(tokenizer_dir, n=2)
    try:
        with trio.fail_after(30):
            async with running_gateway(es, settings_hook=cache_aware(tokenizer_dir)) as gw:
                await until(lambda: subscribed(gw))
                system = text(5, 800)
                home = await served(gw, "warm", messages=msgs(system, "q"))
                await until(holding(gw, home, 800 // 16))
                replica = gw.state.pools[MODEL].replicas[home]
                rc = policy(gw).caches[replica.url]
                old = rc.following
                # the engine goes down and comes back as a new process, publishing elsewhere
                es[home].healthy = False
                await until(lambda: not replica.ready and rc.stream is not None
                            and rc.stream.suspect and not rc.sized)
                es[home].prefix_cache.close()
                es[home].prefix_cache = FakePrefixCache(
                    str(tokenizer_dir / "tokenizer.json"), kv_events_config=EVENTS)
                es[home].healthy = True
                await until(lambda: rc.following != old and rc.following[0] is not None)
                assert rc.stream is not None
                stream = rc.stream
                # routed on what was sent there; the new process's cache was empty (its replay
                # had nothing), then its first batch (sequence 0) comes
                assert await served(gw, "again", messages=msgs(system, "q2")) == home
                await until(lambda: stream.last_seq == 0 and stream.in_sync(trio.current_time()))
                assert stream.restarts == 1
                assert len(stream.index) == len(es[home].prefix_cache._lru) > 0
    finally:
        close(es)
