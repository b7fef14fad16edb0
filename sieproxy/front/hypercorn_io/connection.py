"""The connection: Hypercorn's Trio ``TCPServer`` with the gateway's fixes and fast paths
(``TCPServer``), or with the fixes only (``PortableTCPServer``: the ``fast_paths`` setting off);
``install()`` (``sieproxy.front.hypercorn_io.fence``) chooses which one Hypercorn's worker serves
with.

Hypercorn's Trio ``TCPServer.protocol_send`` writes every piece of a response — each streamed
chunk — under a ``trio.Lock``, inside a new shielded ``CancelScope``, through
``SocketStream.send_all``: two scheduler round trips and a cancel scope per write even when the
socket takes the bytes at once, which is nearly always. On this project's benchmark machine
that machinery cost more than the ``send`` system call itself (bench/RESULTS.md).

``TCPServer`` below keeps Hypercorn's behaviour and changes only the common case: a plain-TCP
connection with no write in progress writes the bytes to the descriptor at once and then yields
to the scheduler once (a write stays a scheduling point, so one busy stream cannot starve the
others; a streamed piece yields only when needed, see ``sieproxy.front.hypercorn_io.body``).
Everything else goes the way Hypercorn sends it:

* TLS connections (``SSLStream``), and any event other than response bytes;
* the rest of a partial write (a client reading slower than the gateway writes): it is sent
  under Hypercorn's lock and shielded from cancellation, as Hypercorn shields every write (no
  checkpoint lies between the direct write and Hypercorn's), so a response is never cut inside
  a frame;
* a write while another one is still in progress (the lock is held), so bytes stay in order.

A task already cancelled raises ``Cancelled`` before writing, as Hypercorn's lock would. A
write to a connection the client has closed or reset (``EPIPE``, ``ECONNRESET``, a closed
descriptor) goes Hypercorn's way too, and Hypercorn reports it to its protocol as ``Closed``.

A connection that must close after its response (an HTTP/1.0 client, a ``Connection: close``
request, the last request Hypercorn allows on a connection) is closed from the app's task, at
the end of the response. Quart-Trio cancels that task in the same step (it sees the stream end
as the client leaving), and Hypercorn's close is a cancellation point: left alone, the socket was
never closed, and a client whose body is delimited by the close (HTTP/1.0) waited for ever. The
close is therefore shielded here; it cannot block (shutdown of the write side, then close).

The connection also replaces Hypercorn's keep-alive timer (``_KeepAlive``): Hypercorn's,
restarted from the task of the app whose response just ended, was cancelled with it, so
after the first response a kept-alive connection was never closed for being idle; and it cost
scheduler round trips in every request's path.

The connection's read loop on plain TCP (no read timeout is configured: ``sieproxy.serve``)
reads the descriptor directly (``_read_plain``), as the upstream client does: Hypercorn's read
went through a cancel scope and trio's stream and socket layers on every read, twice on the way
to a request's first token (its bytes, and the wait for the next ones that the app's task runs
behind). It yields as trio's reads do (not after a read that waited, once after one that did
not) and ends where Hypercorn's ends (the client's end of stream, a reset, the connection
closed here).

On each HTTP/1.1 protocol it serves, the connection answers a request h11 cannot read itself
(``sieproxy.front.hypercorn_io.refusal``), and with the fast paths it replaces its task group's
``spawn_app`` (``sieproxy.front.hypercorn_io.asgi_side``).
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any

import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import tcp_server as hypercorn_tcp_server
from hypercorn.trio.tcp_server import TCPServer as HypercornTCPServer

from .asgi_side import _SERVING, _spawn_app
from .refusal import _refuse

__all__ = ["PortableTCPServer", "TCPServer"]


class TCPServer(HypercornTCPServer):
    """Hypercorn's Trio connection with the direct write and the keep-alive watch described in
    the module docstring."""

    #: Whether this connection takes the fast paths (``PortableTCPServer`` does not).
    fast = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._keep_alive = _KeepAlive(self)
        self.idle_task = self._keep_alive  # type: ignore[assignment]  # Hypercorn's interface
        self._held: bytes | None = None  # what ``send_together`` holds back, while it does
        self.refused: tuple[int, str] | None = None  # status and reason of ``_refuse``'s answer

    async def run(self) -> None:
        _SERVING.set(self)  # inherited by the tasks this connection spawns (the app's)
        await super().run()

    async def _read_data(self) -> None:
        proto = self.protocol.protocol  # made by Hypercorn's ``run`` just before it reads
        if type(proto) is H11Protocol:
            # A request h11 refuses is answered with the envelope (``refusal``).
            answer = partial(_refuse, self, proto)
            proto._send_error_response = answer  # type: ignore[method-assign]
        if self.fast:  # the app's queue without a round trip per message (``asgi_side``)
            group = self._task_group  # made by Hypercorn's ``run``; no request has come yet
            group.spawn_app = partial(_spawn_app, group)  # type: ignore[method-assign]
        try:
            stream: trio.abc.Stream = self.stream  # typed SSLStream by Hypercorn
            if self.fast and type(stream) is trio.SocketStream and not self.config.read_timeout:
                await self._read_plain(stream.socket)
            else:
                await super()._read_data()
        finally:
            # Nothing more can arrive: no next request to wait for. The connection ends when
            # its last response does (Hypercorn then closes it), not after the idle timeout.
            self._keep_alive.end()

    async def _read_plain(self, sock: trio.socket.SocketType) -> None:
        """Hypercorn's read loop on plain TCP with no read timeout, reading the descriptor
        directly: a read that had to wait for readiness does not yield again, one that found
        bytes at once does (as trio's stream reads behave), without trio's stream layers and
        a cancel scope per read (see the module docstring). A reset or a socket closed here
        ends the loop, as Hypercorn's ends on a broken or closed stream."""
        waited = False
        while True:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                # fileno() is -1 once closed (never a reused descriptor): that raises EBADF.
                data = os.read(sock.fileno(), hypercorn_tcp_server.MAX_RECV)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(sock)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break  # closed by the connection's own close while waiting
                waited = True
                continue
            except OSError:
                break
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            waited = False
            await self.protocol.handle(RawData(data=data))
            if not data:
                break
        await self.protocol.handle(Closed())

    async def protocol_send(self, event: Event) -> None:
        if type(event) is RawData:
            if self._held is not None:  # ``send_together`` writes it with what follows
                self._held += event.data
                return
            await self.write(event.data)
        elif type(event) is Closed:
            # Closing never blocks (shutdown, then close); shielded so that it happens even in
            # a task being cancelled (see the module docstring: HTTP/1.0 and Connection: close).
            with trio.CancelScope(shield=True):
                if self._held:  # a response that ends with the connection: its bytes first
                    held, self._held = self._held, b""
                    await self.write_rest(held)
                await super().protocol_send(event)
        else:
            await super().protocol_send(event)

    async def write(self, data: bytes, *, settle: bool = True) -> None:
        """Send ``data`` on the connection (the way described in the module docstring). With
        ``settle=False`` a write the socket takes at once is not a scheduling point: the caller
        yields itself (``ChunkWriter``)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        sent = self.write_nowait(data)
        if sent == len(data):
            if settle:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return
        # The rest goes Hypercorn's way: all of it on TLS, while another write is in progress,
        # or to a client that is gone (Hypercorn's write reports that as ``Closed``). Nothing
        # since the cancellation check has yielded, so it reaches Hypercorn's lock and shielded
        # write uncancelled: a response is never cut inside a frame.
        await super().protocol_send(RawData(data=data[sent:]))

    def write_nowait(self, data: bytes) -> int:
        """How much of ``data`` the socket took at once, written without yielding (by
        ``write``, and by ``ChunkWriter.write_nowait`` from the relay pump's task); 0 where the
        bytes must go Hypercorn's way: TLS, a write in progress, a client that is gone (a reset,
        a broken pipe, a closed descriptor: Hypercorn's write reports it)."""
        stream: trio.abc.Stream = self.stream  # typed SSLStream by Hypercorn; plain TCP is not
        # The exact type (what Hypercorn's Trio worker serves plain TCP with): an ``isinstance``
        # check goes through ``abc`` (trio's streams are abstract base classes) on every write.
        if type(stream) is not trio.SocketStream or self.send_lock.locked():
            return 0
        try:
            return os.write(stream.socket.fileno(), data)
        except OSError:  # would block; reset, broken pipe, closed (fileno -1: EBADF)
            return 0

    def can_hold(self) -> bool:
        """Whether ``send_together`` may hold this connection's bytes: plain TCP and HTTP/1.1
        (h11 writes never wait; HTTP/2 may wait for flow control, which needs the client to
        have seen the bytes), and not held already."""
        stream: trio.abc.Stream = self.stream  # typed SSLStream by Hypercorn; plain TCP is not
        return (
            type(stream) is trio.SocketStream
            and type(self.protocol.protocol) is H11Protocol
            and self._held is None
        )

    async def release_held(self) -> None:
        """Stop holding (``send_together``) and write what was held, as Hypercorn writes: not
        cancellable, and still a scheduling point."""
        held, self._held = self._held, None
        if held:
            sent = self.write_nowait(held)
            if sent < len(held):
                await self.write_rest(held[sent:])
                return
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def write_rest(self, data: bytes) -> None:
        """The rest of a frame another task began: Hypercorn's locked write, shielded as it
        shields its own, so that even a cancelled response is not cut inside a frame."""
        with trio.CancelScope(shield=True):
            await super().protocol_send(RawData(data=data))


class PortableTCPServer(TCPServer):
    """The connection with its fixes (the keep-alive watch, the shielded close, the refusals'
    envelope) and none of the fast paths: Hypercorn reads, writes and frames every byte, as
    over TLS (``install(fast=False)``: the ``fast_paths`` setting)."""

    fast = False

    def write_nowait(self, data: bytes) -> int:
        return 0  # every write goes Hypercorn's way

    def can_hold(self) -> bool:
        return False


class _KeepAlive:
    """The connection's keep-alive watch, in place of Hypercorn's ``idle_task`` (``restart``
    when the connection becomes idle, ``stop`` when a request arrives).

    Hypercorn starts a new task for every idle period, with ``nursery.start`` from the task
    that calls ``restart``. At the end of a response that is the ASGI app's task, just after
    Hypercorn sent it ``http.disconnect``; the gateway's disconnect watcher (and Quart-Trio's
    message task) cancels the response's scope on that message, and the new task, still
    starting inside that scope, was cancelled with it. So after its first response a
    kept-alive connection had no timeout, and one whose client vanished without closing it
    stayed open for ever. Its lock and its start also cost scheduler round trips in every
    request's path.

    Here one task per connection, started with the connection, waits while the connection is
    idle for the keep-alive timeout or the worker's termination, then closes the connection as
    Hypercorn's ``_idle_timeout`` does. ``restart`` sets the wait's deadline and ``stop`` marks
    the connection busy: neither yields nor starts a task. A termination seen during a request
    closes the connection when it is idle again. The watch ends, closing nothing, when the
    connection stops reading (``end``): Hypercorn's idle task kept a connection whose client
    had closed it alive until the timeout."""

    __slots__ = ("_at", "_done", "_scope", "_server", "_watching")

    def __init__(self, server: TCPServer) -> None:
        self._server = server
        self._at = math.inf  # when the idle connection closes; infinity while a request runs
        self._scope: trio.CancelScope | None = None  # the watch's current wait
        self._watching = False
        self._done = False  # the connection reads no more: the watch has nothing to do

    async def restart(self, task_group: Any, action: Any) -> None:
        """The connection is idle (``action``, Hypercorn's ``_idle_timeout``, is what
        ``_watch`` does)."""
        if self._done:
            return
        self._at = trio.current_time() + self._server.config.keep_alive_timeout
        if not self._watching:
            self._watching = True
            task_group._nursery.start_soon(self._watch)
        elif self._scope is not None:
            if self._server.context.terminated.is_set():
                self._scope.cancel()
            else:
                self._scope.deadline = self._at

    async def stop(self) -> None:
        """A request is being served: no keep-alive timeout, no close on termination (a wait
        that ends during the request finds ``_at`` infinite and waits again)."""
        self._at = math.inf

    def end(self) -> None:
        """The connection reads no more: end the watch without closing anything."""
        self._done = True
        if self._scope is not None:
            self._scope.cancel()

    async def _watch(self) -> None:
        terminated = self._server.context.terminated
        while True:
            if self._done:
                return
            if self._at < math.inf and (terminated.is_set() or trio.current_time() >= self._at):
                break  # idle, and the timeout passed or the worker is terminating
            with trio.CancelScope(deadline=self._at) as scope:
                self._scope = scope
                if terminated.is_set():
                    await trio.sleep_forever()  # terminated during a request: ``restart`` wakes
                else:
                    await terminated.wait()
        self._scope = None
        with trio.CancelScope(shield=True):
            await self._server._initiate_server_close()
