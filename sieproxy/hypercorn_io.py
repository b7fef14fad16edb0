"""The server front: the one module that touches Hypercorn's, h11's, Trio's and Quart's
private state (docs/DESIGN.md, "The server front").

``install()``, at start, checks every private name and attribute relied on (``missing()``) and
has Hypercorn's Trio worker serve its connections with ``TCPServer`` (the fixes and the fast
paths below), ``PortableTCPServer`` (the fixes only: the ``fast_paths`` setting off), or, where
something is missing, Hypercorn's own class (one log line names it). Nothing is patched at
import. The rest of this docstring describes ``TCPServer``.

Hypercorn's Trio ``TCPServer.protocol_send`` writes every piece of a response — each streamed
chunk — under a ``trio.Lock``, inside a new shielded ``CancelScope``, through
``SocketStream.send_all``: two scheduler round trips and a cancel scope per write even when the
socket takes the bytes at once, which is nearly always. On this project's benchmark machine
that machinery cost more than the ``send`` system call itself (bench/RESULTS.md).

``TCPServer`` below keeps Hypercorn's behaviour and changes only the common case: a plain-TCP
connection with no write in progress writes the bytes to the descriptor at once and then yields
to the scheduler once (a write stays a scheduling point, so one busy stream cannot starve the
others; a streamed piece yields only when needed, see ``chunk_writer`` below). Everything else
goes the way Hypercorn sends it:

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

``chunk_writer()`` goes one step further for a streamed response body. Each piece an ASGI
app sends passes through Hypercorn's ``HTTPStream.app_send`` (a ``Body`` event and a copy), its
``H11Protocol`` (an ``h11.Data`` event through h11's state machine, which frames it as a chunk
and joins the pieces: another copy) and a ``RawData`` event, before it reaches the socket write
above: about a tenth of the gateway's CPU per relayed token (bench/RESULTS.md). When h11
frames the response as chunks (an HTTP/1.1 client, no ``Content-Length``) — a framing that
keeps no state between chunks — the writer frames each piece itself (the length in hex, CRLF,
the bytes, CRLF: exactly what h11 writes) and hands it to the connection's write. The head
and the end of the body still go through ASGI, so h11 and Hypercorn see the whole exchange:
the status line and headers, the empty last chunk, keep-alive and the next request on the
connection. Where the conditions do not hold (an HTTP/1.0 client, HTTP/2, another server, a
body with a length) it returns ``None``, and ``body_writer()`` (what the gateway writes with)
sends through ASGI instead. Over TLS the framed chunk takes Hypercorn's own write, as above.

A piece written this way yields to the scheduler only if the response's task has not yielded
since its previous piece. A relay that waited for the bytes it writes already has, so a
streamed token costs one scheduling round trip, not two; pieces whose bytes were already there
still yield between them, so a busy stream cannot starve the others. The count of yields is a
private counter Trio keeps on each task; without it, every piece yields.

The connection also replaces Hypercorn's keep-alive timer (``_KeepAlive``): Hypercorn's,
restarted from the task of the app whose response just ended, was cancelled with it, so
after the first response a kept-alive connection was never closed for being idle; and it cost
scheduler round trips in every request's path.

``send_together()`` sends a response's head with the first piece of its body (or a whole
answer: head, body and end) in one socket write, and a stream's last piece with the body's
end in another: while it sends the ASGI messages, the bytes Hypercorn hands the connection
are held and then written at once. A streamed response's head used to go out alone, as soon
as the app sent it, and its first token in a second write right after; its last frames and
the empty last chunk went out in two writes too: two system calls more per response, and two
more wake-ups of the client. Hypercorn and h11 see every message as before.

A streamed ``200``'s status line and headers are written by ``send_together`` itself on a
kept-alive HTTP/1.1 connection answering a ``POST`` (``_head_bytes``): the bytes Hypercorn and
h11 would write for the same message (Hypercorn's ``date`` and ``server`` after the app's
headers, then h11's ``Transfer-Encoding: chunked``), with Hypercorn's stream and h11's state
machine moved as their own send moves them (h11 is given the event, already checked, and frames
the body as chunks from there). Hypercorn's path checked and copied the headers in four places
(Hypercorn once, h11 three times) on the way to a request's first token. Any other response
(another status, a length, a connection that must close, HTTP/1.0, a header h11 owns or would
refuse) goes Hypercorn's way; tests/shell/test_hypercorn_io.py compares the bytes with h11's.
A caller that must wait before it sends (the gateway's route, for the engine) can have the head
checked and written out during the wait (``prepare_head``): at the send only the connection's
state is checked and h11 given the event, and a head made in an earlier second is made again
(Hypercorn's ``date`` is of the second it is sent in).

``_spawn_app`` replaces the ``spawn_app`` of the task group Hypercorn gives each connection
(on that task group only), for the queue between the connection and the app's task: a request's
first two ASGI messages (a body in one piece and its end) go in without a scheduler round trip,
and the app's ``receive`` returns a queued message at once (``Receive``; ``Receive.nowait``
tells a reader what is queued without waiting). Hypercorn's queue yields on every message in
and out: three scheduler passes on the way from a small request's bytes to the app reading its
body. Later messages still yield, so an app that answers without reading a large upload runs
before the queue fills (once it has answered, Hypercorn drops the rest; a full queue would
block its ``http.disconnect`` for ever).

The connection's read loop on plain TCP (no read timeout is configured: ``sieproxy.serve``)
reads the descriptor directly (``_read_plain``), as the upstream client does: Hypercorn's read
went through a cancel scope and trio's stream and socket layers on every read, twice on the way
to a request's first token (its bytes, and the wait for the next ones that the app's task runs
behind). It yields as trio's reads do (not after a read that waited, once after one that did
not) and ends where Hypercorn's ends (the client's end of stream, a reset, the connection
closed here).

``watch_disconnect()`` is the other ASGI-side piece the gateway shares with the bench's
``hypercorn-relay`` floor (``bench/hyperrelay.py``): one task per request that drops what is
left of the request and cancels the response when the client leaves.

The connection is found through a context variable set when it starts serving: Hypercorn
spawns the app's task from the connection's own task, and a Trio task inherits its spawner's
context.

A request h11 cannot read (no ``Host``, a bad ``Content-Length`` or chunk size, a head
over Hypercorn's ``h11_max_incomplete_size``, a malformed request line or header) is answered
by Hypercorn with an empty ``400`` (or h11's ``431``/``501``) and the connection closed. The
connection answers it here instead (``_refuse``, in place of Hypercorn's
``_send_error_response`` on each HTTP/1.1 protocol it serves): the same status and close, with
the gateway's error envelope and a sentence that says what was wrong (``_REFUSALS``; h11's own
wording quotes the client's bytes). Hypercorn calls it only while it handles h11's
``RemoteProtocolError``, which is where the reason is read from. The refusal is logged on
``sieproxy.http``, and kept on the connection (``refusal()``) for a request whose app task is
already running (a bad chunk in its body): the app records that status, not a client that left.

What this relies on, of Hypercorn's ``TCPServer`` (``stream``, ``send_lock``, ``protocol``,
``idle_task``, ``_task_group``, ``_read_data``, ``_initiate_server_close``), its task group
(``_nursery``, ``spawn_app``, the module's ``_handle``), its HTTP/1.1 protocol (``connection``,
``stream``, ``config``, ``client``, ``keep_alive_requests``, ``_send_error_response``,
``_send_h11_event``), its HTTP stream (``state``, ``response``, ``closed``), of h11's connection
(``our_state``, ``their_http_version``, ``_cstate``, ``_request_method``, ``_process_event``,
``_writer``), h11's header patterns and ``_parsed``, Trio's per-task yield counter and
Quart-Trio's request body (``body_consumed``) is listed in ``_RELIED_ON`` and ``_PRIVATE`` and
checked by ``missing()``; the wording of h11's ``RemoteProtocolError`` messages cannot be (a
changed one gets the generic sentence). pyproject.toml bounds Hypercorn and h11 below their next
minor versions, and tests/shell/test_hypercorn_io.py checks the behaviour on the installed ones.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from functools import partial
from typing import Any

import h11
import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import tcp_server as hypercorn_tcp_server
from hypercorn.trio.task_group import TaskGroup as HypercornTaskGroup
from hypercorn.trio.tcp_server import TCPServer as HypercornTCPServer
from hypercorn.trio.worker_context import WorkerContext
from quart import Request
from quart_trio.wrappers.request import TrioBody

from .channels import put, take
from .core.errors import InvalidRequest

__all__ = [
    "BodyWrite",
    "ChunkWriter",
    "PortableTCPServer",
    "Receive",
    "TCPServer",
    "body_consumed",
    "body_writer",
    "chunk_writer",
    "install",
    "missing",
    "refusal",
    "send_together",
    "watch_disconnect",
]

BodyWrite = Callable[[bytes], Awaitable[None]]

_SERVING: ContextVar[TCPServer | None] = ContextVar("sieproxy_connection", default=None)

log = logging.getLogger("sieproxy.http")


def _private(module: str, name: str) -> Any:
    """``module.name``, a private name of another library; ``None`` where the installed version
    lacks it (``missing()`` reports it, and ``install()`` then leaves Hypercorn stock)."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


