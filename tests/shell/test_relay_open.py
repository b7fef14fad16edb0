"""``GenerationBody.open``: the inline candidate's engine request is sent before ``prime()``
waits for the response, through the real upstream client and the scripted fake engine.

The route (``sieproxy.app``) makes the client's response head in that window; these tests pin
what the split must keep: the engine has the request when ``open()`` returns, a failure to send
is handled by ``prime()`` as its own (a retry on another ready replica), and a response that is
never awaited is aborted upstream and its connection closed, not pooled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio

from engine.fake import FakeEngine, Plan
from sieproxy.core.shaping.merger import ChatStream
from sieproxy.fleet.client import EngineClient, Exchange
from sieproxy.fleet.pool import ModelPool, RouteHints
from sieproxy.relay.body import GenerationBody, RequestStats
from sieproxy.settings.load import EngineSpec, GatewaySettings
from tests.core.test_merger import CREATED, chat, decode
from tests.engine.test_supervisor import free_port


@asynccontextmanager
async def _served(plan: Plan) -> AsyncIterator[tuple[FakeEngine, EngineClient, int]]:
    """A fake engine that plays ``plan`` for every request, its port, and an upstream client."""
    engine = FakeEngine(script=lambda call: plan)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(engine.serve)
        client = EngineClient(GatewaySettings())
        try:
            yield engine, client, port
        finally:
            await client.aclose()
            nursery.cancel_scope.cancel()


async def _open_until(
    body: GenerationBody, engine: FakeEngine, rids: Callable[[], set[str]]
) -> None:
    """``open()``, then wait until the engine has the rid (in ``rids()``)."""
    assert await body.open()
    with trio.fail_after(5):
        await engine.wait_for(lambda: "open-0" in rids())


def _body(client: EngineClient, ports: list[int], k: int = 1) -> GenerationBody:
    g = GatewaySettings()
    pool = ModelPool("m", [EngineSpec(url=f"http://127.0.0.1:{p}") for p in ports], g)
    for r in pool.replicas:
        r.ready = True
    shaper = ChatStream(chat(k), response_id="chatcmpl-x", model="m", created=CREATED)
    sp = {"max_new_tokens": 3}
    bodies = [{"rid": f"open-{i}", "text": "hi", "stream": True, "sampling_params": sp}
              for i in range(k)]
    return GenerationBody(
        g=g,
        client=client,
        pool=pool,
        replica=pool.replicas[0],
        hints=RouteHints(),
        bodies=bodies,
        shaper=shaper,
        streaming=True,
        stats=RequestStats(request_id="open", model="m", endpoint="chat", n=k, stream=True),
    )


def _text(frames: bytes) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in decode(frames)
        if isinstance(e, dict) and e.get("choices")
    )


async def _drain(body: GenerationBody) -> bytes:
    out = await body.prime()
    async for frames in body:
        out += frames
    return out


async def test_open_sends_the_request_before_prime_waits() -> None:
    async with _served(Plan([" a", " b", " c"])) as (engine, client, port):
        body = _body(client, [port])
        async with body:
            await _open_until(body, engine, lambda: {*engine.running, *engine.finished})
            out = await _drain(body)
        assert _text(out) == " a b c" and decode(out)[-1] == "[DONE]"
        assert engine.aborts == [] and not body.stats.retried
        assert client._idle_count == 1  # read to its end: pooled for the next request


async def test_a_request_open_could_not_send_is_retried_by_prime() -> None:
    async with _served(Plan([" a", " b", " c"])) as (engine, client, port):
        body = _body(client, [free_port(), port])  # nothing listens on the first
        async with body:
            assert not await body.open()  # the first replica refuses: kept for prime()
            out = await _drain(body)
        assert _text(out) == " a b c"
        assert body.stats.retried and body.replica.url.endswith(f":{port}")
        assert [b["rid"] for p, b in engine.requests if p == "/generate"] == ["open-0"]


async def test_a_response_never_awaited_is_aborted_and_its_connection_closed() -> None:
    async with _served(Plan([" a"] * 50, ttft=30.0)) as (engine, client, port):
        body = _body(client, [port])
        async with body:
            await _open_until(body, engine, lambda: engine.running)
        # The body left without prime(): the client went away while the engine worked.
        with trio.fail_after(5):
            await engine.wait_for(lambda: not engine.running)
        assert engine.aborts == ["open-0"]
        # Its connection was closed: what stays open (and pooled) is the abort's own.
        with trio.fail_after(5):
            await engine.wait_for(lambda: engine.statistics().connections_open == 1)
        assert engine.statistics().connections_accepted == 2 and client._idle_count == 1
        assert client._in_use.value == GatewaySettings().max_connections  # none checked out


async def test_open_sends_every_candidates_request_from_the_calling_task() -> None:
    """``n`` > 1: ``open()`` sends each candidate's request itself, one after the other,
    before the candidates' tasks start; each task then waits for its answer."""
    senders: list[tuple[object, bool]] = []
    real_send = Exchange.send

    async def spy(self: Exchange) -> None:
        senders.append((trio.lowlevel.current_task(), body._fan.recv is None))
        await real_send(self)

    async with _served(Plan([" a", " b", " c"])) as (engine, client, port):
        body = _body(client, [port], k=3)
        assert body._il is None
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Exchange, "send", spy)
            async with body:
                assert await body.open()
                out = await _drain(body)
        assert engine.aborts == [] and client._idle_count == 3  # all read to their ends
    me = trio.lowlevel.current_task()
    assert senders == [(me, True)] * 3  # this task, before the candidates' channel existed
    texts = {}
    for e in decode(out):
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    assert texts == {0: " a b c", 1: " a b c", 2: " a b c"}


