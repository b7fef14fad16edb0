"""The upstream HTTP client: SGLang's native API on Trio.

This is the one boundary where transport exceptions become core errors. Two clients live here:

* **The generation path** (``/generate`` streams and ``/abort_request``) uses the gateway's own
  HTTP/1.1 connection pool: trio sockets plus the sans-IO framing of ``core.http1``. It exists
  because every relayed token crosses it: httpx over httpcore over h11 cost ~19 % of the
  gateway's CPU per relayed chunk (six nested async generators and context managers per
  received chunk, a pool scan per request); see docs/DESIGN.md "Upstream client" for the
  measurements. It keeps what the hot path needs and nothing else: keep-alive reuse (LIFO, idle
  connections checked for a peer close before reuse and dropped after ``_IDLE_EXPIRY`` seconds,
  below uvicorn's 5 s keep-alive default), a cap on connections in use (``max_connections``, wait
  up to ``pool_timeout``), a cap on idle connections (``max_keepalive_connections``), connect
  and write timeouts (``connect_timeout``) and no read timeout (the relay enforces the token-gap
  timeout per chunk). ``https://`` engines go through ``trio.SSLStream`` with the system trust
  store. Redirects are never followed: engines are reached only at configured URLs.
* **Health and info checks** (cold path, their own small pool so a burst of streams can never
  starve them) use httpx with explicit timeouts.

A stream that is left early is closed, never returned to the pool half-read.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import ssl
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import trio

from .core.errors import (
    EngineHTTPError,
    EngineMalformed,
    EngineTruncated,
    EngineUnreachable,
    GatewayError,
)
from .core.http1 import FramingError, ResponseParser, request_head
from .core.refusal import classify, engine_message
from .settings import GatewaySettings

__all__ = ["EngineClient", "UpstreamResponse", "parse_load"]

_encode = msgspec.json.Encoder().encode
_RECV = 65536
#: Idle upstream connections older than this are closed instead of reused (uvicorn, which
#: SGLang's HTTP server runs on, closes idle keep-alive connections after 5 s by default).
_IDLE_EXPIRY = 4.0
#: A non-200 answer's body is read (and dropped) up to this size so the connection can be reused.
_DRAIN_LIMIT = 65536
_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


@dataclass(slots=True)
class _Origin:
    """One engine base URL, parsed once."""

    key: str
    host: str
    port: int
    authority: str
    prefix: str
    tls: bool


@dataclass(slots=True, eq=False)
class _Conn:
    stream: trio.abc.Stream
    sock: trio.socket.SocketType
    idle_since: float = 0.0
    #: Plain TCP: reads and writes go to the socket's file descriptor directly and wait for
    #: readiness only when they would block (an await that blocks is still a checkpoint; one
    #: that need not, is not). Trio's stream layers add a scheduler round trip to every call
    #: that succeeds at once, and per-call wrappers (docs/DESIGN.md). TLS uses ``stream``.
    plain: bool = False
    tls_read: bytes | None = None  # TLS: what ``wait_readable`` read

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


def _truncated(exc: BaseException, message: str) -> EngineTruncated:
    """The gateway error for a socket or framing failure on an open engine connection."""
    if isinstance(exc, FramingError):
        return EngineTruncated("The engine sent a malformed HTTP response.")
    return EngineTruncated(message)


class UpstreamResponse:
    """An engine response whose head has arrived; ``receive()`` returns body bytes, ``b""`` at
    the end of the body."""

    __slots__ = ("_conn", "_parser", "_pending", "status")

    def __init__(self, conn: _Conn, parser: ResponseParser, pending: bytes) -> None:
        self._conn = conn
        self._parser = parser
        self._pending = pending  # body bytes that arrived with the head
        assert parser.status is not None
        self.status: int = parser.status

    @property
    def reusable(self) -> bool:
        return self._parser.done and self._parser.keep_alive

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
        self, client: EngineClient, origin: _Origin, data: bytes, deadline: float, ok_only: bool
    ) -> None:
        self._client, self._origin, self._data = client, origin, data
        self._deadline, self._ok_only = deadline, ok_only
        self._conn: _Conn | None = None
        self._resp: UpstreamResponse | None = None

    async def send(self) -> None:
        """Check out a connection and write the request (it is sent once this returns: the
        exchange then holds the connection)."""
        assert self._conn is None and self._resp is None
        client, deadline = self._client, self._deadline
        try:
            with trio.CancelScope(deadline=deadline) as scope:
                c = self._conn = await client._checkout(self._origin)
                scope.deadline = min(deadline, trio.current_time() + client._g.connect_timeout)
                try:
                    await c.send_all(self._data)
                except _BROKEN as exc:
                    raise _truncated(exc, _BROKE_BEFORE) from exc
            if scope.cancelled_caught:  # this scope's deadline fired
                if scope.deadline < deadline:
                    raise EngineUnreachable("The engine did not take the request in time.")
                raise trio.TooSlowError
        except BaseException:
            self._release()
            raise

    async def __aenter__(self) -> UpstreamResponse:
        if self._conn is None:
            await self.send()
        c = self._conn
        assert c is not None
        try:
            with trio.CancelScope(deadline=self._deadline):
                try:
                    parser = ResponseParser()
                    rest = b""
                    while parser.status is None:
                        got = await c.receive()
                        if not got:
                            parser.eof()
                        rest = parser.feed(got)
                except (FramingError, *_BROKEN) as exc:
                    raise _truncated(exc, _BROKE_BEFORE) from exc
                self._resp = UpstreamResponse(c, parser, rest)
            resp = self._resp
            if resp is None:  # the deadline fired
                raise trio.TooSlowError
            if self._ok_only and resp.status != 200:
                text = b""
                with contextlib.suppress(GatewayError):
                    text = await resp.read_all(_DRAIN_LIMIT)
                raise _status_error(resp.status, text)
        except BaseException:
            self._release()
            raise
        return resp

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        c, self._conn = self._conn, None
        if c is not None:
            resp = self._resp
            self._client._checkin(self._origin, c, resp is not None and resp.reusable)


class EngineClient:
    """Connections to every engine replica (see the module docstring)."""

    def __init__(
        self,
        g: GatewaySettings,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ):
        self._g = g
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[str, deque[_Conn]] = {}
        self._idle_count = 0
        self._max_idle = max(0, g.max_keepalive_connections)
        self._in_use = trio.Semaphore(max(1, g.max_connections))
        # One trust store for both clients: the system's (OpenSSL's default paths, so
        # SSL_CERT_FILE / SSL_CERT_DIR point it at a private CA).
        self._ssl = ssl_context if ssl_context is not None else ssl.create_default_context()
        # Health checks and info requests get their own small pool, so a burst of streams or
        # aborts can never starve them (a starved check would mark a healthy replica not ready).
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=g.connect_timeout,
                read=g.health_timeout,
                write=g.connect_timeout,
                pool=g.pool_timeout,
            ),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            transport=transport,
            follow_redirects=False,  # engines are reached only at configured URLs
            trust_env=False,  # no proxy from the environment between gateway and engines
            verify=self._ssl,
        )

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
        self._idle_count = 0
        await self._client.aclose()

    # ------------------------------------------------------------------ connections
    def _origin(self, base: str) -> _Origin:
        o = self._origins.get(base)
        if o is None:
            u = urlsplit(base)
            tls = u.scheme == "https"
            host = u.hostname or ""
            port = u.port or (443 if tls else 80)
            o = _Origin(
                key=f"{u.scheme}://{host}:{port}",
                host=host,
                port=port,
                authority=u.netloc.rpartition("@")[2],  # as configured: [v6] brackets, port
                prefix=u.path.rstrip("/"),
                tls=tls,
            )
            self._origins[base] = o
        return o

    @property
    def spare_connections(self) -> int:
        """How many connections can be checked out now without waiting for a slot."""
        return self._in_use.value

    async def _checkout(self, o: _Origin) -> _Conn:
        """A connection to ``o`` counted against ``max_connections`` (an idle one if a live one
        is there, else a new one)."""
        try:
            self._in_use.acquire_nowait()
        except trio.WouldBlock:
            with trio.move_on_after(self._g.pool_timeout) as scope:
                await self._in_use.acquire()
            if scope.cancelled_caught:
                raise EngineUnreachable(
                    "Too many engine connections are in use; retry shortly."
                ) from None
        try:
            idle = self._idle.get(o.key)
            now = trio.current_time()
            while idle:
                c = idle.pop()
                self._idle_count -= 1
                if now - c.idle_since < _IDLE_EXPIRY and not c.dead():
                    return c
                c.close()
            return await self._connect(o)
        except BaseException:
            self._in_use.release()
            raise

    async def _connect(self, o: _Origin) -> _Conn:
        with trio.move_on_after(self._g.connect_timeout) as scope:
            try:
                tcp = await trio.open_tcp_stream(o.host, o.port)
            except OSError as exc:
                raise EngineUnreachable() from exc
            stream: trio.abc.Stream = tcp
            if o.tls:
                tls = trio.SSLStream(tcp, self._ssl, server_hostname=o.host)
                try:
                    await tls.do_handshake()
                except (trio.BrokenResourceError, OSError) as exc:
                    tcp.socket.close()
                    raise EngineUnreachable() from exc
                stream = tls
            return _Conn(stream, tcp.socket, plain=not o.tls)
        assert scope.cancelled_caught
        raise EngineUnreachable("The engine did not accept a connection in time; retry shortly.")

    def _checkin(self, o: _Origin, c: _Conn, reusable: bool) -> None:
        self._in_use.release()
        idle = self._idle.get(o.key)
        if idle is None:
            idle = self._idle[o.key] = deque()
        now = trio.current_time()
        # Reuse is LIFO (the freshest connection first), so expired ones collect at the left
        # end: close them here rather than keep their sockets open until a lull empties the list.
        while idle and now - idle[0].idle_since >= _IDLE_EXPIRY:
            idle.popleft().close()
            self._idle_count -= 1
        if reusable and self._idle_count < self._max_idle:
            c.idle_since = now
            idle.append(c)
            self._idle_count += 1
        else:
            c.close()

    def _post(
        self,
        base: str,
        path: str,
        payload: dict[str, Any],
        head_timeout: float = math.inf,
        ok_only: bool = False,
    ) -> Exchange:
        """POST JSON: an async context manager that yields the response once its head arrived
        (within ``head_timeout``, else ``trio.TooSlowError``); with ``ok_only`` a non-200 is
        drained and raised as ``EngineHTTPError`` instead. The connection goes back to the pool
        only if the response was read to its end. ``Exchange.send`` writes the request before
        the context is entered (see there)."""
        o = self._origin(base)
        body = _encode(payload)
        data = request_head("POST", o.prefix + path, o.authority, len(body)) + body
        # The checkout, the request and the head together end at this deadline.
        return Exchange(self, o, data, trio.current_time() + head_timeout, ok_only)

    # ------------------------------------------------------------------ generation path
    def stream(
        self, base: str, path: str, body: dict[str, Any], *, head_timeout: float | None = None
    ) -> Exchange:
        """POST a candidate's streamed generation request (its protocol's path and body,
        ``core.protocol``); yields the response of a 200 (raw body bytes from ``receive()``). A
        non-200 raises ``EngineHTTPError`` (its text is not echoed); ``head_timeout`` bounds the
        wait for the response head (``trio.TooSlowError``). ``send()`` on the returned exchange
        writes the request before the wait for the head."""
        timeout = head_timeout if head_timeout is not None else math.inf
        return self._post(base, path, body, timeout, ok_only=True)

    def stream_generate(
        self, base: str, body: dict[str, Any], *, head_timeout: float | None = None
    ) -> Exchange:
        """:meth:`stream` to SGLang's ``/generate``."""
        return self.stream(base, "/generate", body, head_timeout=head_timeout)

    async def post(self, base: str, path: str, body: dict[str, Any]) -> None:
        """POST a small request whose answer is drained and dropped (an abort)."""
        async with self._post(base, path, body) as resp:
            await resp.read_all(_DRAIN_LIMIT)

    async def abort(self, base: str, rid: str) -> None:
        """POST ``/abort_request`` for exactly ``rid`` (SGLang ignores prefixes)."""
        await self.post(base, "/abort_request", {"rid": rid})

    # ------------------------------------------------------------------ health and info
    async def health(self, base: str, paths: tuple[str, ...] = ("/health",)) -> bool:
        """Whether the first of ``paths`` that the engine serves answers 200 (a 404 tries the
        next: the protocol's probes, ``core.protocol``)."""
        with _map_errors():
            status = 404
            for path in paths:
                status = (await self._client.get(base + path)).status_code
                if status != 404:
                    break
            return status == 200

    async def server_info(self, base: str) -> dict[str, Any]:
        """``/server_info`` (falls back to the older ``/get_server_info``)."""
        return await self._info(base, ("/server_info", "/get_server_info"))

    async def model_info(self, base: str) -> dict[str, Any]:
        """``/model_info`` (falls back to the older ``/get_model_info``)."""
        return await self._info(base, ("/model_info", "/get_model_info"))

    async def load(self, base: str) -> tuple[int, int] | None:
        """The engine's (running, waiting) requests, summed over its data-parallel ranks:
        SGLang's ``/v1/loads`` (``{"loads": [{"num_running_reqs", "num_waiting_reqs"}]}``), else
        the older ``/get_load`` (``[{"num_reqs", "num_waiting_reqs"}]``, where ``num_reqs``
        counts both). None when the engine reports neither."""
        with _map_errors():
            for path in ("/v1/loads", "/get_load"):
                resp = await self._client.get(base + path)
                if resp.status_code == 200:
                    try:
                        return parse_load(msgspec.json.decode(resp.content))
                    except (msgspec.DecodeError, TypeError, ValueError):
                        return None
        return None

    async def _info(self, base: str, paths: tuple[str, ...]) -> dict[str, Any]:
        with _map_errors():
            for path in paths:
                resp = await self._client.get(base + path)
                if resp.status_code == 200:
                    try:
                        info = msgspec.json.decode(resp.content)
                    except msgspec.DecodeError as exc:
                        raise EngineMalformed() from exc
                    if isinstance(info, dict):
                        return info
                    raise EngineMalformed()
        return {}