#: The private module-level names read here, by where they live (``None``: absent).
_PRIVATE: dict[str, Any] = {
    f"{m}.{n}": _private(m, n)
    for m, n in (
        ("h11._headers", "_field_name_re"),
        ("h11._headers", "_field_value_re"),
        ("h11._writers", "ChunkedWriter"),
        ("hypercorn.trio.task_group", "_handle"),
    )
}
_FIELD_NAME: Any = _PRIVATE["h11._headers._field_name_re"]
_FIELD_VALUE: Any = _PRIVATE["h11._headers._field_value_re"]
_CHUNKED_WRITER: Any = _PRIVATE["h11._writers.ChunkedWriter"]
_HANDLE: Any = _PRIVATE["hypercorn.trio.task_group._handle"]


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
            # A request h11 refuses is answered with the envelope (the module docstring).
            answer = partial(_refuse, self, proto)
            proto._send_error_response = answer  # type: ignore[method-assign]
        if self.fast:  # the app's queue without a round trip per message (the docstring)
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


#: Why h11 refused a request (how its message starts), as the sentence the client reads.
_REFUSALS: tuple[tuple[str, str], ...] = (
    ("Missing mandatory Host", "The request has no `Host` header; HTTP/1.1 requires one."),
    ("Found multiple Host", "The request has more than one `Host` header; send exactly one."),
    (
        "bad Content-Length",
        "The `Content-Length` header is not a number of bytes; send a decimal integer.",
    ),
    (
        "conflicting Content-Length",
        "The request has `Content-Length` headers that disagree; send one.",
    ),
    (
        "multiple Transfer-Encoding",
        "The request has more than one `Transfer-Encoding` header; send only "
        "`Transfer-Encoding: chunked`.",
    ),
    (
        "Only Transfer-Encoding: chunked",
        "Only `Transfer-Encoding: chunked` is supported for a request body.",
    ),
    (
        "illegal chunk header",
        "A chunk of the chunked request body does not start with its size in hexadecimal "
        "followed by CRLF.",
    ),
    (
        "malformed chunk footer",
        "A chunk of the chunked request body is not followed by CRLF right after its declared "
        "size.",
    ),
    (
        "Receive buffer too long",
        "The request line and headers are larger than the gateway's {limit}-byte limit.",
    ),
    ("illegal request line", "The request line is not `METHOD /path HTTP/1.1`."),
    ("no request line", "The request line is not `METHOD /path HTTP/1.1`."),
    ("illegal header line", "A header line is not `Name: value`."),
    (
        "continuation line",
        "A header line starts with whitespace (a folded header); send each header on one line.",
    ),
    ("Illegal header", "A header name or value contains characters HTTP does not allow."),
    ("Illegal method", "The request method contains characters HTTP does not allow."),
    (
        "Illegal target",
        "The request target contains characters HTTP does not allow; percent-encode them.",
    ),
)
_NOT_HTTP = "The request is not valid HTTP/1.1."
#: The client closed its side of the connection before its request was complete (h11's
#: messages that start with "peer"): answered too, but it is the client leaving, not a refusal.
_CLOSED_EARLY = "The connection was closed before the request was complete."
_json = msgspec.json.Encoder()