async def test_a_candidate_open_could_not_send_fails_in_its_task() -> None:
    """A candidate whose request ``open()`` could not send ends as if its task had tried:
    the engine refused the connection, so the whole answer is retried on the other replica."""
    async with _served(Plan([" a", " b", " c"])) as (engine, client, port):
        body = _body(client, [free_port(), port], k=2)  # nothing listens on the first
        async with body:
            assert not await body.open()
            out = await _drain(body)
        assert body.stats.retried and body.replica.url.endswith(f":{port}")
        assert sorted(b["rid"] for p, b in engine.requests if p == "/generate") == [
            "open-0", "open-1"]
        assert decode(out)[-1] == "[DONE]" and engine.aborts == []


async def test_candidates_open_sent_are_aborted_when_the_client_leaves() -> None:
    """The body left right after ``open()`` (the client went away while the engine worked):
    every sent candidate is aborted and its connection closed, none left checked out."""
    async with _served(Plan([" a"] * 50, ttft=30.0)) as (engine, client, port):
        body = _body(client, [port], k=3)
        async with body:
            assert await body.open()
            with trio.fail_after(5):
                await engine.wait_for(lambda: len(engine.running) == 3)
        with trio.fail_after(5):
            await engine.wait_for(lambda: not engine.running)
        assert sorted(engine.aborts) == ["open-0", "open-1", "open-2"]
        assert client.spare_connections == GatewaySettings().max_connections


async def test_open_leaves_to_the_tasks_what_finds_no_connection_slot() -> None:
    """With fewer connection slots than candidates, ``open()`` sends what has a slot and the
    tasks send the rest as slots free up: it never waits for a slot its own unread requests
    hold (which would hang until the pool timeout)."""
    async with _served(Plan([" a", " b"])) as (engine, client, port):
        client._in_use = trio.Semaphore(2)  # two connections in all, three candidates
        body = _body(client, [port], k=3)
        with trio.fail_after(10):
            async with body:
                assert not await body.open()
                out = await _drain(body)
        assert decode(out)[-1] == "[DONE]" and engine.aborts == []
        assert len([b for p, b in engine.requests if p == "/generate"]) == 3
