"""The floor of a relay written on trio: a TCP pipe (``python -m bench.triopipe PORT UPSTREAM``).

Each client connection gets its own upstream connection and the bytes are copied both ways as
they come, with no HTTP parsing at all: what a trio program must at least spend to move a chunk
from one socket to another. By default it reads and writes the descriptors directly and waits
(``wait_readable`` / ``wait_writable``) only when a call would block, as the gateway's upstream
client does — the cheapest way trio offers. With ``--streams`` it uses trio's ``SocketStream``
(``receive_some`` / ``send_all``, each a scheduler round trip even when it need not wait), the
API Hypercorn's Trio worker writes through. The bench runs them as the ``trio-pipe`` and
``trio-pipe-streams`` targets, to show how much of a relay's cost per chunk is the event loop's.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Awaitable, Callable
from functools import partial

import trio

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
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(wfd, view):]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(wfd)


async def _copy_streams(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    while data := await src.receive_some(_RECV):
        await dst.send_all(data)


Copy = Callable[[trio.SocketStream, trio.SocketStream], Awaitable[None]]


async def _quietly(copy: Copy, src: trio.SocketStream, dst: trio.SocketStream) -> None:
    """A peer that resets or closes ends the copy, not the pipe process."""
    with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        await copy(src, dst)


async def _handle(upstream_port: int, copy: Copy, client: trio.SocketStream) -> None:
    try:
        upstream = await trio.open_tcp_stream("127.0.0.1", upstream_port)
    except OSError:
        await client.aclose()
        return
    async with client, upstream, trio.open_nursery() as nursery:
        nursery.start_soon(_quietly, copy, upstream, client)
        await _quietly(copy, client, upstream)  # the client left: drop the upstream too
        nursery.cancel_scope.cancel()


async def main(port: int, upstream_port: int, streams: bool) -> None:
    copy = _copy_streams if streams else _copy_fds
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1", backlog=2048)
    await trio.serve_listeners(partial(_handle, upstream_port, copy), listeners)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--streams"]
    trio.run(main, int(args[0]), int(args[1]), "--streams" in sys.argv[1:])