def _refusal_reason(error: BaseException | None, limit: int) -> str:
    """The sentence for h11's ``error`` (a generic one for anything else)."""
    if isinstance(error, h11.RemoteProtocolError):
        text = str(error)
        if text.startswith("peer"):
            return _CLOSED_EARLY
        for start, sentence in _REFUSALS:
            if text.startswith(start):
                return sentence.format(limit=limit)
    return _NOT_HTTP


async def _refuse(server: TCPServer, proto: H11Protocol, status: int) -> None:
    """Hypercorn's ``H11Protocol._send_error_response`` on ``server``'s connection: the same
    status (h11's hint) and ``Connection: close``, with the error envelope as the body. Hypercorn
    calls it only inside its ``except h11.RemoteProtocolError``, so the exception being handled
    is the reason."""
    reason = _refusal_reason(sys.exc_info()[1], proto.config.h11_max_incomplete_size)
    if reason is not _CLOSED_EARLY:
        server.refused = (status, reason)
        log.info("refused a request from %s with %d: %s", _peer(proto.client), status, reason)
    body = _json.encode(InvalidRequest(reason).envelope())
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
        *proto.config.response_headers("h11"),
    ]
    await proto._send_h11_event(h11.Response(status_code=status, headers=headers))
    await proto._send_h11_event(h11.Data(data=body))
    await proto._send_h11_event(h11.EndOfMessage())


