"""KV events over real ZMQ sockets: the engines' publisher (engine/kv_events.py, as the CPU and
fake engines run it) and the gateway's subscriber (sieproxy/fleet/kv_events.py) feeding the index.

The publisher can lose batches (replayable or not), restart and fall silent; every test waits
on the stream's own state (its last sequence, its counters), under ``fail_after``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from engine.kv_events import KVEventPublisher, parse_kv_events_config
from sieproxy.core.routing.kvindex import EventStream, chain_keys, matched_blocks
from sieproxy.fleet.kv_events import follow

B = 4
TOKS = list(range(1, 41))  # ten blocks
KEYS = chain_keys(TOKS, B)


def stored(i: int) -> list[object]:
    """Block ``i`` of TOKS, its engine hash ``100 + i``."""
    return ["BlockStored", [100 + i], None if i == 0 else 99 + i, TOKS[i * B:(i + 1) * B], B, None]


async def until(pred: Callable[[], bool]) -> None:
    while not pred():
        await trio.sleep(0.01)


def loopback(replay: bool = True) -> dict[str, Any]:
    conf = parse_kv_events_config(
        '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"'
        + (', "replay_endpoint": "tcp://127.0.0.1:*"' if replay else "") + "}")
    assert conf is not None
    return conf


async def in_sync(pub: KVEventPublisher, stream: EventStream) -> None:
    """Once the subscriber joined, announce an empty cache until the stream is in sync. With a
    replay socket it is at once (the join's replay from 0 found nothing); without one nothing
    says when the subscription reached the publisher, which drops what it sends before that."""
    await until(lambda: stream.joined)
    while not stream.in_sync(trio.current_time()):
        pub.publish([["AllBlocksCleared"]])
        await trio.sleep(0.02)


@asynccontextmanager
async def wired(replay: bool = True, stale: float = 10.0) -> AsyncIterator[
        tuple[KVEventPublisher, EventStream]]:
    pub = KVEventPublisher(loopback(replay))
    stream = EventStream(capacity_tokens=8 * B, stale_after=stale)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow, stream, pub.endpoint, pub.replay_endpoint)
            await in_sync(pub, stream)
            yield pub, stream
            nursery.cancel_scope.cancel()
    finally:
        pub.close()


def test_config_is_sglangs_json() -> None:
    assert parse_kv_events_config(None) is None
    assert parse_kv_events_config('{"publisher": "null"}') is None
    conf = parse_kv_events_config('{"publisher": "zmq", "topic": "kv"}')
    assert conf is not None and conf["endpoint"] == "tcp://*:5557" and conf["topic"] == "kv"
    for bad in ("[1]", "{", '{"publisher": "kafka"}', '{"publisher": "zmq", "port": 1}'):
        with pytest.raises(ValueError):
            parse_kv_events_config(bad)


async def test_the_index_follows_the_engines_events() -> None:
    with trio.fail_after(20):
        async with wired() as (pub, stream):
            assert stream.in_sync(trio.current_time())  # joined: the replay from 0 was empty
            for i in range(6):
                pub.publish([stored(i)])
            await until(lambda: matched_blocks(KEYS, stream.index) == 6)
            pub.publish([["BlockRemoved", [103]]])
            await until(lambda: matched_blocks(KEYS, stream.index) == 3)
            assert stream.gaps == 0 and stream.in_sync(trio.current_time())


async def test_what_was_published_before_the_subscription_is_replayed_on_joining() -> None:
    conf = loopback()
    pub = KVEventPublisher(conf)
    try:
        for i in range(3):  # no subscriber yet: the PUB socket drops them
            pub.publish([stored(i)])
        pub.flush()
        assert pub.published == 3
        stream = EventStream(capacity_tokens=8 * B)
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow, stream, pub.endpoint, pub.replay_endpoint)
                # the engine then falls idle: only the join's replay brings them
                await until(lambda: stream.last_seq == 2)
                assert stream.joined and stream.in_sync(trio.current_time())
                assert matched_blocks(KEYS, stream.index) == 3 and stream.gaps == 0
                nursery.cancel_scope.cancel()
    finally:
        pub.close()


async def test_a_reconnection_replays_and_a_new_process_shows_its_restart() -> None:
    conf = loopback()
    pub = KVEventPublisher(conf)
    # a wildcard host binds (a concrete one would connect, as in SGLang)
    endpoints = {"endpoint": pub.endpoint.replace("127.0.0.1", "*"),
                 "replay_endpoint": pub.replay_endpoint}
    stream = EventStream(capacity_tokens=8 * B)
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow, stream, pub.endpoint, pub.replay_endpoint)
                await in_sync(pub, stream)
                for batch in ([["AllBlocksCleared"]], [["AllBlocksCleared"]], [stored(0)]):
                    pub.publish(batch)
                await until(lambda: matched_blocks(KEYS, stream.index) == 1)
                assert stream.last_seq == 2
                # the engine process goes and a new one binds the same endpoints, publishing
                # its first batch before the gateway reconnects
                pub.close()
                pub = KVEventPublisher({**conf, **endpoints})
                pub.publish([stored(0)])
                pub.flush()
                await until(lambda: stream.joins == 2 and stream.joined)
                assert not stream.in_sync(trio.current_time())  # suspect until it is known
                pub.publish([stored(1)])  # its sequence 1 after our 2: taken as a restart
                await until(lambda: stream.restarts == 1 and stream.in_sync(trio.current_time()))
                assert matched_blocks(KEYS, stream.index) == 2
                nursery.cancel_scope.cancel()
    finally:
        pub.close()


async def test_lost_batches_are_replayed() -> None:
    with trio.fail_after(20):
        async with wired() as (pub, stream):
            pub.publish([stored(0)])
            pub.skip(2, replayable=True)
            pub.publish([stored(1)])
            pub.publish([stored(2)])  # lost on the wire, kept for the replay
            pub.publish([stored(3)])
            await until(lambda: matched_blocks(KEYS, stream.index) == 4)
            assert stream.gaps == 1 and stream.losses == 0
            assert stream.in_sync(trio.current_time())


async def test_a_gap_the_engine_cannot_replay_falls_out_of_sync() -> None:
    with trio.fail_after(20):
        async with wired() as (pub, stream):
            pub.publish([stored(0)])
            pub.skip(1)  # gone for good
            pub.publish([stored(1)])
            pub.publish([stored(2)])
            await until(lambda: stream.losses == 1 and stream.replay_from is None)
            assert not stream.in_sync(trio.current_time())
            assert matched_blocks(KEYS, stream.index) == 0  # block 2's parent was lost
            for i in range(8):  # the whole cache (8 blocks) stored again: back in sync
                pub.publish([["BlockStored", [200 + i], None, [i] * B, B, None]])
            await until(lambda: stream.in_sync(trio.current_time()))


async def test_a_restarted_engine_is_followed_from_its_new_start() -> None:
    with trio.fail_after(20):
        async with wired() as (pub, stream):
            for i in range(3):
                pub.publish([stored(i)])
            await until(lambda: matched_blocks(KEYS, stream.index) == 3)
            pub.restart()
            pub.publish([stored(0)])
            await until(lambda: stream.restarts == 1)
            assert stream.in_sync(trio.current_time())
            assert matched_blocks(KEYS, stream.index) == 1


async def test_without_a_replay_socket_a_gap_is_lost() -> None:
    with trio.fail_after(20):
        async with wired(replay=False) as (pub, stream):
            before = stream.losses
            pub.skip(1, replayable=True)
            pub.publish([stored(0)])
            pub.publish([stored(1)])
            await until(lambda: stream.losses > before)
            assert not stream.in_sync(trio.current_time())


async def test_a_silent_engine_goes_stale() -> None:
    with trio.fail_after(20):
        async with wired(stale=0.2) as (pub, stream):
            pub.silent = True
            stream.sent(trio.current_time())  # a request went there; no batch comes back
            await until(lambda: not stream.in_sync(trio.current_time()))
            pub.silent = False
            pub.publish([stored(0)])
            await until(lambda: stream.in_sync(trio.current_time()))
