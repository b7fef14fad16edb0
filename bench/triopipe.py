"""The floor of a relay written on trio: a TCP pipe (``python -m bench.triopipe PORT UPSTREAM``).

Each client connection gets its own upstream connection and the bytes are copied both ways as
they come, with no HTTP parsing at all: what a trio program must at least spend to move a chunk
from one socket to another. By default it reads and writes the descriptors directly and waits
(``wait_readable`` / ``wait_writable``) only when a call would block, as the gateway's upstream
client does — the cheapest way trio offers. With ``--streams`` it uses trio's ``SocketStream``
(``receive_some`` / ``send_all``, each a scheduler round trip even when it need not wait), the
API Hypercorn's Trio worker writes through. With ``--pump`` the engine-to-client copies of
every connection are driven by the gateway's relay pump (``sieproxy.pump``): one task waits on
an epoll set of every upstream descriptor and copies what is ready, so a chunk costs no task
wake-up; a connection's own task takes over only when its client's socket cannot take a chunk
at once. The bench runs them as the ``trio-pipe``, ``trio-pipe-streams`` and ``trio-pump``
targets, to show how much of a relay's cost per chunk is the event loop's.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from sieproxy.relay.pump import Pump

_RECV = 65536


async def _copy_fds(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    rfd, wfd = src.socket.fileno(), dst.socket.fileno()
    while True:
        try:
            data = os.read(rfd, _RECV)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(rfd)
            continue
        if not data:
            return
        await _send_fd(wfd, data)


async def _send_fd(wfd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(wfd, view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(wfd)


class _Carry:
    """One connection's engine-to-client copy as the relay pump runs it (``ride``)."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd
        self.rest = b""  # what the client's socket did not take: its task sends it
        self.ended = False

    def ride(self) -> bool:
        try:
            data = os.read(self.rfd, _RECV)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self.ended = True
            return False
        try:
            sent = os.write(self.wfd, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.ended = True
            return False
        self.rest = data[sent:]
        return not self.rest


_PUMP = Pump()


async def _copy_pumped(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    carry = _Carry(src.socket.fileno(), dst.socket.fileno())
    while not carry.ended:
        await _PUMP.park(carry.rfd, carry)
        rest, carry.rest = carry.rest, b""
        await _send_fd(carry.wfd, rest)


async def _copy_streams(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    while data := await src.receive_some(_RECV):
        await dst.send_all(data)


Copy = Callable[[trio.SocketStream, trio.SocketStream], Awaitable[None]]


async def _quietly(copy: Copy, src: trio.SocketStream, dst: trio.SocketStream) -> None:
    """A peer that resets or closes ends the copy, not the pipe process."""
    with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        await copy(src, dst)


async def _handle(upstream_port: int, down: Copy, client: trio.SocketStream) -> None:
    try:
        upstream = await trio.open_tcp_stream("127.0.0.1", upstream_port)
    except OSError:
        await client.aclose()
        return
    async with client, upstream, trio.open_nursery() as nursery:
        nursery.start_soon(_quietly, down, upstream, client)
        up = _copy_streams if down is _copy_streams else _copy_fds
        await _quietly(up, client, upstream)  # the client left: drop the upstream too
        nursery.cancel_scope.cancel()


async def main(port: int, upstream_port: int, mode: str) -> None:
    down = {"--streams": _copy_streams, "--pump": _copy_pumped}.get(mode, _copy_fds)
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1", backlog=2048)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_PUMP.run)
        await trio.serve_listeners(partial(_handle, upstream_port, down), listeners)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    modes = [a for a in sys.argv[1:] if a.startswith("--")]
    trio.run(main, int(args[0]), int(args[1]), modes[0] if modes else "")
