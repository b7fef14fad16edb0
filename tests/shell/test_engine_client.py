"""The upstream client's connection handling, against a scripted raw-socket server.

The server counts connections and records every request head, so each test asserts what the
client got AND what went over the wire: keep-alive reuse, no reuse of a half-read or stale
connection, the pool cap, timeouts, error mapping, base-URL prefixes.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trustme

from sieproxy.core.errors import EngineHTTPError, EngineTruncated, EngineUnreachable
from sieproxy.fleet import client as engine_client
from sieproxy.fleet.client import EngineClient
from sieproxy.settings.load import GatewaySettings

SSE = b'data: {"text":"a","meta_info":{}}\n\ndata: [DONE]\n\n'
CHUNKED_OK = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"%x\r\n%s\r\n0\r\n\r\n" % (len(SSE), SSE)
)
ABORT_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"

Handler = Callable[[Any, bytes], Awaitable[bool]]


@dataclass
class RawServer:
    """Answers each request with ``handler(stream, head)``; the handler returns whether the
    connection stays open for another request."""

    handler: Handler
    port: int = 0
    connections: int = 0
    heads: list[bytes] = field(default_factory=list)
    body_sizes: list[int] = field(default_factory=list)

    async def _serve(self, stream: Any) -> None:
        self.connections += 1
        buf = b""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            async with stream:
                while True:
                    while b"\r\n\r\n" not in buf:
                        data = await stream.receive_some(65536)
                        if not data:
                            return
                        buf += data
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.lower() == b"content-length":
                            length = int(value)
                    while len(buf) < length:
                        buf += await stream.receive_some(65536)
                    self.body_sizes.append(len(buf[:length]))
                    buf = buf[length:]
                    self.heads.append(head)
                    if not await self.handler(stream, head):
                        return


@contextlib.asynccontextmanager
async def raw_server(
    handler: Handler, tls: ssl.SSLContext | None = None
) -> AsyncIterator[RawServer]:
    srv = RawServer(handler)
    async with trio.open_nursery() as nursery:
        listeners: list[Any] = await trio.open_tcp_listeners(0, host="127.0.0.1")
        srv.port = listeners[0].socket.getsockname()[1]
        if tls is not None:
            listeners = [trio.SSLListener(listener, tls) for listener in listeners]
        nursery.start_soon(trio.serve_listeners, srv._serve, listeners)
        yield srv
        nursery.cancel_scope.cancel()


def client(**kw: Any) -> EngineClient:
    return EngineClient(GatewaySettings(connect_timeout=2.0, pool_timeout=0.5, **kw))


async def reply(data: bytes) -> Handler:
    async def handler(stream: trio.SocketStream, head: bytes) -> bool:
        await stream.send_all(ABORT_OK if b"/abort_request" in head else data)
        return True

    return handler


async def read_stream(c: EngineClient, base: str, rid: str = "r") -> bytes:
    async with c.stream_generate(base, {"rid": rid, "stream": True}) as resp:
        out = b""
        while chunk := await resp.receive():
            out += chunk
        return out


async def test_keep_alive_reuses_one_connection() -> None:
    async with raw_server(await reply(CHUNKED_OK)) as srv:
        c = client()
        base = f"http://127.0.0.1:{srv.port}"
        for i in range(5):
            assert await read_stream(c, base, f"r{i}") == SSE
        await c.abort(base, "r0")
        assert srv.connections == 1
        assert len(srv.heads) == 6
        assert srv.heads[0].startswith(b"POST /generate HTTP/1.1\r\n")
        assert b"\r\nHost: 127.0.0.1:%d" % srv.port in srv.heads[0]
        assert srv.heads[-1].startswith(b"POST /abort_request HTTP/1.1\r\n")
        await c.aclose()


async def test_a_stream_left_early_is_closed_not_reused() -> None:
    split = CHUNKED_OK.index(b"\r\n\r\n") + 4

    async def head_then_body(stream: trio.SocketStream, head: bytes) -> bool:
        await stream.send_all(CHUNKED_OK[:split])
        await trio.sleep(0.05)
        await stream.send_all(CHUNKED_OK[split:])
        return True

    async with raw_server(head_then_body) as srv:
        c = client()
        base = f"http://127.0.0.1:{srv.port}"
        async with c.stream_generate(base, {"rid": "a"}) as resp:
            assert resp.status == 200  # left before the body arrived
        assert await read_stream(c, base) == SSE
        assert srv.connections == 2
        await c.aclose()


async def test_a_connection_the_engine_closed_is_not_reused() -> None:
    async def once(stream: trio.SocketStream, head: bytes) -> bool:
        await stream.send_all(CHUNKED_OK)
        return False  # the server closes after each response, without saying so

    async with raw_server(once) as srv:
        c = client()
        base = f"http://127.0.0.1:{srv.port}"
        for _ in range(3):
            assert await read_stream(c, base) == SSE
            await trio.sleep(0.05)  # the close reaches the idle connection
        assert srv.connections == 3
        await c.aclose()


CLOSE_HEADER = CHUNKED_OK.replace(b"200 OK\r\n", b"200 OK\r\nConnection: close\r\n")


@pytest.mark.parametrize(
    ("answer", "expiry"), [(CHUNKED_OK, 0.0), (CLOSE_HEADER, 4.0)], ids=["expired", "close"]
)
async def test_no_reuse_after_expiry_or_connection_close(
    answer: bytes, expiry: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_client, "_IDLE_EXPIRY", expiry)
    async with raw_server(await reply(answer)) as srv:
        c = client()
        base = f"http://127.0.0.1:{srv.port}"
        assert await read_stream(c, base) == SSE
        assert await read_stream(c, base) == SSE
        assert srv.connections == 2
        await c.aclose()


async def test_idle_connections_are_capped() -> None:
    async with raw_server(await reply(CHUNKED_OK)) as srv:
        c = client(max_keepalive_connections=1)
        base = f"http://127.0.0.1:{srv.port}"
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(read_stream, c, base, f"p{i}")
        assert srv.connections == 3
        assert await read_stream(c, base) == SSE
        assert srv.connections == 3  # one of the three was kept
        await c.aclose()


@pytest.mark.parametrize(
    ("status", "expected", "client_status"),
    [(503, EngineHTTPError, 503), (400, EngineHTTPError, 400), (500, EngineHTTPError, 502)],
)
async def test_error_status_is_mapped_and_the_connection_kept(
    status: int, expected: type[Exception], client_status: int
) -> None:
    secret = b"engine secret text"
    answer = b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(secret), secret)
    async with raw_server(await reply(answer)) as srv:
        c = client()
        base = f"http://127.0.0.1:{srv.port}"
        for _ in range(2):
            with pytest.raises(expected) as info:
                await read_stream(c, base)
            assert info.value.status == client_status  # type: ignore[attr-defined]
            assert "secret" not in str(info.value)
        assert srv.connections == 1
        await c.aclose()


async def test_refused_connection_is_unreachable() -> None:
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        c = client()
        with pytest.raises(EngineUnreachable):
            await read_stream(c, f"http://127.0.0.1:{port}")
        await c.aclose()


@pytest.mark.parametrize(
    "answer",
    [b"", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", b"garbage\r\n\r\n"],
    ids=["eof-before-head", "eof-mid-body", "malformed"],
)
async def test_broken_responses_are_truncated_errors(answer: bytes) -> None:
    async def broken(stream: trio.SocketStream, head: bytes) -> bool:
        await stream.send_all(answer)
        return False

    async with raw_server(broken) as srv:
        c = client()
        with pytest.raises(EngineTruncated):
            await read_stream(c, f"http://127.0.0.1:{srv.port}")
        await c.aclose()


async def test_head_timeout() -> None:
    async def silent(stream: trio.SocketStream, head: bytes) -> bool:
        await trio.sleep_forever()
        return False

    async with raw_server(silent) as srv:
        c = client()
        with pytest.raises(trio.TooSlowError):
            async with c.stream_generate(f"http://127.0.0.1:{srv.port}", {}, head_timeout=0.2):
                pass
        await c.aclose()


async def test_pool_cap_waits_then_refuses() -> None:
    release = trio.Event()

    async def slow(stream: trio.SocketStream, head: bytes) -> bool:
        await release.wait()
        await stream.send_all(CHUNKED_OK)
        return True

    async with raw_server(slow) as srv:
        c = client(max_connections=1)
        base = f"http://127.0.0.1:{srv.port}"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stream, c, base, "first")
            await trio.sleep(0.05)
            with pytest.raises(EngineUnreachable, match="Too many engine connections"):
                await read_stream(c, base, "second")  # waits pool_timeout (0.5 s), then 503
            release.set()
        assert await read_stream(c, base, "third") == SSE  # the slot came back
        await c.aclose()


async def test_base_url_prefix_and_bytes_arriving_with_the_head() -> None:
    async with raw_server(await reply(CHUNKED_OK)) as srv:
        c = client()
        assert await read_stream(c, f"http://127.0.0.1:{srv.port}/engine-a/") == SSE
        assert srv.heads[0].startswith(b"POST /engine-a/generate HTTP/1.1\r\n")
        await c.aclose()


async def test_expired_idle_connections_are_closed_on_the_next_checkin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with raw_server(await reply(CHUNKED_OK)) as srv:
        c = client()
        base = f"http://127.0.0.1:{srv.port}"
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(read_stream, c, base, f"p{i}")
        assert c._idle_count == 3
        monkeypatch.setattr(engine_client, "_IDLE_EXPIRY", 0.0)
        assert await read_stream(c, base) == SSE  # reuses one, then closes the two expired
        assert c._idle_count == 1
        await c.aclose()


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


async def test_https_engine_is_verified_and_reused(ca: trustme.CA) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    async with raw_server(await reply(CHUNKED_OK), tls=server_ctx) as srv:
        c = EngineClient(GatewaySettings(connect_timeout=2.0), ssl_context=client_ctx)
        base = f"https://127.0.0.1:{srv.port}"
        for _ in range(3):
            assert await read_stream(c, base) == SSE
        assert srv.connections == 1
        await c.aclose()


async def test_https_engine_with_an_untrusted_certificate_is_unreachable(ca: trustme.CA) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    async with raw_server(await reply(CHUNKED_OK), tls=server_ctx) as srv:
        c = client()  # the system trust store does not know the test CA
        with pytest.raises(EngineUnreachable):
            await read_stream(c, f"https://127.0.0.1:{srv.port}")
        assert srv.heads == []  # nothing was sent over the unverified connection
        await c.aclose()


# ---- plain TCP reads and writes go to the descriptor directly (fleet.connection.Conn) -----------


async def test_a_request_larger_than_the_socket_buffers_is_sent_whole() -> None:
    """Writes that would block wait for the socket and resume where they stopped."""

    async def slow_reader(stream: trio.SocketStream, head: bytes) -> bool:
        await stream.send_all(CHUNKED_OK)
        return True

    prompt = "x" * (8 << 20)  # far above loopback socket buffers
    async with raw_server(slow_reader) as srv:
        c = client()
        base = f"http://127.0.0.1:{srv.port}"
        with trio.fail_after(10):  # a write cut short leaves the server waiting: fail, not hang
            async with c.stream_generate(base, {"text": prompt}, head_timeout=5) as resp:
                assert await resp.read_all(1 << 20) == SSE
        assert srv.body_sizes[0] > 8 << 20
        await c.aclose()


async def test_an_engine_that_does_not_read_the_request_is_unreachable() -> None:
    """``connect_timeout`` bounds the request write (one cancel scope serves both limits)."""
    gate = trio.Event()

    async def never_reads(stream: trio.SocketStream) -> None:
        await gate.wait()

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, never_reads, listeners)
        c = EngineClient(GatewaySettings(connect_timeout=0.3))
        with trio.fail_after(5), pytest.raises(EngineUnreachable, match="take the request"):
            async with c.stream_generate(
                f"http://127.0.0.1:{port}", {"text": "x" * (32 << 20)}, head_timeout=30
            ):
                pass
        gate.set()
        nursery.cancel_scope.cancel()
        await c.aclose()


async def test_receive_nowait_returns_what_is_there_without_waiting() -> None:
    go = trio.Event()
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def in_two_steps(stream: trio.SocketStream, h: bytes) -> bool:
        await stream.send_all(head)
        await go.wait()
        await stream.send_all(b"%x\r\n%s\r\n0\r\n\r\n" % (len(SSE), SSE))
        return True

    async with raw_server(in_two_steps) as srv:
        c = client()
        async with c.stream_generate(f"http://127.0.0.1:{srv.port}", {}) as resp:
            assert resp.receive_nowait() is None  # nothing there yet: no wait, no bytes
            go.set()
            with trio.fail_after(5):
                await resp.wait_readable()
            got = b""
            while (part := resp.receive_nowait()) != b"":
                if part is None:
                    await resp.wait_readable()
                else:
                    got += part
            assert got == SSE
            assert resp.reusable
        await c.aclose()


async def test_closing_a_connection_wakes_its_reader_with_an_error() -> None:
    """The stall sweeper closes an inline candidate's connection from another task: the
    parked reader must end with an error, not wait forever."""

    async def head_only(stream: trio.SocketStream, h: bytes) -> bool:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await trio.sleep_forever()
        return False

    async with raw_server(head_only) as srv:
        c = client()
        base = f"http://127.0.0.1:{srv.port}"
        async with c.stream_generate(base, {}) as resp, trio.open_nursery() as nursery:
            nursery.start_soon(_close_soon, resp)
            with trio.fail_after(5), pytest.raises(EngineTruncated):
                await resp.receive()
        await c.aclose()


async def _close_soon(resp: Any) -> None:
    await trio.sleep(0.05)
    resp.close()


@pytest.mark.parametrize(
    ("answers", "healthy"),
    [
        ({b"/health": 200}, True),
        ({b"/health": 404, b"/v1/models": 200}, True),  # an engine with no /health
        ({b"/health": 503, b"/v1/models": 200}, False),  # /health answered: it decides
        ({b"/health": 404, b"/v1/models": 404}, False),
    ],
)
async def test_health_takes_the_first_probe_the_engine_serves(
    answers: dict[bytes, int], healthy: bool
) -> None:
    async def handler(stream: trio.SocketStream, head: bytes) -> bool:
        path = head.split(b" ")[1]
        status = answers.get(path, 404)
        await stream.send_all(b"HTTP/1.1 %d X\r\nContent-Length: 0\r\n\r\n" % status)
        return True

    async with raw_server(handler) as srv:
        c = client()
        base = f"http://127.0.0.1:{srv.port}"
        assert await c.health(base, ("/health", "/v1/models")) is healthy
        asked = [h.split(b" ")[1] for h in srv.heads]
        assert asked == list(answers)[: 1 if answers[b"/health"] != 404 else 2]
        await c.aclose()