def _peer(client: tuple[str, int] | None) -> str:
    return "an unknown address" if client is None else f"{client[0]}:{client[1]}"


def refusal() -> tuple[int, str] | None:
    """In an ASGI app's task served by ``TCPServer``: the status and reason of the error answer
    the connection gave to a request it could not read (a malformed chunked body), else
    ``None``. Such a request's app task sees the client leave (``http.disconnect``)."""
    server = _SERVING.get()
    return None if server is None else server.refused


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


class ChunkWriter:
    """The pieces of one chunked response body, framed here and written straight to the
    connection (``chunk_writer()``)."""

    __slots__ = ("_mark", "_rest", "_server", "_stream", "_task")

    def __init__(self, server: TCPServer, stream: HTTPStream) -> None:
        self._server = server
        self._stream = stream
        self._task = trio.lowlevel.current_task()
        self._mark = _yields(self._task)
        self._rest = b""

    async def write(self, data: bytes) -> None:
        if not data:  # an empty chunk would end the body
            return
        if self._stream.closed:  # the client is gone; Hypercorn's own path drops it too
            await trio.lowlevel.checkpoint()
            return
        await self._server.write(_frame(data), settle=False)
        # A scheduling point only if the task has not let others run since the last write: a
        # relay loop that waited for its next bytes has (the usual case: one yield per chunk,
        # not two); one that found them already there yields here, so it cannot starve others.
        mark = _yields(self._task)
        if mark is None or mark == self._mark:
            await trio.lowlevel.cancel_shielded_checkpoint()
            mark = _yields(self._task)
        self._mark = mark

    def write_nowait(self, data: bytes) -> bool:
        """For the relay pump (``sieproxy.pump``), from its task while the response's task
        waits: send ``data`` as one chunk if the connection takes it whole at once, without
        yielding. ``False`` if it did not: what was not sent (the rest of the frame; all of it
        on TLS or while another write is in progress) waits for ``flush``, and the response's
        task must call that before anything else is written. Nothing is kept for a client that
        is gone (dropped, as ``write`` drops it)."""
        if not data:
            return True
        if self._stream.closed:
            return False
        framed = _CHUNK % (len(data), data)  # _frame's, without its call
        sent = self._server.write_nowait(framed)
        if sent == len(framed):
            return True
        self._rest = framed[sent:]
        return False

    @property
    def pending(self) -> bool:
        return bool(self._rest)

    async def flush(self) -> None:
        """Send what ``write_nowait`` left, from the response's task (Hypercorn's shielded
        write: a frame is never cut, and a broken connection is reported to Hypercorn)."""
        rest, self._rest = self._rest, b""
        if rest:
            await self._server.write_rest(rest)


