"""The response body's writers: the gateway's own chunk framing (``chunk_writer()``,
``ChunkWriter``), the head written ahead (``prepare_head``, ``_head_bytes``) and the writes
joined (``send_together``), and ``body_writer()``, what the gateway writes a body with.

``chunk_writer()`` goes one step beyond the connection's direct write
(``sieproxy.front.hypercorn_io.connection``) for a streamed response body. Each piece an ASGI
app sends passes through Hypercorn's ``HTTPStream.app_send`` (a ``Body`` event and a copy), its
``H11Protocol`` (an ``h11.Data`` event through h11's state machine, which frames it as a chunk
and joins the pieces: another copy) and a ``RawData`` event, before it reaches the socket write:
about a tenth of the gateway's CPU per relayed token (bench/RESULTS.md). When h11
frames the response as chunks (an HTTP/1.1 client, no ``Content-Length``) — a framing that
keeps no state between chunks — the writer frames each piece itself (the length in hex, CRLF,
the bytes, CRLF: exactly what h11 writes) and hands it to the connection's write. The head
and the end of the body still go through ASGI, so h11 and Hypercorn see the whole exchange:
the status line and headers, the empty last chunk, keep-alive and the next request on the
connection. Where the conditions do not hold (an HTTP/1.0 client, HTTP/2, another server, a
body with a length) it returns ``None``, and ``body_writer()`` (what the gateway writes with)
sends through ASGI instead. Over TLS the framed chunk takes Hypercorn's own write.

A piece written this way yields to the scheduler only if the response's task has not yielded
since its previous piece. A relay that waited for the bytes it writes already has, so a
streamed token costs one scheduling round trip, not two; pieces whose bytes were already there
still yield between them, so a busy stream cannot starve the others. The count of yields is a
private counter Trio keeps on each task; without it, every piece yields.

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
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio
from hypercorn.events import RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream

from .asgi_side import _SERVING
from .connection import TCPServer
from .fence import _CHUNKED_WRITER, _FIELD_NAME, _FIELD_VALUE

__all__ = [
    "BodyWrite",
    "ChunkWriter",
    "Head",
    "body_writer",
    "chunk_writer",
    "prepare_head",
    "send_together",
]

BodyWrite = Callable[[bytes], Awaitable[None]]


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
