"""sieproxy.front.hypercorn_io: the direct socket write for Hypercorn's Trio worker.

Checked on a socket pair with the real Hypercorn ``TCPServer`` underneath: bytes of concurrent
writers never interleave or reorder, the rest of a partial write is sent even when its writer
is cancelled, a cancelled writer writes nothing, a closed peer is reported as ``Closed``, TLS
streams take Hypercorn's own path, and ``sieproxy serve`` and ``sieproxy.asgi`` install the
class. On a real gateway: streamed bodies go out through ``chunk_writer`` with framing that a
strict HTTP/1.1 parser (h11, client side) accepts, on a connection that stays usable; an
HTTP/1.0 client gets Hypercorn's framing; a connection that must close after its response is
closed.
"""

from __future__ import annotations

import importlib
import json
import socket
from typing import Any

import h11
import hypercorn.trio.run as hypercorn_run
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.events import Body
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.tcp_server import TCPServer as HypercornTCPServer
from hypercorn.trio.worker_context import WorkerContext

from sieproxy.front import hypercorn_io
from sieproxy.front.hypercorn_io import TCPServer, asgi_side, connection
from sieproxy.front.hypercorn_io import body as writers

from .harness import (
    MODEL,
    Gateway,
    connection_tasks,
    exchange,
    host_port,
    running_gateway,
    sse_events,
)


class _Protocol:
    protocol = None  # no HTTP/1.1 protocol behind it: ``chunk_writer()`` gives None

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def handle(self, event: Event) -> None:
        self.events.append(event)


def _server(stream: Any) -> tuple[TCPServer, _Protocol]:
    server = TCPServer(None, Config(), WorkerContext(None), {}, stream)  # type: ignore[arg-type]
    proto = _Protocol()
    server.protocol = proto  # type: ignore[assignment]
    return server, proto


def _pair(sndbuf: int | None = None) -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    if sndbuf is not None:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    return trio.SocketStream(a), trio.SocketStream(b)


async def _read_exactly(stream: trio.SocketStream, n: int, pause: float = 0.0) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = await stream.receive_some(4096)
        assert data, f"EOF after {len(out)} of {n} bytes"
        out += data
        if pause:
            await trio.sleep(pause)
    return bytes(out)


async def test_small_writes_go_out_whole_and_in_order() -> None:
    mine, peer = _pair()
    server, proto = _server(mine)
    for k in range(50):
        await server.protocol_send(RawData(data=b"%03d;" % k))
    got = await _read_exactly(peer, 50 * 4)
    assert got == b"".join(b"%03d;" % k for k in range(50))
    assert proto.events == []


async def test_concurrent_large_writes_never_interleave() -> None:
    """Writes larger than the socket buffers, from three tasks, to a slow reader: each write
    arrives contiguous and each task's writes arrive in its order (partial writes finish
    under the lock before anything else is written)."""
    mine, peer = _pair(sndbuf=8192)
    server, _ = _server(mine)
    size, per_task = 50_000, 4
    writes = {t: [bytes([65 + t]) * size for _ in range(per_task)] for t in range(3)}

    async def writer(t: int) -> None:
        for k, w in enumerate(writes[t]):
            await server.protocol_send(RawData(data=w[:-1] + bytes([48 + k])))

    total = 3 * per_task * size
    async with trio.open_nursery() as nursery:
        for t in range(3):
            nursery.start_soon(writer, t)
        got = await _read_exactly(peer, total, pause=0.0005)
    pieces = [got[i : i + size] for i in range(0, total, size)]
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for p in pieces:
        t = p[0] - 65
        assert p[:-1] == bytes([65 + t]) * (size - 1), "a write was interleaved with another"
        seen[t].append(p[-1] - 48)
    assert seen == {t: list(range(per_task)) for t in range(3)}


async def test_a_cancelled_writer_finishes_its_partial_write() -> None:
    mine, peer = _pair(sndbuf=8192)
    server, _ = _server(mine)
    big = bytes(range(256)) * 2000  # 512 KB: far more than the buffers hold
    finished = []

    async def write_then_cancelled() -> None:
        with trio.CancelScope() as s:
            nursery.start_soon(_cancel_soon, s)
            await server.protocol_send(RawData(data=big))
            finished.append(True)  # the rest is shielded, as in Hypercorn: not cancelled

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write_then_cancelled)
            await trio.sleep(0.05)  # the reader starts after the cancellation
            got = await _read_exactly(peer, len(big), pause=0.001)
    assert got == big
    assert finished == [True]


async def _cancel_soon(scope: trio.CancelScope) -> None:
    await trio.sleep(0.01)
    scope.cancel()


async def test_a_cancelled_writer_writes_nothing() -> None:
    mine, peer = _pair()
    server, _ = _server(mine)
    with trio.CancelScope() as scope:
        scope.cancel()
        await server.protocol_send(RawData(data=b"never"))
        raise AssertionError("wrote although cancelled")
    assert scope.cancelled_caught
    await server.protocol_send(RawData(data=b"after"))
    assert await _read_exactly(peer, 5) == b"after"


async def test_a_closed_peer_is_reported_as_closed() -> None:
    mine, peer = _pair()
    server, proto = _server(mine)
    await peer.aclose()
    with trio.fail_after(5):
        while not proto.events:
            await server.protocol_send(RawData(data=b"x" * 1000))
    assert isinstance(proto.events[0], Closed)


