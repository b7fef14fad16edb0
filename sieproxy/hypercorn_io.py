"""A cheaper socket write for Hypercorn's Trio worker (installed by both entry points).

Hypercorn's Trio ``TCPServer.protocol_send`` writes every piece of a response — each streamed
chunk — under a ``trio.Lock``, inside a new shielded ``CancelScope``, through
``SocketStream.send_all``: two scheduler round trips and a cancel scope per write even when the
socket takes the bytes at once, which is nearly always. On this project's benchmark machine
that machinery cost more than the ``send`` system call itself (bench/RESULTS.md).

``TCPServer`` below keeps Hypercorn's behaviour and changes only the common case: a plain-TCP
connection with no write in progress writes the bytes to the descriptor at once and then yields
to the scheduler once (a write stays a scheduling point, so one busy stream cannot starve the
others). Everything else goes the way Hypercorn sends it:

* TLS connections (``SSLStream``), and any event other than response bytes;
* the rest of a partial write (a client reading slower than the gateway writes): it is sent
  under Hypercorn's lock and shielded from cancellation, as Hypercorn shields every write (no
  checkpoint lies between the direct write and Hypercorn's), so a response is never cut inside
  a frame;
* a write while another one is still in progress (the lock is held), so bytes stay in order.

A task already cancelled raises ``Cancelled`` before writing, as Hypercorn's lock would. A
connection the client has closed or reset (``EPIPE``, ``ECONNRESET``, a closed descriptor) is
reported to Hypercorn's protocol as ``Closed``, as Hypercorn does for a broken stream.

``install()`` makes Hypercorn's Trio worker create these connections. It relies on attributes
of Hypercorn's ``TCPServer`` (``stream``, ``send_lock``, ``protocol``) and on the module
``hypercorn.trio.run`` looking the class up when it serves; pyproject.toml bounds Hypercorn
below the next minor version, and tests/shell/test_hypercorn_io.py checks the behaviour on the
installed one.
"""

from __future__ import annotations

import os

import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio.tcp_server import TCPServer as HypercornTCPServer

__all__ = ["TCPServer", "install"]


class TCPServer(HypercornTCPServer):
    """Hypercorn's Trio connection with the direct write described in the module docstring."""

    async def protocol_send(self, event: Event) -> None:
        stream: trio.abc.Stream = self.stream  # typed SSLStream by Hypercorn; plain TCP is not
        if (
            type(event) is not RawData
            or not isinstance(stream, trio.SocketStream)
            or self.send_lock.locked()
        ):
            await super().protocol_send(event)
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        data = event.data
        try:
            sent = os.write(stream.socket.fileno(), data)
        except BlockingIOError:
            sent = 0
        except OSError:  # reset, broken pipe, or already closed (fileno -1: EBADF)
            await self.protocol.handle(Closed())
            return
        if sent == len(data):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        # The rest goes Hypercorn's way. Nothing since the cancellation check has yielded, so
        # it reaches Hypercorn's lock and shielded write uncancelled: a response is never cut
        # inside a frame.
        await super().protocol_send(RawData(data=data[sent:]))


def install() -> None:
    """Serve every connection Hypercorn's Trio worker accepts in this process with
    ``TCPServer`` (idempotent)."""
    hypercorn_run.TCPServer = TCPServer  # type: ignore[attr-defined]
