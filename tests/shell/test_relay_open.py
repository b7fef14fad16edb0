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
from typing import Any

import trio

from engine.fake import FakeEngine, Plan
from sieproxy.core.merger import ChatStream
from sieproxy.engine_client import EngineClient
from sieproxy.pool import ModelPool, RouteHints
from sieproxy.relay import GenerationBody, RequestStats
from sieproxy.settings import EngineSpec, GatewaySettings
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
    shaper = ChatStream(chat(), response_id="chatcmpl-x", model="m", created=CREATED)
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
        stats=RequestStats(request_id="open", model="m", endpoint="chat", n=1, stream=True),
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


async def test_open_is_nothing_for_several_candidates() -> None:
    """``n`` > 1: the candidates' tasks send their requests as they start."""
    sent: list[str] = []

    class _Client:
        def stream_generate(self, url: str, body: dict[str, Any], *, head_timeout: float) -> Any:
            sent.append(body["rid"])
            raise AssertionError("not sent by open()")

    body = _body(_Client(), [free_port()], k=2)  # type: ignore[arg-type]
    assert body._il is None
    assert not await body.open()
    assert sent == []