async def test_a_closed_own_socket_is_reported_as_closed() -> None:
    mine, _peer = _pair()
    server, proto = _server(mine)
    mine.socket.close()
    await server.protocol_send(RawData(data=b"x"))
    assert [type(e) for e in proto.events] == [Closed]


class _RecordingStream:
    """Not a SocketStream (as a TLS stream is not): must get Hypercorn's own path."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send_all(self, data: bytes) -> None:
        self.sent.append(bytes(data))


async def test_other_streams_take_hypercorns_path() -> None:
    stream = _RecordingStream()
    server, _ = _server(stream)
    await server.protocol_send(RawData(data=b"abc"))
    assert stream.sent == [b"abc"]


async def test_serve_installs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hypercorn_run, "TCPServer", HypercornTCPServer)
    async with running_gateway() as gw:  # sieproxy.operations.serve.serve
        assert hypercorn_run.TCPServer is TCPServer  # type: ignore[attr-defined]
        r = await gw.chat(max_tokens=3, stream=True)
        assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"


def test_install_and_the_asgi_entry_point(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """``install`` sets the worker's class and puts the previous one back; ``sieproxy.asgi``
    patches nothing when imported, and installs at the app's start."""
    # monkeypatch puts Hypercorn's own class back afterwards
    monkeypatch.setattr(hypercorn_run, "TCPServer", object)
    undo = hypercorn_io.install()
    assert hypercorn_run.TCPServer is TCPServer  # type: ignore[attr-defined]
    undo()
    assert hypercorn_run.TCPServer is object  # type: ignore[attr-defined]
    cfg = tmp_path / "g.toml"
    cfg.write_text('[models.m]\nengines = ["http://127.0.0.1:9"]\nchat_template = "x"\n')
    monkeypatch.setenv("SIEPROXY_CONFIG", str(cfg))
    # not in the test process
    monkeypatch.setattr("sieproxy.operations.serve.tune_gc", lambda: None)
    import sieproxy.asgi

    importlib.reload(sieproxy.asgi)
    assert hypercorn_run.TCPServer is object  # type: ignore[attr-defined]
    trio.run(sieproxy.asgi._install_front)
    assert hypercorn_run.TCPServer is TCPServer  # type: ignore[attr-defined]
    assert sieproxy.asgi._install_front in sieproxy.asgi.app.before_serving_funcs
    trio.run(sieproxy.asgi._uninstall_front)
    assert hypercorn_run.TCPServer is object  # type: ignore[attr-defined]


# --- chunk_writer: streamed bodies framed by the gateway, on a real gateway ---------------------


class _Paths:
    """Counts body pieces by the way they reach the socket: through h11 (``Body`` events at
    Hypercorn's HTTP/1.1 protocol) or framed by the gateway (``chunk_writer``'s writes, the
    relay pump's and ``send_together``'s first piece all frame with ``_frame``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.h11_bodies = 0
        self.direct = 0
        stream_send = H11Protocol.stream_send
        frame = writers._frame

        async def counting_stream_send(proto: H11Protocol, event: Any) -> None:
            self.h11_bodies += isinstance(event, Body)
            await stream_send(proto, event)

        def counting_frame(data: bytes) -> bytes:
            self.direct += 1
            return frame(data)

        monkeypatch.setattr(H11Protocol, "stream_send", counting_stream_send)
        monkeypatch.setattr(writers, "_frame", counting_frame)

    def reset(self) -> None:  # the harness's readiness probes went h11's way
        self.h11_bodies = self.direct = 0


def _post(path: str, body: dict[str, Any], **headers: str) -> h11.Request:
    data = json.dumps(body).encode()
    hdrs = [("Host", "gateway"), ("Content-Type", "application/json")]
    hdrs += [("Content-Length", str(len(data))), *headers.items()]
    return h11.Request(method="POST", target=path, headers=hdrs), data  # type: ignore[return-value]


async def _until_closed(gw: Gateway, raw: bytes) -> bytes:
    """Send ``raw`` on a new connection; everything the gateway sends until it closes it."""
    host, port = host_port(gw)
    got = bytearray()
    with trio.fail_after(10):
        sock = await trio.open_tcp_stream(host, int(port))
        await sock.send_all(raw)
        while chunk := await sock.receive_some(65536):
            got += chunk
    await sock.aclose()
    return bytes(got)


async def _kept_alive(gw: Gateway) -> tuple[trio.SocketStream, h11.Connection]:
    """A new connection to the gateway and the h11 client state that parses its answers."""
    host, port = host_port(gw)
    return await trio.open_tcp_stream(host, int(port)), h11.Connection(h11.CLIENT)


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


async def test_streamed_bodies_are_framed_directly_and_the_connection_stays_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A streamed chat on a kept-alive HTTP/1.1 connection: every piece of the body after the
    head is framed by the gateway (none by h11; the last one goes out with the body's end, in
    one write: ``send_together``), h11 on the client side parses the framing (so every chunk
    and the final ``0\\r\\n\\r\\n`` are well formed), and the same connection then serves a
    non-streamed request (its answer goes out with its head and its end, in one write) and a
    streamed legacy completion."""
    paths = _Paths(monkeypatch)
    async with running_gateway() as gw:
        paths.reset()
        sock, conn = await _kept_alive(gw)
        with trio.fail_after(20):
            head, body = await exchange(
                sock, conn, *_post("/v1/chat/completions", _chat(stream=True, max_tokens=12))
            )
            assert head.status_code == 200
            assert (b"transfer-encoding", b"chunked") in head.headers
            events = sse_events(body.decode())
            assert events[-1] == "[DONE]" and len(events) >= 13  # role, 12 tokens, finish
            assert paths.h11_bodies == 0 and paths.direct >= 2
            direct = paths.direct

            head, body = await exchange(
                sock, conn, *_post("/v1/chat/completions", _chat(max_tokens=3))
            )
            assert head.status_code == 200
            assert json.loads(body)["object"] == "chat.completion"
            # The whole answer: one piece, framed by h11 with the head and the end (one write).
            assert paths.direct == direct and paths.h11_bodies == 1
            paths.h11_bodies = 0

            head, body = await exchange(
                sock,
                conn,
                *_post(
                    "/v1/completions",
                    {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 4},
                ),
            )
            assert head.status_code == 200 and sse_events(body.decode())[-1] == "[DONE]"
            assert paths.direct > direct
        await sock.aclose()