async def send_together(
    send: Callable[[dict[str, Any]], Awaitable[None]],
    messages: list[dict[str, Any]],
    first: bytes = b"",
    then: tuple[dict[str, Any], ...] = (),
    prepared: Head | None = None,
) -> ChunkWriter | None:
    """Send the ASGI ``messages`` (an ``http.response.start``, and maybe body messages), then
    ``first``, a streamed piece of the body, then the messages ``then`` (the body's end), as
    one socket write where the connection is one of ours, HTTP/1.1 on plain TCP (the module
    docstring); elsewhere, each as it would go alone. ``first`` is framed the way the rest of
    the body is: by the gateway where ``chunk_writer()`` gives a writer, through ASGI
    otherwise. ``prepared``: the head of ``messages[0]``, made ahead (``prepare_head``).
    Returns that writer, for the rest of the body (``None`` where the gateway does not frame
    the body itself: ``body_writer`` then sends through ASGI)."""
    server = _SERVING.get()
    holder = server if server is not None and server.can_hold() else None
    if holder is not None:
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled task sends nothing
        holder._held = b""  # Hypercorn's bytes are held from here on (``protocol_send``)
    direct = None
    try:
        if holder is not None and messages:
            head = _head_bytes(holder, messages[0], prepared)
            if head is not None:  # h11's state moved as its own send would have moved it
                holder._held = head  # the first of the held bytes
                messages = messages[1:]
        for message in messages:
            await send(message)  # while held: no yield
        direct = chunk_writer()
        if first:
            if holder is not None and direct is not None:
                await holder.protocol_send(RawData(data=_frame(first)))  # held with the rest
            else:  # as the rest of the body goes (held too if Hypercorn frames it: HTTP/1.0)
                await body_writer(send, direct)(first)
        for message in then:
            await send(message)
    finally:
        if holder is not None:
            # Also when a send failed or the task was cancelled (the end of a whole answer
            # makes Hypercorn tell the app's disconnect watcher, which cancels the response):
            # Hypercorn and h11 count these bytes as sent, and Hypercorn's own writes are
            # shielded.
            await holder.release_held()
    if holder is not None and direct is not None:
        direct._mark = _yields(direct._task)  # that write was this piece's scheduling point
    return direct


#: Response headers the gateway's fast head leaves to h11 (framing and connection handling).
_H11_OWNED = frozenset((b"content-length", b"transfer-encoding", b"connection"))


class Head:
    """A streamed ``200``'s status line and headers, checked and written out ahead of sending
    (``prepare_head``): the part of ``_head_bytes`` that does not depend on the connection's
    state."""

    __slots__ = ("data", "event", "message", "second")

    def __init__(self, message: dict[str, Any], event: h11.Response, data: bytes, second: int):
        self.message, self.event, self.data = message, event, data
        self.second = second  # of Hypercorn's ``date`` header in it


def prepare_head(message: dict[str, Any]) -> Head | None:
    """The head ``send_together`` would write for ``message`` (an ``http.response.start``) on
    this task's connection, made now, to be sent later (``send_together(prepared=...)``): a
    caller that has to wait anyway (for the engine) moves this work out of the way of its
    first bytes. ``None`` where ``send_together`` would not write the head itself. The date in
    it is Hypercorn's, of the second it is sent in (a head kept past that second is made
    again)."""
    server = _SERVING.get()
    if server is None or not server.fast or type(server.protocol.protocol) is not H11Protocol:
        return None
    return _make_head(server.protocol.protocol, message)


