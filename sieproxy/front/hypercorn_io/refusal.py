"""The answer to a request h11 cannot read.

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
The wording of h11's messages is not checked at start (``missing()`` cannot): a changed one gets
the generic sentence.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

import h11
import msgspec
from hypercorn.protocol.h11 import H11Protocol

from ...core.errors import InvalidRequest
from .asgi_side import _SERVING

if TYPE_CHECKING:
    from .connection import TCPServer

__all__ = ["refusal"]

log = logging.getLogger("sieproxy.http")

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
