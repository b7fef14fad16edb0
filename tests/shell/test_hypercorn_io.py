"""sieproxy.hypercorn_io: the direct socket write for Hypercorn's Trio worker.

Checked on a socket pair with the real Hypercorn ``TCPServer`` underneath: bytes of concurrent
writers never interleave or reorder, the rest of a partial write is sent even when its writer
is cancelled, a cancelled writer writes nothing, a closed peer is reported as ``Closed``, TLS
streams take Hypercorn's own path, and ``sieproxy serve`` and ``sieproxy.asgi`` install the
class.
"""

from __future__ import annotations

import importlib
import socket
from typing import Any

import hypercorn.trio.run as hypercorn_run
import pytest
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import TCPServer as HypercornTCPServer
from hypercorn.trio.worker_context import WorkerContext

from sieproxy import hypercorn_io
from sieproxy.hypercorn_io import TCPServer

from .harness import running_gateway, sse_events


class _Protocol:
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
    async with running_gateway() as gw:  # sieproxy.serve.serve
        assert hypercorn_run.TCPServer is TCPServer  # type: ignore[attr-defined]
        r = await gw.chat(max_tokens=3, stream=True)
        assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"


def test_install_and_the_asgi_entry_point(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # monkeypatch puts Hypercorn's own class back afterwards
    monkeypatch.setattr(hypercorn_run, "TCPServer", object)
    hypercorn_io.install()
    assert hypercorn_run.TCPServer is TCPServer  # type: ignore[attr-defined]
    monkeypatch.setattr(hypercorn_run, "TCPServer", object)
    cfg = tmp_path / "g.toml"
    cfg.write_text('[models.m]\nengines = ["http://127.0.0.1:9"]\nchat_template = "x"\n')
    monkeypatch.setenv("SIEPROXY_CONFIG", str(cfg))
    monkeypatch.setattr("sieproxy.serve.tune_gc", lambda: None)  # not in the test process
    import sieproxy.asgi

    importlib.reload(sieproxy.asgi)
    assert hypercorn_run.TCPServer is TCPServer  # type: ignore[attr-defined]
