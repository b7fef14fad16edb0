"""A reused keep-alive connection that the engine closed as a request arrived.

An engine closes idle keep-alive connections (uvicorn after 5 s); the gateway's idle check
narrows the window, but a request can still be written on a connection the engine is closing.
It then gets no byte back: it is written once more on a fresh connection to the same engine
before any retry rule applies, and never reported as a malformed response
(``sieproxy.fleet.connection``). A connection that closes mid-response is named as such.
"""

from __future__ import annotations

import pytest
import trio

from engine.fake import DefaultScript, FakeEngine
from sieproxy.core.errors import EngineTruncated

from .harness import MODEL, running_gateway
from .test_engine_client import CHUNKED_OK, SSE, client, raw_server, read_stream


async def test_a_reused_connection_closed_before_the_answer_is_sent_once_more() -> None:
    async def second_dropped(stream: trio.SocketStream, head: bytes) -> bool:
        if len(srv.heads) == 2:
            return False  # the second request on the first connection: closed unanswered
        await stream.send_all(CHUNKED_OK)
        return True

    async with raw_server(second_dropped) as srv:
        c = client()
        base = f"http://127.0.0.1:{srv.port}"
        with trio.fail_after(10):
            assert await read_stream(c, base) == SSE
            assert await read_stream(c, base) == SSE  # reused, dropped, sent again fresh
        assert srv.connections == 2 and len(srv.heads) == 3
        await c.aclose()


async def test_a_fresh_connection_closed_before_the_answer_is_not_sent_again() -> None:
    async def never(stream: trio.SocketStream, head: bytes) -> bool:
        return False

    async with raw_server(never) as srv:
        c = client()
        with trio.fail_after(10), pytest.raises(EngineTruncated) as info:
            await read_stream(c, f"http://127.0.0.1:{srv.port}")
        assert "closed the connection before answering" in info.value.message
        assert "malformed" not in info.value.message
        assert srv.connections == 1 and len(srv.heads) == 1
        await c.aclose()


async def test_a_connection_closed_mid_response_is_named_so() -> None:
    async def cut(stream: trio.SocketStream, head: bytes) -> bool:
        await stream.send_all(CHUNKED_OK[: len(CHUNKED_OK) - 10])
        return False

    async with raw_server(cut) as srv:
        c = client()
        with trio.fail_after(10), pytest.raises(EngineTruncated) as info:
            await read_stream(c, f"http://127.0.0.1:{srv.port}")
        assert "closed the connection before the response's end" in info.value.message
        await c.aclose()


@pytest.mark.parametrize("protocol", ["sglang", "openai"])
@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_the_gateway_resends_on_a_fresh_connection(protocol: str, reset: bool) -> None:
    engine = FakeEngine(DefaultScript(tokens=3))
    async with running_gateway(engine, protocol=protocol) as gw:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        with trio.fail_after(20):
            first = await gw.client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            opened = engine._server.connections_accepted
            engine.drop_reused(1, reset=reset)
            for stream in (False, True):
                resp = await gw.client.post("/v1/chat/completions", json={**body, "stream": stream})
                assert resp.status_code == 200, resp.text
                assert "error" not in resp.text
        assert engine.dropped == 1
        assert engine._server.connections_accepted == opened + 1  # the one fresh connection
        replica = gw.state.pools[MODEL].replicas[0]
        assert replica.failures == 0 and replica.ready  # not an engine failure
