"""A deliberately small HTTP/1.1 server on trio + h11, for the fake engine.

Theory of operation: one task per accepted connection runs a keep-alive loop — read one request
(head and whole body) through h11, hand it to the handler, and start h11's next cycle if both
sides finished cleanly. The handler answers with :meth:`HTTPConnection.send_response` (whole
body) or with :meth:`~HTTPConnection.start_response` / :meth:`~HTTPConnection.send_data` /
:meth:`~HTTPConnection.end_response` (a streamed body, chunked for HTTP/1.1 clients,
close-delimited for HTTP/1.0 ones, as h11 decides). It may also break the protocol on purpose
(:meth:`~HTTPConnection.reset`, :meth:`~HTTPConnection.close_abruptly`), which is what a fault
injector needs.

While a body streams, :meth:`HTTPConnection.wait_client_gone` reads the socket concurrently so
that a client closing its end is noticed at once, even while the handler sleeps; bytes read then
(a pipelined next request) are kept for h11.

No framework, no per-chunk allocation beyond h11's framing: benchmarks push tens of thousands of
chunks a second through this on two cores.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import h11
import trio

__all__ = ["ClientGone", "HTTPConnection", "HTTPRequest", "HTTPServer", "Handler"]

_RECEIVE_SIZE = 65536
_MAX_BODY = 64 * 1024 * 1024


class ClientGone(Exception):
    """The client closed or broke the connection while we were answering."""


@dataclass(slots=True)
class HTTPRequest:
    """One complete request: head and body."""

    method: str
    path: str
    query: str
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


class HTTPConnection:
    """One server-side HTTP/1.1 connection (h11 state plus the socket stream)."""

    def __init__(self, stream: trio.SocketStream, *, max_body: int = _MAX_BODY) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=1024 * 1024)
        self.max_body = max_body
        self.client_gone = False
        self.closed = False
        self._fd = stream.socket.fileno()
        self._chunked = False

    # -- reading ---------------------------------------------------------------------------

    async def _receive(self) -> None:
        try:
            data = await self.stream.receive_some(_RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.client_gone = True
        self.h11.receive_data(data)

    async def next_request(self) -> HTTPRequest | None:
        """Read the next request, or return None when the client closed the connection.

        Raises :class:`h11.RemoteProtocolError` on a malformed request.
        """
        request: HTTPRequest | None = None
        body = bytearray()
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                await self._receive()
                continue
            if isinstance(event, h11.Request):
                target = event.target.decode("latin-1")
                path, _, query = target.partition("?")
                request = HTTPRequest(
                    method=event.method.decode("ascii"),
                    path=path,
                    query=query,
                    headers=[(k.lower(), v) for k, v in event.headers],
                )
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > self.max_body:
                    raise h11.RemoteProtocolError("body too large", error_status_hint=413)
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                request.body = bytes(body)
                return request
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None

    async def wait_client_gone(self) -> None:
        """Return once the client has closed (EOF) or broken the connection.

        Meant to run beside a streamed response; bytes that arrive meanwhile are buffered for
        h11 (HTTP pipelining). Cancelling this loses no data.
        """
        while not self.client_gone:
            try:
                data = await self.stream.receive_some(_RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.client_gone = True
                return
            self.h11.receive_data(data)

    # -- writing ---------------------------------------------------------------------------

    async def _send(self, data: bytes | None) -> None:
        # Fast path: one non-blocking write(2), no scheduler round trip (trio's send_all costs
        # two checkpoints per call); only a full socket buffer waits in send_all. The caller's
        # loop provides the checkpoints (it sleeps between tokens).
        if not data:
            return
        sent = 0
        try:
            sent = os.write(self._fd, data)
        except BlockingIOError:
            pass
        except OSError as exc:
            self.client_gone = True
            raise ClientGone from exc
        if sent == len(data):
            return
        try:
            await self.stream.send_all(memoryview(data)[sent:])
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.client_gone = True
            raise ClientGone from exc

    async def start_response(
        self, status: int, headers: Iterable[tuple[bytes, bytes]] = ()
    ) -> None:
        """Send a response head with no length: the body is streamed after it.

        HTTP/1.1 clients get chunked encoding, HTTP/1.0 ones a close-delimited body.
        """
        version = self.h11.their_http_version
        self._chunked = version is not None and version >= b"1.1"
        head = list(headers)
        if self._chunked:
            head.append((b"transfer-encoding", b"chunked"))
        await self._send(self.h11.send(h11.Response(status_code=status, headers=head)))

    async def send_data(self, data: bytes) -> None:
        """Send one piece of a streamed body (one chunk, in chunked encoding).

        The framing is done here rather than by h11, which costs ~14 µs a chunk; h11 still
        tracks the message and writes the terminating chunk in :meth:`end_response`.
        """
        if not data:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        await self._send(data)

    async def end_response(self) -> None:
        """Finish a streamed body cleanly (the terminating chunk)."""
        await self._send(self.h11.send(h11.EndOfMessage()))

    async def send_response(
        self,
        status: int,
        body: bytes = b"",
        *,
        content_type: bytes | None = b"application/json",
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        """Send a whole response with a Content-Length."""
        head = [(b"content-length", str(len(body)).encode("ascii"))]
        if content_type is not None and body:
            head.append((b"content-type", content_type))
        head.extend(headers)
        out = self.h11.send(h11.Response(status_code=status, headers=head)) or b""
        if body:
            out += self.h11.send(h11.Data(data=body)) or b""
        out += self.h11.send(h11.EndOfMessage()) or b""
        await self._send(out)

    # -- ending ----------------------------------------------------------------------------

    def prepare_next(self) -> bool:
        """After a response: start the next keep-alive cycle if possible, else return False."""
        if self.closed or self.client_gone:
            return False
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            return True
        return False

    def reset(self) -> None:
        """Drop the connection with a TCP RST (SO_LINGER 0, then close)."""
        if self.closed:
            return
        self.closed = True
        sock = self.stream.socket
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    def close_abruptly(self) -> None:
        """Close the socket (FIN) wherever the response is, e.g. mid-body."""
        if self.closed:
            return
        self.closed = True
        self.stream.socket.close()

    async def aclose(self) -> None:
        """Close the connection (idempotent)."""
        if self.closed:
            return
        self.closed = True
        await trio.aclose_forcefully(self.stream)


Handler = Callable[[HTTPConnection, HTTPRequest], Awaitable[None]]


@dataclass
class HTTPServer:
    """Accept loop plus one keep-alive task per connection, calling ``handler`` per request."""

    handler: Handler
    connections_accepted: int = 0
    connections_open: int = 0
    listeners: list[trio.SocketListener] = field(default_factory=list)
    #: The next this many POSTs that arrive on a connection which already served a request
    #: get no answer: the connection is closed (``reset``: with a TCP RST) as they arrive,
    #: as an engine does that closes an idle keep-alive connection while a request is on its
    #: way (uvicorn closes idle ones after 5 s). ``dropped`` counts them.
    drop_reused: int = 0
    drop_with_reset: bool = False
    dropped: int = 0

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` and serve until cancelled; ``task_status.started(port)``.

        When :meth:`close_listeners` is called, new connections are refused while the open
        ones keep being served; this returns once they are all done.
        """
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=1024)
        self.listeners = listeners
        bound = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener, nursery)
            task_status.started(bound)

    def close_listeners(self) -> None:
        """Stop listening: connecting to the port is then refused (ECONNREFUSED)."""
        for listener in self.listeners:
            listener.socket.close()
        self.listeners = []

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except (trio.ClosedResourceError, OSError):
                return
            self.connections_accepted += 1
            nursery.start_soon(self._handle_connection, stream)

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        conn = HTTPConnection(stream)
        self.connections_open += 1
        served = 0
        try:
            while True:
                try:
                    request = await conn.next_request()
                except h11.RemoteProtocolError as exc:
                    await self._bad_request(conn, exc)
                    return
                if request is None:
                    return
                if served and self.drop_reused > 0 and request.method == "POST":
                    self.drop_reused -= 1
                    self.dropped += 1
                    conn.reset() if self.drop_with_reset else conn.close_abruptly()
                    return
                served += 1
                await self.handler(conn, request)
                if not conn.prepare_next():
                    return
        except (ClientGone, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.connections_open -= 1
            await conn.aclose()

    @staticmethod
    async def _bad_request(conn: HTTPConnection, exc: h11.RemoteProtocolError) -> None:
        if conn.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        with contextlib.suppress(ClientGone, h11.LocalProtocolError):
            await conn.send_response(
                exc.error_status_hint,
                b'{"error":{"message":"malformed HTTP request"}}',
                headers=[(b"connection", b"close")],
            )