async def test_an_http10_client_gets_hypercorns_framing(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP/1.0 has no chunked framing: h11 delimits the body by closing the connection, and
    the gateway leaves every piece to it."""
    paths = _Paths(monkeypatch)
    async with running_gateway() as gw:
        paths.reset()
        data = json.dumps(_chat(stream=True, max_tokens=6)).encode()
        raw = (
            b"POST /v1/chat/completions HTTP/1.0\r\nHost: gateway\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(data), data)
        )
        head, _, body = (await _until_closed(gw, raw)).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower()
        assert sse_events(body.decode())[-1] == "[DONE]"
        assert paths.direct == 0 and paths.h11_bodies >= 2


async def test_no_chunk_writer_outside_a_served_connection() -> None:
    assert hypercorn_io.chunk_writer() is None


def _chunk_writer(server: TCPServer) -> hypercorn_io.ChunkWriter:
    stream = HTTPStream.__new__(HTTPStream)
    stream.closed = False
    return hypercorn_io.ChunkWriter(server, stream)


async def test_the_chunk_writer_frames_pieces_and_skips_empty_ones() -> None:
    mine, peer = _pair()
    server, _ = _server(mine)
    w = _chunk_writer(server)
    await w.write(b"data: a\n\n")
    await w.write(b"")  # would read as the end of the body if framed
    await w.write(b"x" * 300)
    want = b"9\r\ndata: a\n\n\r\n" + b"12c\r\n" + b"x" * 300 + b"\r\n"
    assert await _read_exactly(peer, len(want)) == want
    w._stream.closed = True  # the client is gone: nothing more is written
    await w.write(b"late")
    await server.protocol_send(RawData(data=b"end"))
    assert await _read_exactly(peer, 3) == b"end"


async def test_the_chunk_writer_yields_once_per_piece_only_when_nothing_else_did() -> None:
    """A relay that waited for its next bytes has already let other tasks run: writing them
    adds no second scheduling point. A piece written right after another (its bytes were
    already there) yields, so one busy stream cannot starve the others."""
    mine, peer = _pair()
    server, _ = _server(mine)
    w = _chunk_writer(server)
    ticks = 0

    async def ticker() -> None:  # runs whenever the writer's task lets others run
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        for piece in (b"a", b"b"):
            await trio.lowlevel.checkpoint()  # as a relay's wait for its bytes does
            before = ticks
            await w.write(piece)
            assert ticks == before  # nothing else ran: the write did not yield
            for _ in range(3):  # nothing in between: each write yields
                with trio.testing.assert_checkpoints():
                    await w.write(piece)
        nursery.cancel_scope.cancel()
    want = b"1\r\na\r\n" * 4 + b"1\r\nb\r\n" * 4
    assert await _read_exactly(peer, len(want)) == want


async def test_without_trios_yield_counter_every_piece_yields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mine, peer = _pair()
    server, _ = _server(mine)
    monkeypatch.setattr(writers, "_yields", lambda task: None)
    w = _chunk_writer(server)
    await trio.lowlevel.checkpoint()
    with trio.testing.assert_checkpoints():
        await w.write(b"a")
    assert await _read_exactly(peer, 6) == b"1\r\na\r\n"


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET /healthz HTTP/1.0\r\nHost: g\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b",
    ],
    ids=["http10", "close", "close-stream"],
)
async def test_a_connection_that_must_close_is_closed_after_the_response(
    request_line: bytes,
) -> None:
    """Quart-Trio cancels the app's task as the response ends, in the step where Hypercorn
    closes such a connection; unshielded, the close was cancelled and the client waited for
    ever (for HTTP/1.0 the close is what ends the body)."""
    if b"%d" in request_line:
        data = json.dumps(_chat(stream=True, max_tokens=4)).encode()
        request_line = request_line % (len(data), data)
    async with running_gateway() as gw:
        assert (await _until_closed(gw, request_line)).startswith(b"HTTP/1.1 200")


# ---- the keep-alive watch ----------------------------------------------------------------------


async def _asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``/slow``: three pieces 0.3 s apart (longer than the short keep-alive timeouts below);
    anything else: ``ok``."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/slow":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in (b"a", b"b", b"c"):
            await trio.sleep(0.3)
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


class _Hypercorn:
    """Hypercorn's Trio worker serving ``_asgi`` with this module's connections, and raw
    HTTP/1.1 clients for it."""

    def __init__(self, nursery: trio.Nursery, keep_alive: float) -> None:
        self.nursery = nursery
        self.keep_alive = keep_alive
        self.stop = trio.Event()
        self.done = trio.Event()
        self.port = 0

    async def start(self) -> None:
        hypercorn_io.install()
        cfg = Config()
        cfg.bind = ["127.0.0.1:0"]
        cfg.keep_alive_timeout = self.keep_alive
        cfg.graceful_timeout = 10
        cfg.accesslog = None

        async def run(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn_serve(
                _asgi, cfg, shutdown_trigger=self.stop.wait, task_status=task_status
            )
            self.done.set()

        binds = await self.nursery.start(run)
        self.port = int(binds[0].rsplit(":", 1)[1])

    async def connect(self) -> tuple[trio.SocketStream, h11.Connection]:
        return await trio.open_tcp_stream("127.0.0.1", self.port), h11.Connection(h11.CLIENT)


async def _get(sock: trio.SocketStream, conn: h11.Connection, path: str) -> bytes:
    """One GET on a kept-alive connection; the body."""
    request = h11.Request(method="GET", target=path, headers=[("Host", "x")])
    return (await exchange(sock, conn, request, b""))[1]


async def _closed_by_server(sock: trio.SocketStream) -> None:
    """Returns when the server closes the connection (nothing else may arrive)."""
    assert await sock.receive_some(65536) == b""


async def test_idle_connections_close_at_the_keep_alive_timeout_busy_ones_do_not() -> None:
    """With a 0.6 s keep-alive timeout: a connection used every 0.2 s stays open (each request
    stops the timer, each response starts it again); left idle, it is closed about the timeout
    after its last response; a response that lasts 0.9 s is not cut, and its connection closes
    about the timeout after it ends."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server = _Hypercorn(nursery, keep_alive=0.6)
            await server.start()
            for path, expected, times in (("/", b"ok", 4), ("/slow", b"abc", 1)):
                sock, conn = await server.connect()
                for i in range(times):
                    if i:
                        await trio.sleep(0.2)
                    assert await _get(sock, conn, path) == expected
                t0 = trio.current_time()
                await _closed_by_server(sock)
                assert 0.45 <= trio.current_time() - t0 < 3.0
            nursery.cancel_scope.cancel()


async def test_termination_closes_idle_connections_now_busy_ones_after_the_response() -> None:
    """The worker is told to stop: a kept-alive idle connection is closed at once; a
    connection in the middle of a response gets the whole response, then is closed; the
    server returns without waiting for the keep-alive timeout (75 s here)."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server = _Hypercorn(nursery, keep_alive=75)
            await server.start()
            idle, idle_conn = await server.connect()
            assert await _get(idle, idle_conn, "/") == b"ok"
            busy, busy_conn = await server.connect()
            got: list[bytes] = []

            async def slow() -> None:
                got.append(await _get(busy, busy_conn, "/slow"))
                await _closed_by_server(busy)

            async with trio.open_nursery() as clients:
                clients.start_soon(slow)
                await trio.sleep(0.2)  # the slow response has begun
                server.stop.set()
                with trio.fail_after(0.25):  # before the slow response ends
                    await _closed_by_server(idle)
            assert got == [b"abc"]
            with trio.fail_after(5):
                await server.done.wait()


async def test_a_connection_its_client_left_ends_at_once() -> None:
    """A client closes its kept-alive connection while it is idle: the connection's task ends
    then, not when the keep-alive timeout (75 s here) would have closed it."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server = _Hypercorn(nursery, keep_alive=75)
            await server.start()
            before = connection_tasks()
            for _ in range(3):
                sock, conn = await server.connect()
                assert await _get(sock, conn, "/") == b"ok"
                await trio.sleep(0.1)  # idle, as a client's pool leaves a connection
                await sock.aclose()
            with trio.fail_after(2):
                while connection_tasks() > before:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()


class _Spawns(trio.abc.Instrument):
    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.names.append(task.name)


async def test_one_watch_per_connection_and_none_of_it_in_a_requests_path() -> None:
    """Five requests on one connection start one keep-alive task in all (Hypercorn starts one
    per request), and a request's arrival (``Updated(idle=False)``) does not yield to the
    scheduler."""
    spawns = _Spawns()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            server = _Hypercorn(nursery, keep_alive=75)
            await server.start()
            trio.lowlevel.add_instrument(spawns)
            try:
                sock, conn = await server.connect()
                for _ in range(5):
                    assert await _get(sock, conn, "/") == b"ok"
            finally:
                trio.lowlevel.remove_instrument(spawns)
            await sock.aclose()
            nursery.cancel_scope.cancel()
    watches = [n for n in spawns.names if "idle" in n.lower() or "_watch" in n]
    assert len(watches) == 1, spawns.names

    a, b = _pair()
    server_conn, _ = _server(a)
    with trio.testing.assert_no_checkpoints():
        await server_conn.protocol_send(Updated(idle=False))
    await a.aclose()
    await b.aclose()


class _Watched:
    """What the keep-alive watch uses of a connection: its config, its worker's context, and
    the close it starts (recorded with the time)."""

    def __init__(self, keep_alive: float) -> None:
        self.config = Config()
        self.config.keep_alive_timeout = keep_alive
        self.context = WorkerContext(None)
        self.closed: list[float] = []

    async def _initiate_server_close(self) -> None:
        self.closed.append(trio.current_time())


class _Group:
    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery


def _watch_run(script: Any) -> list[float]:
    """Run ``script(watch, group, conn)`` under a mock clock; the close times, from 0."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    conn = _Watched(keep_alive=5)
    watch = connection._KeepAlive(conn)  # type: ignore[arg-type]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await script(watch, _Group(nursery), conn)
            await trio.sleep(100)
            watch.end()

    t0 = clock.current_time()
    trio.run(main, clock=clock)
    return [round(t - t0, 6) for t in conn.closed]


def test_the_keep_alive_watch_times_only_idle_periods() -> None:
    """Idle at 0, a request from 1 to 9 (longer than the 5 s timeout), idle again at 9: one
    close, at 14."""

    async def script(watch: Any, group: Any, conn: _Watched) -> None:
        await watch.restart(group, None)
        await trio.sleep(1)
        await watch.stop()
        await trio.sleep(8)
        await watch.restart(group, None)

    assert _watch_run(script) == [14.0]


def test_the_keep_alive_watch_closes_on_termination_only_when_idle() -> None:
    """The worker terminates at 2 during a request (nothing closes); the request ends at 4:
    closed at once. A connection idle when the worker terminates is closed at once."""

    async def busy(watch: Any, group: Any, conn: _Watched) -> None:
        await watch.restart(group, None)
        await watch.stop()
        await trio.sleep(2)
        await conn.context.terminated.set()
        await trio.sleep(2)
        assert conn.closed == []
        await watch.restart(group, None)

    async def idle(watch: Any, group: Any, conn: _Watched) -> None:
        await watch.restart(group, None)
        await trio.sleep(3)
        await conn.context.terminated.set()

    assert _watch_run(busy) == [4.0]
    assert _watch_run(idle) == [3.0]


def test_the_keep_alive_watch_ends_without_closing_when_reading_ends() -> None:
    async def script(watch: Any, group: Any, conn: _Watched) -> None:
        await watch.restart(group, None)
        await trio.sleep(1)
        watch.end()
        await watch.restart(group, None)  # a response ending after the client left

    assert _watch_run(script) == []


# --- send_together: a response's head and first piece in one socket write ----------------------


class _Writes:
    """Records every socket write of ``TCPServer`` (the direct one and Hypercorn's rest)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writes: list[bytes] = []
        write_nowait = TCPServer.write_nowait
        write_rest = TCPServer.write_rest

        def recording_write_nowait(server: TCPServer, data: bytes) -> int:
            sent = write_nowait(server, data)
            self.writes.append(bytes(data[:sent]))
            return sent

        async def recording_write_rest(server: TCPServer, data: bytes) -> None:
            self.writes.append(bytes(data))
            await write_rest(server, data)

        monkeypatch.setattr(TCPServer, "write_nowait", recording_write_nowait)
        monkeypatch.setattr(TCPServer, "write_rest", recording_write_rest)


def _holding(server: TCPServer) -> TCPServer:
    """``server`` as an HTTP/1.1 connection (whose bytes ``send_together`` may hold) with no
    response in progress that ``chunk_writer()`` could frame."""
    proto = H11Protocol.__new__(H11Protocol)
    proto.connection = None  # type: ignore[assignment]
    server.protocol.protocol = proto  # type: ignore[attr-defined]
    return server


async def test_send_together_holds_nothing_on_another_protocol(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HTTP/2 (or anything but HTTP/1.1): each message goes out as Hypercorn sends it (an HTTP/2
    body may wait for the client's flow-control window, which it opens only for bytes it got)."""
    mine, peer = _pair()
    server, _ = _server(mine)
    writes = _Writes(monkeypatch)
    asgi_side._SERVING.set(server)

    async def send(message: dict[str, Any]) -> None:
        await server.protocol_send(RawData(data=message["type"].encode()))

    await hypercorn_io.send_together(send, [{"type": "a"}, {"type": "b"}])
    assert writes.writes == [b"a", b"b"]
    assert await _read_exactly(peer, 2) == b"ab"


async def test_send_together_writes_what_hypercorn_sends_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each ASGI message makes Hypercorn send bytes to the connection; they are held and written
    with one write, in order, and the call is still a scheduling point."""
    mine, peer = _pair()
    server, _ = _server(mine)
    _holding(server)
    writes = _Writes(monkeypatch)
    asgi_side._SERVING.set(server)

    async def send(message: dict[str, Any]) -> None:  # Hypercorn's protocol, as far as it goes
        await server.protocol_send(RawData(data=message["type"].encode() + b";"))

    with trio.testing.assert_checkpoints():
        direct = await hypercorn_io.send_together(
            send, [{"type": "http.response.start"}, {"type": "http.response.body"}]
        )
    assert direct is None  # not an HTTP/1.1 stream of Hypercorn's
    want = b"http.response.start;http.response.body;"
    assert writes.writes == [want]
    assert await _read_exactly(peer, len(want)) == want
    # Nothing is held afterwards: the next bytes go out at once, alone.
    await server.protocol_send(RawData(data=b"next"))
    assert writes.writes[-1] == b"next"
    assert await _read_exactly(peer, 4) == b"next"


async def test_send_together_without_a_framing_connection_sends_the_first_piece_via_asgi(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the gateway does not frame the body itself, the first piece is an ASGI body message
    (Hypercorn frames it), and it is held with the head."""
    mine, peer = _pair()
    server, _ = _server(mine)
    _holding(server)
    writes = _Writes(monkeypatch)
    asgi_side._SERVING.set(server)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        await server.protocol_send(RawData(data=message.get("body", b"HEAD;")))

    await hypercorn_io.send_together(send, [{"type": "http.response.start"}], b"first")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["more_body"] is True
    assert writes.writes == [b"HEAD;first"]
    assert await _read_exactly(peer, 10) == b"HEAD;first"


async def test_send_together_writes_what_it_held_when_a_send_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bytes Hypercorn counts as sent are never dropped: a message that fails after others
    sent theirs still gets those written (shielded), and the error propagates."""
    mine, peer = _pair()
    server, _ = _server(mine)
    _holding(server)
    writes = _Writes(monkeypatch)
    asgi_side._SERVING.set(server)

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "boom":
            raise RuntimeError("boom")
        await server.protocol_send(RawData(data=b"head"))

    with pytest.raises(RuntimeError):
        await hypercorn_io.send_together(send, [{"type": "start"}, {"type": "boom"}])
    assert writes.writes == [b"head"]
    assert await _read_exactly(peer, 4) == b"head"
    assert server._held is None


async def test_send_together_outside_a_served_connection_sends_each_message() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    assert await hypercorn_io.send_together(send, [{"type": "a"}], b"x") is None
    assert [m["type"] for m in sent] == ["a", "http.response.body"]
    assert sent[1]["body"] == b"x"


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_responses_head_goes_out_with_its_first_frames(
    monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """On a real gateway over HTTP/1.1: the socket write that carries the status line also
    carries the first chunk of the body (the role chunk and the first token, or the whole
    answer), a stream's last write carries its last frames and the body's end, and h11 on the
    client side parses the exchange; an error answer (a 400) is one write too."""
    async with running_gateway() as gw:
        writes = _Writes(monkeypatch)
        sock, conn = await _kept_alive(gw)
        with trio.fail_after(20):
            head, body = await exchange(
                sock, conn, *_post("/v1/chat/completions", _chat(stream=stream, max_tokens=4))
            )
            assert head.status_code == 200
            first = next(w for w in writes.writes if w.startswith(b"HTTP/1.1 200"))
            assert b"\r\n\r\n" in first
            framed = first.partition(b"\r\n\r\n")[2]
            if stream:
                assert b'"role":"assistant"' in framed
                assert sse_events(body.decode())[-1] == "[DONE]"
            else:  # the whole answer, and the body's end, in that write
                assert b'"object":"chat.completion"' in framed and framed.endswith(b"0\r\n\r\n")
                assert json.loads(body)["object"] == "chat.completion"
            if stream:  # the last frames and the body's end: one write, the response's last
                assert writes.writes[-1] == b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
            writes.writes.clear()
            head, body = await exchange(
                sock, conn, *_post("/v1/chat/completions", _chat(temperature=-1))
            )
            assert head.status_code == 400 and json.loads(body)["error"]["param"] == "temperature"
            assert len(writes.writes) == 1 and writes.writes[0].endswith(body)
        await sock.aclose()


async def test_send_together_writes_what_it_held_before_the_connection_closes() -> None:
    """A response after which the connection must close (HTTP/1.0, ``Connection: close``):
    Hypercorn closes it while the bytes are held, and they go out first."""
    mine, peer = _pair()
    server, _ = _server(mine)
    _holding(server)
    asgi_side._SERVING.set(server)

    async def send(message: dict[str, Any]) -> None:
        await server.protocol_send(RawData(data=b"answer"))
        await server.protocol_send(Closed())

    await hypercorn_io.send_together(send, [{"type": "http.response.start"}])
    assert await _read_exactly(peer, 6) == b"answer"
    assert await peer.receive_some(10) == b""  # then the close


async def test_a_streamed_head_is_the_bytes_hypercorn_and_h11_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a kept-alive HTTP/1.1 connection the gateway writes a streamed 200's status line and
    headers itself (``_head_bytes``): byte for byte what Hypercorn and h11 write for the same
    request and ASGI headers (h11 itself, server side, is the reference), h11 is left framing
    the body as chunks, and the connection serves the next request."""
    made: list[tuple[list[tuple[bytes, bytes]], bytes | None, hypercorn_io.Head | None]] = []
    real = writers._head_bytes

    def spy(
        server: TCPServer, message: dict[str, Any], prepared: hypercorn_io.Head | None = None
    ) -> bytes | None:
        got = real(server, message, prepared)
        made.append((list(message["headers"]), got, prepared))
        return got

    monkeypatch.setattr(writers, "_head_bytes", spy)
    async with running_gateway() as gw:
        writes = _Writes(monkeypatch)
        sock, conn = await _kept_alive(gw)
        request, data = _post("/v1/chat/completions", _chat(stream=True, max_tokens=3))
        with trio.fail_after(20):
            head, body = await exchange(sock, conn, request, data)
            assert head.status_code == 200 and sse_events(body.decode())[-1] == "[DONE]"
            ((asgi_headers, fast, prepared),) = made
            assert fast is not None
            assert prepared is not None  # made while the engine worked on the request
            first = next(w for w in writes.writes if w.startswith(b"HTTP/1.1 200"))
            assert first.startswith(fast) and fast.endswith(b"\r\n\r\n")
            # The reference: h11 answering the same request, given what Hypercorn adds.
            added: dict[bytes, bytes] = {}
            for line in fast.split(b"\r\n")[1:-2]:
                name, _, value = line.partition(b": ")
                if name in (b"date", b"server"):
                    added[name] = value
            assert set(added) == {b"date", b"server"}
            client = h11.Connection(h11.CLIENT)
            sent = [client.send(e) for e in (request, h11.Data(data=data), h11.EndOfMessage())]
            ref = h11.Connection(h11.SERVER)
            ref.receive_data(b"".join(x for x in sent if x))
            while ref.next_event() is not h11.NEED_DATA:
                pass
            want = ref.send(h11.Response(status_code=200, headers=[*asgi_headers, *added.items()]))
            assert fast == want, (fast, want)
            # The next request on the connection: h11's state was left as its own send leaves it.
            head, body = await exchange(sock, conn, *_post("/v1/chat/completions", _chat()))
            assert head.status_code == 200 and json.loads(body)["object"] == "chat.completion"
        await sock.aclose()


@pytest.mark.parametrize(
    "message",
    [
        {"type": "http.response.start", "status": 404, "headers": []},
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]},
        {"type": "http.response.start", "status": 200, "headers": [(b"Connection", b"close")]},
        {"type": "http.response.start", "status": 200, "headers": [(b"x-bad", b"a\r\nb: c")]},
        {"type": "http.response.start", "status": 200, "headers": [(b"bad name", b"v")]},
        {"type": "http.response.body", "body": b""},
    ],
    ids=["status", "content-length", "connection", "bad-value", "bad-name", "not-a-start"],
)
def test_the_fast_head_leaves_everything_else_to_hypercorn(message: dict[str, Any]) -> None:
    """Any other status, a header h11 owns (framing, connection), a header h11 would refuse
    (it raises, on Hypercorn's path), or another message: no bytes, nothing changed."""
    assert writers._head_bytes(_served_h11(), message) is None


def _served_h11(keep_alive: bool = True, version: bytes = b"1.1") -> TCPServer:
    """A connection whose HTTP/1.1 protocol has just read a POST and must answer it."""
    server = TCPServer(None, Config(), WorkerContext(None), {}, None)  # type: ignore[arg-type]
    proto = H11Protocol.__new__(H11Protocol)
    proto.config = server.config
    proto.keep_alive_requests = 1
    conn = proto.connection = h11.Connection(h11.SERVER)
    extra = b"" if keep_alive else b"Connection: close\r\n"
    conn.receive_data(
        b"POST / HTTP/%s\r\nHost: g\r\n%sContent-Length: 0\r\n\r\n" % (version, extra)
    )
    while conn.next_event() is not h11.NEED_DATA:
        pass
    stream = HTTPStream.__new__(HTTPStream)
    stream.closed = False
    stream.state = ASGIHTTPState.REQUEST
    proto.stream = stream
    server.protocol = type("P", (), {"protocol": proto})()  # type: ignore[assignment]
    return server


@pytest.mark.parametrize("keep_alive,version", [(False, b"1.1"), (True, b"1.0")])
def test_the_fast_head_is_only_for_kept_alive_http11(keep_alive: bool, version: bytes) -> None:
    """A connection that must close after the response (``Connection: close``, HTTP/1.0: no
    chunked framing) gets Hypercorn's and h11's head, which says so."""
    start = {"type": "http.response.start", "status": 200, "headers": []}
    assert writers._head_bytes(_served_h11(keep_alive, version), start) is None
    server = _served_h11()
    head = writers._head_bytes(server, start)
    assert head is not None and head.startswith(b"HTTP/1.1 200 \r\n")
    assert head.endswith(b"Transfer-Encoding: chunked\r\n\r\n")
    conn = server.protocol.protocol.connection  # type: ignore[attr-defined]
    assert conn.our_state is h11.SEND_BODY and type(conn._writer).__name__ == "ChunkedWriter"


def test_a_prepared_head_is_what_the_send_would_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head made ahead (``prepare_head``) is sent as it is within the second it was made
    in; later it is made again, with the date of the second it is sent in. Either way h11 is
    moved to framing the body as chunks. Outside one of the gateway's connections there is
    none to prepare."""
    start = {"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]}
    assert hypercorn_io.prepare_head(start) is None
    server = _served_h11()
    token = asgi_side._SERVING.set(server)
    try:
        prepared = hypercorn_io.prepare_head(start)
        assert hypercorn_io.prepare_head({**start, "status": 404}) is None
    finally:
        asgi_side._SERVING.reset(token)
    assert prepared is not None and prepared.data.startswith(b"HTTP/1.1 200 \r\nx-a: 1\r\n")
    assert writers._head_bytes(server, start, prepared) is prepared.data
    conn = server.protocol.protocol.connection  # type: ignore[attr-defined]
    assert conn.our_state is h11.SEND_BODY and type(conn._writer).__name__ == "ChunkedWriter"

    later = writers.time.time() + 3600
    monkeypatch.setattr(writers.time, "time", lambda: later)
    monkeypatch.setattr("hypercorn.config.time", lambda: later)  # Hypercorn's date, too
    server = _served_h11()
    again = writers._head_bytes(server, start, prepared)
    assert again is not None and again != prepared.data
    assert again == writers._head_bytes(_served_h11(), start)  # as made at send time
    conn = server.protocol.protocol.connection  # type: ignore[attr-defined]
    assert conn.our_state is h11.SEND_BODY


async def test_a_small_requests_body_is_queued_before_its_app_runs() -> None:
    """The first two ASGI messages of a request (its body in one piece and the body's end) go
    into the app's queue without a scheduler round trip, later ones yield as Hypercorn's do;
    the app's ``receive`` returns a queued message at once and waits otherwise, and
    ``nowait`` gives what is queued or ``None``."""
    put_end, take_end = trio.open_memory_channel[Any](10)
    receive = hypercorn_io.Receive(take_end)
    put = asgi_side._putter(put_end, receive)
    with trio.testing.assert_no_checkpoints():
        await put({"n": 1})
        await put({"n": 2})
    with trio.testing.assert_checkpoints():
        await put({"n": 3})
    with trio.testing.assert_no_checkpoints():
        assert (await receive())["n"] == 1
    assert receive.nowait() == {"n": 2}
    assert receive.nowait() == {"n": 3}
    assert receive.nowait() is None
    async with trio.open_nursery() as nursery:
        got: list[Any] = []

        async def taker() -> None:
            got.append(await receive())

        nursery.start_soon(taker)
        await trio.testing.wait_all_tasks_blocked()
        await put({"n": 4})
    assert got == [{"n": 4}]


async def test_the_client_watch_cancels_on_the_connections_disconnect_with_no_task() -> None:
    """``ClientWatch`` on the connections' own ``Receive``: the ``http.disconnect`` Hypercorn
    puts calls ``on_leave`` and cancels the scope from the putting task itself (no task, no
    queued message); before ``watch`` and after the block, a disconnect is queued as usual."""
    put_end, take_end = trio.open_memory_channel[Any](10)
    receive = hypercorn_io.Receive(take_end)
    put = asgi_side._putter(put_end, receive)
    left: list[bool] = []
    tasks = len(trio.lowlevel.current_task().child_nurseries)
    async with hypercorn_io.ClientWatch(receive) as watch:
        assert len(trio.lowlevel.current_task().child_nurseries) == tasks  # no nursery
        await put({"type": "http.request", "body": b"{}", "more_body": False})
        watch.watch(lambda: left.append(watch.scope.cancel_called))
        assert not watch.scope.cancel_called
        await put({"type": "http.disconnect"})
        assert left == [False] and watch.scope.cancel_called  # on_leave, then the cancel
        await trio.lowlevel.checkpoint()
        raise AssertionError("not cancelled")  # pragma: no cover
    assert watch.scope.cancelled_caught
    assert receive.on_disconnect is None
    assert receive.nowait() == {"type": "http.request", "body": b"{}", "more_body": False}
    assert receive.nowait() is None  # the disconnect went to the watch, not the queue
    async with hypercorn_io.ClientWatch(receive) as watch:
        watch.watch(lambda: left.append(True))
    await put({"type": "http.disconnect"})  # the block has ended: queued, nobody called
    assert left == [False] and receive.nowait() == {"type": "http.disconnect"}


async def test_the_client_watch_runs_a_task_on_any_other_receive() -> None:
    """On a ``receive`` that is not the connections' own (Hypercorn's queue, a test's), the
    watch is ``watch_disconnect`` in a task: it drops other messages and cancels the scope at
    ``http.disconnect``, calling ``on_leave``."""
    put_end, take_end = trio.open_memory_channel[Any](10)
    left: list[str] = []
    with trio.fail_after(5):
        async with hypercorn_io.ClientWatch(take_end.receive) as watch:
            watch.watch(lambda: left.append("left"))
            await put_end.send({"type": "http.request", "body": b"", "more_body": False})
            await put_end.send({"type": "http.disconnect"})
            await trio.sleep_forever()
    assert left == ["left"] and watch.scope.cancelled_caught


async def test_the_plain_read_loop_hands_over_every_read_then_closed() -> None:
    """``_read_plain``: each read's bytes go to the protocol in order, the client's end of
    stream as an empty read then ``Closed``, as Hypercorn's loop hands them over."""
    mine, peer = _pair()
    server, proto = _server(mine)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server._read_plain, mine.socket)
        await peer.send_all(b"first")
        await trio.testing.wait_all_tasks_blocked()
        await peer.send_all(b"second")
        await trio.testing.wait_all_tasks_blocked()
        await peer.aclose()
    data = [e.data for e in proto.events if type(e) is RawData]
    assert b"".join(data) == b"firstsecond" and data[-1] == b""
    assert type(proto.events[-1]) is Closed


async def test_the_plain_read_loop_ends_when_the_connection_is_closed_here() -> None:
    """The connection closed by its own side while the loop waits (Hypercorn's close after a
    response), or a reset: the loop ends with ``Closed``, nothing raised."""
    mine, peer = _pair()
    server, proto = _server(mine)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server._read_plain, mine.socket)
            await trio.testing.wait_all_tasks_blocked()
            await mine.aclose()
    assert [type(e) for e in proto.events] == [Closed]
    await peer.aclose()


async def test_the_plain_read_loop_yields_only_after_a_read_that_did_not_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bytes already there: the read yields once before handing them over (a busy client
    cannot starve the others); bytes it waited for: no second yield."""
    mine, peer = _pair()
    server, proto = _server(mine)
    steps: list[str] = []
    real = trio.lowlevel.cancel_shielded_checkpoint

    async def counted() -> None:
        if "_read_plain" in trio.lowlevel.current_task().name:  # the loop's own yields
            steps.append("yield")
        await real()

    async def handle(event: Event) -> None:
        steps.append("handle")
        proto.events.append(event)

    monkeypatch.setattr(trio.lowlevel, "cancel_shielded_checkpoint", counted)
    proto.handle = handle  # type: ignore[method-assign]
    await peer.send_all(b"ready")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server._read_plain, mine.socket)
        await trio.testing.wait_all_tasks_blocked()
        assert steps == ["yield", "handle"]  # the bytes were there at the first read
        steps.clear()
        await peer.send_all(b"later")
        await trio.testing.wait_all_tasks_blocked()
        assert steps == ["handle"]  # it waited for these
        await peer.aclose()
