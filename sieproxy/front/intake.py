"""One generation request's HTTP handling, from the ASGI scope to the response's last byte.

``sieproxy.front.app.GatewayHTTPConnection`` hands ``POST`` on the generation routes to
:func:`serve_generation`: it reads the headers it needs and the body (``read_body``,
sieproxy/front/request_body.py), has its surface plan it and admits it
(:func:`sieproxy.front.admit.start`) and sends the response (:func:`_send_generation`), while a
``ClientWatch`` cancels it all if the client leaves. The error envelope, the request id and the
auth check, which the Quart routes use too (sieproxy/front/app.py), live here.

Every status decision for a generation request happens before its status line is sent: auth
(401), draining (503), body size (413) and type (400), decoding and validation (400), the model
(404), routing headers (400) and readiness/admission (503, unless a fallback of the model
takes the request: sieproxy/relay/fallback.py); then the response body is entered
and *primed* (first upstream event, or the whole answer when not streaming) before
``http.response.start`` is sent, so an engine that fails before producing anything still yields
a proper status (503 + Retry-After, 500 "malformed", ...), never a 200 with an error. An error
answered before the request body was read closes the connection (the unread body would wedge
it), as for every other route.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import msgspec
from quart import Response

from ..core.errors import GatewayError, InternalError, InvalidRequest, ServiceUnavailable
from ..relay.body import GenerationBody
from ..settings.keys import KeyEntry
from ..surfaces import Surface
from .admit import start, tenant_of
from .hypercorn_io import (
    ClientWatch,
    body_writer,
    prepare_head,
    refusal,
    send_together,
)
from .request_body import ClientGone, read_body
from .state import GatewayState

__all__ = [
    "as_error",
    "check_auth",
    "error_response",
    "request_id_for",
    "serve_generation",
]

log = logging.getLogger("sieproxy.app")  # the name it has always logged under

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_json = msgspec.json.Encoder()
_JSON_CT = "application/json"
_JSON_CT_B = b"application/json"
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


def error_response(
    err: GatewayError, request_id: str | None = None, surface: Surface | None = None
) -> Response:
    """``err`` in the error envelope of ``surface``'s API (:meth:`Surface.error`), OpenAI's
    on the routes of no surface."""
    if surface is not None:
        status, headers, body = surface.error(err)
        resp = Response(body, status=status, content_type=_JSON_CT)
    else:
        resp = Response(_json.encode(err.envelope()), status=err.status, content_type=_JSON_CT)
        headers = err.headers
    for k, v in headers.items():
        resp.headers[k] = v
    if request_id:
        resp.headers["X-Request-Id"] = request_id
    return resp


#: The request headers a generation request reads (ASGI header names are lower case).
_WANTED = frozenset(
    (
        b"authorization",
        b"content-length",
        b"content-type",
        b"x-api-key",
        b"x-request-id",
        b"x-sie-machine-profile",
        b"x-sie-pool",
        b"x-sie-sdk-version",
    )
)


class _Client:
    """One generation request's client as the disconnect watcher sees it: ``left`` once it
    left before the response's end, which the response marks (``ended``) as it hands the end
    (or a whole answer) to the server (the client's leaving after that is the normal end)."""

    __slots__ = ("ended", "left")

    def __init__(self) -> None:
        self.left = False
        self.ended = False

    def outcome(self) -> str:
        """The response's outcome for the access log (``RequestStats.outcome``)."""
        return "client_closed" if self.left else "complete" if self.ended else "cut"

    def leave(self) -> None:
        """The client left (``ClientWatch``; the response's task has not seen it yet)."""
        if not self.ended:
            self.left = True


async def serve_generation(
    state: GatewayState, surface: Surface, body_timeout: float, scope: Any, receive: Any, send: Any
) -> None:
    endpoint = surface.name
    headers: dict[bytes, str] = {}
    for name, value in scope["headers"]:
        if name in _WANTED and name not in headers:  # the first one, as Quart's get() returns
            headers[name] = value.decode("latin-1")
    rid = request_id_for(headers.get(b"x-request-id"))
    raw: bytes | None = None  # the request body, once read to its end
    client = _Client()
    async with ClientWatch(receive) as watch:
        body: GenerationBody | None = None
        entry: KeyEntry | None = None
        try:
            try:
                entry = check_auth(state, _credentials(surface, headers))
                g = state.settings.gateway
                if state.draining:
                    raise ServiceUnavailable(
                        "The gateway is shutting down; retry on another instance.",
                        retry_after=g.retry_after,
                    )
                raw = await read_body(headers, receive, g.max_body_bytes, body_timeout)
                watch.watch(client.leave)
                started = await start(state, surface, rid, headers, raw, client.outcome, entry)
                body, limit_headers = started
            except ClientGone:
                refused = refusal()  # the connection answered a body it could not read
                if refused is None:
                    client.left = True
                else:
                    bad = InvalidRequest(refused[1])
                    bad.status = refused[0]
                    sdk = headers.get(b"x-sie-sdk-version")
                    state.observer.refusal(endpoint, bad, request_id=rid, sdk_version=sdk)
                return
            except Exception as exc:
                err = as_error(exc, rid)  # counted with no model label: it may be unknown
                sdk = headers.get(b"x-sie-sdk-version")
                state.observer.refusal(
                    endpoint, err, request_id=rid, sdk_version=sdk, tenant=tenant_of(entry)
                )
                client.ended = True
                await _send_error(send, surface, err, rid, close=raw is None)
                return
            ctype = b"text/event-stream" if body.streaming else _JSON_CT_B
            out = [(b"content-type", ctype), (b"x-request-id", rid.encode("latin-1"))]
            if body.streaming:
                out += _SSE_HEADERS
            out += limit_headers
            await _send_generation(send, out, body, client, surface)
        finally:
            if body is not None:
                if not body.entered:  # the client left before the body was entered
                    body.discard()
                state.active.discard(body)  # only once its last byte is out (graceful drain)
            elif client.left:  # before its body arrived, or while waiting for admission
                sdk = headers.get(b"x-sie-sdk-version")
                state.observer.client_left(endpoint, request_id=rid, sdk_version=sdk)
            watch.scope.cancel()


def as_error(exc: Exception, request_id: str | None) -> GatewayError:
    """``exc`` if it is a gateway error (a refusal), else a logged 500: a bug in the gateway
    answers with the error envelope, never a traceback."""
    if isinstance(exc, GatewayError):
        return exc
    log.error("request %s: unhandled error", request_id, exc_info=exc)
    return InternalError("The gateway failed to process this request.")


def _credentials(surface: Surface, headers: dict[bytes, str]) -> str | None:
    """The ``Authorization`` value to check: a key in one of the surface's own key headers
    (``x-api-key`` on Anthropic's routes, which Anthropic clients send) is checked as its
    bearer token, and wins over ``Authorization``."""
    for name in surface.key_headers:
        key = headers.get(name)
        if key is not None:
            return f"Bearer {key}"
    return headers.get(b"authorization")


def check_auth(state: GatewayState, raw: str | None) -> KeyEntry | None:
    """The key's entry (its tenant), None with auth off; 401 otherwise."""
    return state.auth.check(raw.encode("utf-8", "surrogateescape") if raw is not None else None)


async def _send_generation(
    send: Any,
    headers: list[tuple[bytes, bytes]],
    body: GenerationBody,
    client: _Client,
    surface: Surface,
) -> None:
    async with body:
        start = {"type": "http.response.start", "status": 200, "headers": headers}
        try:
            # The engine requests go out first (every candidate's that finds a connection), and
            # the response head is made while the engine works on them (it is sent only if the
            # engine answers).
            sent = await body.open()
            prepared = prepare_head(start) if sent and body.streaming else None
            head = await body.prime()
        except Exception as exc:
            err = body.stats.error = as_error(exc, body.stats.request_id)
            body.stats.responded = client.ended = True
            await _send_error(send, surface, err, body.stats.request_id)
            return
        # The head and the first frames go out in one socket write; the whole answer (not
        # streamed, or a stream whose engine sent all of it at once) with the body's end too.
        while body.at_hand():
            head += await body.__anext__()
        messages = [start]
        body.stats.responded = True
        if body.done:
            messages.append(_body(head, more=False))
            head = b""
            client.ended = True
        sending = send_together(send, messages, head, prepared=prepared)
        direct = await body.client_write(sending)
        if body.done:
            return
        write = body_writer(send, direct)
        if direct is not None:
            body.carry(direct)  # the relay pump may write its chunks (sieproxy/relay/pump.py)
        while True:
            try:
                data = await body.__anext__()
            except StopAsyncIteration:
                client.ended = True  # sent below
                break
            if not data:
                continue
            if body.done:  # the last frames ([DONE], or an error event): with the body's end
                client.ended = True
                await body.client_write(send_together(send, [], data, (_body(b"", more=False),)))
                return
            await body.client_write(write(data))
    await send(_body(b"", more=False))


def _body(data: bytes | str, *, more: bool) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def _send_error(
    send: Any, surface: Surface, err: GatewayError, request_id: str, *, close: bool = False
) -> None:
    """``err`` in ``surface``'s envelope, whole; ``close``: the connection closes after it (an
    error answered before the request body was read)."""
    status, extra, data = surface.error(err)
    headers = [
        (b"content-type", _JSON_CT_B),
        (b"content-length", str(len(data)).encode("latin-1")),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    if close:
        headers.append((b"connection", b"close"))
    head = {"type": "http.response.start", "status": status, "headers": headers}
    await send_together(send, [head, _body(data, more=False)])


def request_id_for(given: str | None) -> str:
    """The client's ``X-Request-Id`` if it is well formed, else a new one: 32 random hex digits
    (the shape of ``uuid4().hex`` without building a ``UUID``: a fifth of its cost, on the path
    to a request's first token)."""
    if given and _REQUEST_ID_RE.match(given):
        return given
    return os.urandom(16).hex()
