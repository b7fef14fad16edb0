"""The generation path's HTTP/1.1 to engines: a connection, one exchange on it, its response.

The ``/generate`` streams and ``/abort_request`` calls go over trio sockets with the sans-IO
framing of ``core.http1``, not httpx. This exists because every relayed token crosses it: httpx
over httpcore over h11 cost ~19 % of the gateway's CPU per relayed chunk (six nested async
generators and context managers per received chunk, a pool scan per request); see
docs/DESIGN.md "Upstream client" for the measurements. ``UpstreamResponse.receive_nowait`` is
the per-chunk read.

The connections belong to a pool (``ConnectionPool``: ``sieproxy.fleet.client.EngineClient``,
which also owns keep-alive, the connection caps and the timeouts); an ``Exchange`` checks one
out for one request and back in at its end. Socket and framing failures on an open connection
become ``EngineTruncated`` here (a connection the engine closed is named so, never "malformed"),
a non-200 answer ``EngineHTTPError``. A stream that is left early is closed, never returned to
the pool half-read.

A reused keep-alive connection can be closed by the engine at any moment while it is idle
(uvicorn closes idle ones after 5 s; the pool's idle check and expiry narrow the window but
cannot close it: the engine may close it while the request is on its way). A request written
on a *reused* connection that then gets no byte of a response (the write breaks, or the
connection ends or is reset before the first byte) is therefore written once more, on a fresh
connection to the same engine, before the caller sees anything, as mature HTTP clients do; the
engine cannot have started it (a server closes only connections idle between requests). Any
other failure, and the same failure on a fresh connection, is the caller's (retry rules,
errors).
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec
import trio

from ..core.errors import EngineHTTPError, EngineTruncated, EngineUnreachable, GatewayError
from ..core.request.refusal import classify_error
from ..core.upstream.http1 import ConnectionClosed, FramingError, ResponseParser
from ..core.upstream.retry import parse_retry_after
from ..core.upstream.status import REFUSALS

__all__ = [
    "DRAIN_LIMIT",
    "Conn",
    "ConnectionPool",
    "Exchange",
    "Origin",
    "UpstreamResponse",
]

_RECV = 65536
#: A non-200 answer's body is read (and dropped) up to this size so the connection can be reused.
DRAIN_LIMIT = 65536
_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


@dataclass(slots=True)
class Origin:
    """One engine base URL, parsed once."""

    key: str
    host: str
    port: int
    authority: str
    prefix: str
    tls: bool


@dataclass(slots=True, eq=False)
class Conn:
    stream: trio.abc.Stream
    sock: trio.socket.SocketType
    idle_since: float = 0.0
    #: Plain TCP: reads and writes go to the socket's file descriptor directly and wait for
    #: readiness only when they would block (an await that blocks is still a checkpoint; one
    #: that need not, is not). Trio's stream layers add a scheduler round trip to every call
    #: that succeeds at once, and per-call wrappers (docs/DESIGN.md). TLS uses ``stream``.
    plain: bool = False
    tls_read: bytes | None = None  # TLS: what ``wait_readable`` read
    #: Taken from the idle pool (it carried an earlier exchange): the engine may have closed it.
    reused: bool = False

    async def send_all(self, data: bytes) -> None:
        if not self.plain:
            await self.stream.send_all(data)
            return
        view = memoryview(data)
        while view:
            try:
                # fileno() is -1 once closed (never a reused descriptor): that raises EBADF.
                view = view[os.write(self.sock.fileno(), view) :]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)

    async def receive(self) -> bytes:
        """The next bytes from the engine, ``b""`` at its end of stream."""
        while (data := self.receive_nowait()) is None:
            await self.wait_readable()
        return data

    def receive_nowait(self) -> bytes | None:
        """The bytes already there (``b""`` at the end of stream), ``None`` if none."""
        if not self.plain:
            data, self.tls_read = self.tls_read, None
            return data
        try:
            return os.read(self.sock.fileno(), _RECV)
        except BlockingIOError:
            return None

    async def wait_readable(self) -> None:
        """Until ``receive_nowait()`` has something (TLS: this reads it)."""
        if self.plain:
            await trio.lowlevel.wait_readable(self.sock)
        else:
            self.tls_read = bytes(await self.stream.receive_some(_RECV))

    def close(self) -> None:
        """Close now, synchronously (safe inside a cancelled scope; wakes any waiter)."""
        self.sock.close()

    def dead(self) -> bool:
        """An idle connection that is readable has been closed by the peer (or sent bytes
        nobody asked for): it must not carry a request."""
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True


class ConnectionPool(Protocol):
    """What an exchange needs from the pool that owns its connection (``EngineClient``)."""

    @property
    def connect_timeout(self) -> float:
        """Seconds a request may take to be written (``gateway.connect_timeout``)."""
        ...

    async def checkout(self, o: Origin, fresh: bool = False) -> Conn:
        """A connection to ``o``, counted against the pool's cap until checked in (``fresh``:
        a new one, never an idle one)."""
        ...

    def checkin(self, o: Origin, c: Conn, reusable: bool) -> None:
        """``c`` back: kept idle if ``reusable`` (and there is room), else closed."""
        ...


def _truncated(exc: BaseException, message: str) -> EngineTruncated:
    """The gateway error for a socket or framing failure on an open engine connection."""
    if isinstance(exc, ConnectionClosed):
        if exc.head:
            return EngineTruncated("The engine closed the connection before answering.")
        return EngineTruncated("The engine closed the connection before the response's end.")
    if isinstance(exc, FramingError):
        return EngineTruncated("The engine sent a malformed HTTP response.")
    return EngineTruncated(message)


class UpstreamResponse:
    """An engine response whose head has arrived; ``receive()`` returns body bytes, ``b""`` at
    the end of the body."""

    __slots__ = ("_conn", "_parser", "_pending", "status")

    def __init__(self, conn: Conn, parser: ResponseParser, pending: bytes) -> None:
        self._conn = conn
        self._parser = parser
        self._pending = pending  # body bytes that arrived with the head
        assert parser.status is not None
        self.status: int = parser.status

    @property
    def reusable(self) -> bool:
        return self._parser.done and self._parser.keep_alive

    def header(self, name: bytes) -> bytes | None:
        """A response header's value (``name`` in lower case), None when absent."""
        return self._parser.headers.get(name)

    def close(self) -> None:
        """Close the connection now, synchronously, from any task not reading it (the engine
        sees the disconnect; this response is never reused)."""
        self._conn.close()

    @property
    def finished(self) -> bool:
        """The whole body was received: ``receive_nowait`` returns ``b""`` without reading."""
        return self._parser.done and not self._pending

    def fileno(self) -> int:
        """The socket's descriptor, for a readiness wait by another task (``sieproxy.pump``);
        -1 on TLS (bytes can be ready inside the TLS layer) or once closed."""
        return self._conn.sock.fileno() if self._conn.plain else -1

    async def receive(self) -> bytes:
        """Body bytes, ``b""`` at the end of the body."""
        while (out := self.receive_nowait()) is None:
            await self.wait_readable()
        return out

    async def wait_readable(self) -> None:
        """Until ``receive_nowait()`` may have something."""
        try:
            await self._conn.wait_readable()
        except _BROKEN as exc:
            raise _truncated(exc, "The connection to the engine broke mid-response.") from exc

    def receive_nowait(self) -> bytes | None:
        """``receive()`` if it would not block, else ``None`` (nothing ready yet)."""
        if self._pending:
            out, self._pending = self._pending, b""
            return out
        parser = self._parser
        try:
            while not parser.done:
                data = self._conn.receive_nowait()
                if data is None:
                    return None
                if not data:
                    parser.eof()
                    return b""
                out = parser.feed(data)
                if out:
                    return out
        except (FramingError, *_BROKEN) as exc:
            raise _truncated(exc, "The connection to the engine broke mid-response.") from exc
        return b""

    async def read_all(self, limit: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        while chunk := await self.receive():
            size += len(chunk)
            if size > limit:
                raise EngineTruncated("The engine's response was too large.")
            parts.append(chunk)
        return b"".join(parts)


#: The error text of a connection that broke before the engine's response head (while the
#: request was sent, or while its head was awaited).
_BROKE_BEFORE = "The connection to the engine broke before the response."


class Exchange:
    """One request to the engine on a pooled connection, as an async context manager that
    yields the response once its head arrived (``EngineClient._post``).

    ``send()`` checks a connection out and writes the request; entering the context sends it
    if that has not happened yet, then waits for the response head. Splitting the two lets a
    caller do its own work while the engine works on the request
    (``relay.GenerationBody.open``). Both end at the exchange's deadline; a request the engine
    does not take within ``connect_timeout`` is ``EngineUnreachable``. Leaving the context puts
    the connection back in the pool if the response was read to its end, and closes it
    otherwise, also after a ``send()`` whose response was never awaited. A ``send()`` or an
    entry that fails lets the connection go itself.
    """

    __slots__ = ("_client", "_conn", "_data", "_deadline", "_ok_only", "_origin", "_resp")

    def __init__(
        self, client: ConnectionPool, origin: Origin, data: bytes, deadline: float, ok_only: bool
    ) -> None:
        self._client, self._origin, self._data = client, origin, data
        self._deadline, self._ok_only = deadline, ok_only
        self._conn: Conn | None = None
        self._resp: UpstreamResponse | None = None

    async def send(self) -> None:
        """Check out a connection and write the request (it is sent once this returns: the
        exchange then holds the connection)."""
        assert self._conn is None and self._resp is None
        try:
            if not await self._write(fresh=False):
                self._drop()  # a reused connection the engine had closed: once more, fresh
                await self._write(fresh=True)
        except BaseException:
            self._release()
            raise

    async def _write(self, *, fresh: bool) -> bool:
        """Check out a connection (``fresh``: a new one) and write the request on it; false
        when the write broke on a reused connection (see the module docstring)."""
        client, deadline = self._client, self._deadline
        with trio.CancelScope(deadline=deadline) as scope:
            c = self._conn = await client.checkout(self._origin, fresh)
            scope.deadline = min(deadline, trio.current_time() + client.connect_timeout)
            try:
                await c.send_all(self._data)
            except _BROKEN as exc:
                if c.reused and not fresh:
                    return False
                raise _truncated(exc, _BROKE_BEFORE) from exc
        if scope.cancelled_caught:  # this scope's deadline fired
            if scope.deadline < deadline:
                raise EngineUnreachable("The engine did not take the request in time.")
            raise trio.TooSlowError
        return True

    def _drop(self) -> None:
        """Close the exchange's connection (never reused) and forget it."""
        c, self._conn = self._conn, None
        if c is not None:
            self._client.checkin(self._origin, c, False)

    async def __aenter__(self) -> UpstreamResponse:
        if self._conn is None:
            await self.send()
        try:
            resp = await self._head()
            if resp is None:  # a reused connection the engine had closed: once more, fresh
                self._drop()
                await self._write(fresh=True)
                resp = await self._head()
            if resp is None:  # (a fresh connection never asks for another)
                raise EngineTruncated("The engine closed the connection before answering.")
            self._resp = resp
            if self._ok_only and resp.status != 200:
                text = b""
                with contextlib.suppress(GatewayError):
                    text = await resp.read_all(DRAIN_LIMIT)
                err = _status_error(resp.status, text)
                err.upstream_retry_after = parse_retry_after(
                    resp.header(b"retry-after"), time.time()
                )
                raise err
        except BaseException:
            self._release()
            raise
        return resp

    async def _head(self) -> UpstreamResponse | None:
        """The response head on the exchange's connection; ``None`` when a reused connection
        ended (or was reset) before the response's first byte."""
        c = self._conn
        assert c is not None
        seen = False  # a byte of the response arrived
        resp: UpstreamResponse | None = None
        with trio.CancelScope(deadline=self._deadline):
            try:
                parser = ResponseParser()
                rest = b""
                while parser.status is None:
                    got = await c.receive()
                    if not got:
                        if not seen and c.reused:
                            return None
                        parser.eof()
                    seen = True
                    rest = parser.feed(got)
            except _BROKEN as exc:
                if not seen and c.reused:
                    return None
                raise _truncated(exc, _BROKE_BEFORE) from exc
            except FramingError as exc:
                raise _truncated(exc, _BROKE_BEFORE) from exc
            resp = UpstreamResponse(c, parser, rest)
        if resp is None:  # the deadline fired
            raise trio.TooSlowError
        return resp

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        c, self._conn = self._conn, None
        if c is not None:
            resp = self._resp
            self._client.checkin(self._origin, c, resp is not None and resp.reusable)


def _status_error(status: int, body: bytes = b"") -> EngineHTTPError:
    if status in REFUSALS:
        msg = "The engine refused the request (for example, the prompt is too long)."
    elif status in (429, 503):
        msg = "The engine is busy or not ready; retry shortly."
    else:
        msg = f"The engine answered with HTTP {status}."
    err = EngineHTTPError(msg, engine_status=status)
    if status in REFUSALS:  # answered as the client's 400 (core/upstream/status.py)
        try:
            obj = msgspec.json.decode(body) if body else None
        except msgspec.DecodeError:
            obj = None
        err.refusal = classify_error(obj)
    return err