def parse_load(obj: Any) -> tuple[int, int] | None:
    """(running, waiting) from a ``/v1/loads`` or ``/get_load`` body (None: neither shape)."""
    ranks = obj.get("loads") if isinstance(obj, dict) else obj
    if not isinstance(ranks, list) or not all(isinstance(x, dict) for x in ranks):
        return None
    running = waiting = 0
    for x in ranks:
        w = int(x.get("num_waiting_reqs", 0))
        if "num_running_reqs" in x:
            running += int(x["num_running_reqs"])
        elif "num_reqs" in x:
            running += int(x["num_reqs"]) - w
        else:
            return None
        waiting += w
    return max(0, running), max(0, waiting)


@contextlib.contextmanager
def _map_errors() -> Iterator[None]:
    """Translate httpx errors of the health/info client (engine text is never echoed)."""
    try:
        yield
    except GatewayError:
        raise
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise EngineUnreachable() from exc
    except httpx.TimeoutException as exc:
        raise EngineUnreachable("The engine did not answer in time; retry shortly.") from exc
    except httpx.HTTPError as exc:
        raise EngineTruncated("The engine connection failed.") from exc


def _status_error(status: int, body: bytes = b"") -> EngineHTTPError:
    if status == 400:
        msg = "The engine refused the request (for example, the prompt is too long)."
    elif status in (429, 503):
        msg = "The engine is busy or not ready; retry shortly."
    else:
        msg = f"The engine answered with HTTP {status}."
    err = EngineHTTPError(msg, engine_status=status)
    if status == 400:  # the only status answered as the client's 400
        try:
            text = engine_message(msgspec.json.decode(body)) if body else None
        except msgspec.DecodeError:
            text = None
        err.refusal = classify(text)
    return err