def _make_head(proto: H11Protocol, message: dict[str, Any]) -> Head | None:
    if message.get("type") != "http.response.start" or message.get("status") != 200:
        return None
    headers = message.get("headers", [])
    for name, value in headers:
        if type(name) is not bytes or type(value) is not bytes or name.lower() in _H11_OWNED:
            return None
    # Hypercorn adds its own headers (date, server), then h11 the chunked framing (its name in
    # title case, as h11 writes the headers it sets).
    second = int(time.time())  # Hypercorn's date: of this second (``format_date_time``)
    full = [*headers, *proto.config.response_headers("h11"), (b"Transfer-Encoding", b"chunked")]
    for name, value in full:  # what h11 checks of each header (it would raise instead)
        if not _FIELD_NAME.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            return None
    event = h11.Response(headers=full, status_code=200, _parsed=True)
    data = b"HTTP/1.1 200 \r\n" + b"".join(b"%b: %b\r\n" % nv for nv in full) + b"\r\n"
    return Head(message, event, data, second)


def _head_bytes(
    server: TCPServer, message: dict[str, Any], prepared: Head | None = None
) -> bytes | None:
    """The status line and headers of a ``200`` response that h11 will frame as chunks, on a
    kept-alive HTTP/1.1 connection answering a ``POST``: the bytes Hypercorn and h11 would
    write for ``message`` (an ``http.response.start``), with both moved to the state their own
    send leaves (see the module docstring). ``prepared`` is those bytes made earlier for the
    same message (``prepare_head``), used if their date is still this second's. ``None`` where
    any of that does not hold: the message then goes Hypercorn's way."""
    if message.get("type") != "http.response.start" or message.get("status") != 200:
        return None
    proto = server.protocol.protocol
    if type(proto) is not H11Protocol:
        return None
    stream, conn = proto.stream, proto.connection
    if (
        type(stream) is not HTTPStream
        or stream.state is not ASGIHTTPState.REQUEST
        or stream.closed
        or type(conn) is not h11.Connection
        or conn.our_state is not h11.SEND_RESPONSE
        or conn.their_http_version != b"1.1"
        or not conn._cstate.keep_alive
        or conn._request_method != b"POST"
        or proto.keep_alive_requests >= proto.config.keep_alive_max_requests
    ):
        return None
    head = prepared
    if head is None or head.message is not message or head.second != int(time.time()):
        head = _make_head(proto, message)
        if head is None:
            return None
    conn._process_event(h11.SERVER, head.event)  # SEND_BODY, with h11's chunked writer
    stream.response = message  # type: ignore[assignment]  # an http.response.start
    stream.state = ASGIHTTPState.RESPONSE
    return head.data


_CHUNK = b"%x\r\n%b\r\n"


def _frame(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body, byte for byte as h11 frames it."""
    return _CHUNK % (len(data), data)


def _yields(task: trio.lowlevel.Task) -> int | None:
    """How many times ``task`` has yielded to Trio's scheduler (a private counter Trio keeps
    on every task; None if a Trio release drops it: then every write yields, as before)."""
    return getattr(task, "_schedule_points", None)


def chunk_writer() -> ChunkWriter | None:
    """In the task of an ASGI app served by ``TCPServer`` over HTTP/1.1, once it has sent
    ``http.response.start``: a writer whose ``write`` sends one piece of the body as a chunk
    straight to the connection, or ``None`` where the body is not chunked or the connection is
    not one of ours (see the module docstring). The body's end still goes through ASGI."""
    server = _SERVING.get()
    if server is None or not server.fast:
        return None
    proto = server.protocol.protocol  # set before the connection spawns any app task
    if type(proto) is not H11Protocol:
        return None
    conn = proto.connection
    if (
        type(conn) is not h11.Connection
        or conn.our_state is not h11.SEND_BODY
        or type(getattr(conn, "_writer", None)) is not _CHUNKED_WRITER
    ):
        return None
    stream = proto.stream
    if type(stream) is not HTTPStream:
        return None
    return ChunkWriter(server, stream)


def body_writer(
    send: Callable[[dict[str, Any]], Awaitable[None]], direct: ChunkWriter | None
) -> BodyWrite:
    """The way to send the pieces of a response body after ``http.response.start``: ``direct``
    (what ``chunk_writer()`` gave the caller) where there is one, else ASGI
    ``http.response.body`` messages on ``send`` (the body's end is sent through ASGI either
    way)."""
    if direct is not None:
        return direct.write

    async def write(data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    return write


async def watch_disconnect(receive: Callable[[], Awaitable[Any]], scope: trio.CancelScope) -> None:
    """Read what is left of an ASGI request (dropped) until the client leaves, then cancel
    ``scope`` (the response), as Quart-Trio's message task does for Quart's routes."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _spawn_app(
    group: HypercornTaskGroup,
    app: Any,
    config: Any,
    scope: Any,
    send: Callable[[Any], Awaitable[None]],
) -> Callable[[Any], Awaitable[None]]:
    """Hypercorn's ``TaskGroup.spawn_app`` for one connection's task group, with a queue that
    hands a message over without a scheduler round trip when it can (the module docstring)."""
    to_app, from_server = trio.open_memory_channel[Any](config.max_app_queue_size)
    assert group._nursery is not None
    group._nursery.start_soon(
        _HANDLE,
        app,
        config,
        scope,
        Receive(from_server),
        send,
        trio.to_thread.run_sync,
        trio.from_thread.run,
    )
    return _putter(to_app)


#: How many of a request's first ASGI messages go into the app's queue without a scheduler
#: round trip (a body in one piece and its end); later ones yield, as Hypercorn's do.
_PUT_AT_ONCE = 2


def _putter(channel: trio.MemorySendChannel[Any]) -> Callable[[Any], Awaitable[None]]:
    """Hypercorn's ``app_put``. The first ``_PUT_AT_ONCE`` messages go into the queue without
    yielding where it has room (Hypercorn's ``max_app_queue_size``, ten by default): the
    app's task then starts with the whole of a small request's body queued. Every later
    message yields as Hypercorn's does, so an app that answers without reading a large upload
    (a 401) runs before the queue fills: once it has answered, Hypercorn drops the rest, where
    a full queue would block its ``http.disconnect`` for ever."""
    sent = 0

    async def app_put(message: Any) -> None:
        nonlocal sent
        sent += 1
        if sent > _PUT_AT_ONCE:
            await channel.send(message)
        else:
            await put(channel, message)

    return app_put


class Receive:
    """The app's ASGI ``receive`` on these connections: a message already queued is returned
    at once, otherwise it waits, as Hypercorn's does. ``nowait()`` is the queued message, or
    ``None`` (for a reader that needs a timer only when it must wait)."""

    __slots__ = ("_channel",)

    def __init__(self, channel: trio.MemoryReceiveChannel[Any]) -> None:
        self._channel = channel

    async def __call__(self) -> Any:
        return await take(self._channel)

    def nowait(self) -> Any:
        try:
            return self._channel.receive_nowait()
        except trio.WouldBlock:
            return None


def body_consumed(req: Request) -> bool:
    """Whether Quart has read the whole of ``req``'s body (a refusal that leaves part of it
    unread must close the connection). Read from Quart-Trio's private ``_complete`` and
    ``_data``; where a version lacks them, ``True`` (Quart's own behaviour: no close)."""
    body = req.body
    complete = getattr(body, "_complete", None)
    return complete is None or bool(complete.is_set() and not getattr(body, "_data", b""))


def _named(cls: type) -> set[str]:
    """The names the code of ``cls`` (and of its bases) uses: an attribute its instances get in
    ``__init__`` or later is among them."""
    found: set[str] = set()
    for klass in cls.__mro__:
        for value in vars(klass).values():
            code = getattr(value, "__code__", None)
            if code is not None:
                found.update(code.co_names)
    return found


#: What this module relies on of other libraries' classes, checked by ``missing()``: the class
#: attributes (methods, properties, constants: ``hasattr``) and the instance attributes (named
#: by the class's own code), read, written, replaced or called here.
_RELIED_ON: tuple[tuple[type, tuple[str, ...], tuple[str, ...]], ...] = (
    (
        HypercornTCPServer,
        ("_initiate_server_close", "_read_data", "protocol_send", "run"),
        ("_task_group", "config", "context", "idle_task", "protocol", "send_lock", "stream"),
    ),
    (HypercornTaskGroup, ("spawn_app",), ("_nursery",)),
    (
        H11Protocol,
        ("_send_error_response", "_send_h11_event"),
        ("client", "config", "connection", "keep_alive_requests", "stream"),
    ),
    (HTTPStream, (), ("closed", "response", "state")),
    (ASGIHTTPState, ("REQUEST", "RESPONSE"), ()),
    (WorkerContext, (), ("terminated",)),
    (
        HypercornConfig,
        (
            "h11_max_incomplete_size", "keep_alive_max_requests", "keep_alive_timeout",
            "max_app_queue_size", "read_timeout", "response_headers",
        ),
        (),
    ),
    (
        h11.Connection,
        ("_process_event", "our_state"),
        ("_cstate", "_request_method", "_writer", "their_http_version"),
    ),
    (trio.lowlevel.Task, ("_schedule_points",), ()),
    (TrioBody, (), ("_complete", "_data")),
)


def missing() -> list[str]:
    """What this module relies on that the installed Hypercorn, h11, Trio or Quart lacks: the
    private module-level names, the attributes of their classes (``_RELIED_ON``), h11's
    ``_parsed`` shortcut and its connection state's ``keep_alive``, and the module global
    ``install()`` sets. Empty when everything is there."""
    gaps = [name for name in _PRIVATE if _private(*name.rsplit(".", 1)) is None]
    for cls, on_class, on_instances in _RELIED_ON:
        where = f"{cls.__module__}.{cls.__qualname__}"
        gaps += [f"{where}.{n}" for n in on_class if not hasattr(cls, n)]
        named = _named(cls) if on_instances else set()
        gaps += [f"{where}.{n}" for n in on_instances if n not in named]
    try:
        h11.Response(status_code=200, headers=[], _parsed=True)
    except TypeError:
        gaps.append("h11.Response(_parsed=...)")
    state = getattr(h11.Connection(h11.SERVER), "_cstate", None)
    if state is not None and not hasattr(state, "keep_alive"):
        gaps.append("h11._state.ConnectionState.keep_alive")
    if not hasattr(hypercorn_run, "TCPServer"):
        gaps.append("hypercorn.trio.run.TCPServer")
    return gaps


def install(fast: bool = True) -> Callable[[], None]:
    """At start, before Hypercorn's Trio worker in this process accepts a connection: check
    ``missing()`` and have the worker serve its connections with ``TCPServer`` (``fast``),
    ``PortableTCPServer`` (not ``fast``), or Hypercorn's own class where something is missing.
    The two last are logged in one line. Returns what puts back the class that was there (if
    it is still this one's choice); the worker reads it once, when it starts serving."""
    gaps = missing()
    chosen: type[HypercornTCPServer]
    if gaps:
        chosen = HypercornTCPServer
        log.warning(
            "server front: stock Hypercorn and Quart (no fast paths, none of the gateway's "
            "connection fixes): the installed versions lack %s",
            ", ".join(gaps),
        )
    elif not fast:
        chosen = PortableTCPServer
        log.info(
            "server front: fast paths off (fast_paths = false or SIEPROXY_FAST_PATHS=0): "
            "Hypercorn reads, writes and frames every byte; no relay pump"
        )
    else:
        chosen = TCPServer
    before = getattr(hypercorn_run, "TCPServer", None)
    hypercorn_run.TCPServer = chosen  # type: ignore[attr-defined]

    def undo() -> None:
        if getattr(hypercorn_run, "TCPServer", None) is chosen:
            hypercorn_run.TCPServer = before  # type: ignore[attr-defined,assignment]

    return undo
