"""One generation request's HTTP handling, from the ASGI scope to the response's last byte.

``sieproxy.app.GatewayHTTPConnection`` hands ``POST`` on the generation routes to
:func:`serve_generation`: it reads the headers it needs and the body (``read_body``,
sieproxy/request_body.py), plans and admits the request (:func:`_start`) and sends the response
(:func:`_send_generation`), while :func:`_watch_client` cancels it all if the client leaves. The
error envelope, the request id and the auth check, which the Quart routes use too
(sieproxy/app.py), live here.

Every status decision for a generation request happens before its status line is sent: auth
(401), draining (503), body size (413) and type (400), decoding and validation (400), the model
(404), routing headers (400) and readiness/admission (503, unless a fallback of the model
takes the request: sieproxy/fallback.py); then the response body is entered
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
import trio
from quart import Response

from .core.errors import (
    GatewayError,
    InternalError,
    InvalidRequest,
    ServiceUnavailable,
)
from .core.pipeline import build_chat, build_completion, build_responses
from .fallback import Fallbacks, cause_of
from .hypercorn_io import (
    body_writer,
    prepare_head,
    refusal,
    send_together,
    watch_disconnect,
)
from .pool import RouteHints
from .relay import GenerationBody
from .request_body import ClientGone, read_body
from .state import GatewayState
from .stats import RequestStats

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


def error_response(err: GatewayError, request_id: str | None = None) -> Response:
    resp = Response(_json.encode(err.envelope()), status=err.status, content_type=_JSON_CT)
    for k, v in err.headers.items():
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


async def _watch_client(receive: Any, scope: trio.CancelScope, client: _Client) -> None:
    await watch_disconnect(receive, scope)
    # Nothing has yielded since the cancel: the response's task has not seen it yet.
    if not client.ended:
        client.left = True


async def serve_generation(
    state: GatewayState, endpoint: str, body_timeout: float, scope: Any, receive: Any, send: Any
) -> None:
    headers: dict[bytes, str] = {}
    for name, value in scope["headers"]:
        if name in _WANTED and name not in headers:  # the first one, as Quart's get() returns
            headers[name] = value.decode("latin-1")
    rid = request_id_for(headers.get(b"x-request-id"))
    raw: bytes | None = None  # the request body, once read to its end
    client = _Client()
    async with trio.open_nursery() as nursery:
        body: GenerationBody | None = None
        try:
            try:
                check_auth(state, headers.get(b"authorization"))
                g = state.settings.gateway
                if state.draining:
                    raise ServiceUnavailable(
                        "The gateway is shutting down; retry on another instance.",
                        retry_after=g.retry_after,
                    )
                raw = await read_body(headers, receive, g.max_body_bytes, body_timeout)
                nursery.start_soon(_watch_client, receive, nursery.cancel_scope, client)
                body = await _start(state, endpoint, rid, headers, raw, client)
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
                state.observer.refusal(endpoint, err, request_id=rid, sdk_version=sdk)
                client.ended = True
                await _send_whole(send, error_response(err, rid), close=raw is None)
                return
            ctype = b"text/event-stream" if body.streaming else _JSON_CT_B
            out = [(b"content-type", ctype), (b"x-request-id", rid.encode("latin-1"))]
            if body.streaming:
                out += _SSE_HEADERS
            await _send_generation(send, out, body, client)
        finally:
            if body is not None:
                if not body.entered:  # the client left before the body was entered
                    body.discard()
                state.active.discard(body)  # only once its last byte is out (graceful drain)
            elif client.left:  # before its body arrived, or while waiting for admission
                sdk = headers.get(b"x-sie-sdk-version")
                state.observer.client_left(endpoint, request_id=rid, sdk_version=sdk)
            nursery.cancel_scope.cancel()


def as_error(exc: Exception, request_id: str | None) -> GatewayError:
    """``exc`` if it is a gateway error (a refusal), else a logged 500: a bug in the gateway
    answers with the error envelope, never a traceback."""
    if isinstance(exc, GatewayError):
        return exc
    log.error("request %s: unhandled error", request_id, exc_info=exc)
    return InternalError("The gateway failed to process this request.")


def check_auth(state: GatewayState, raw: str | None) -> None:
    state.auth.check(raw.encode("utf-8", "surrogateescape") if raw is not None else None)


async def _start(
    state: GatewayState,
    endpoint: str,
    rid: str,
    headers: dict[bytes, str],
    raw: bytes,
    client: _Client,
) -> GenerationBody:
    """Plan the request and admit it: the response body, not entered yet (every status
    decision before the body is primed is taken here)."""
    g = state.settings.gateway
    if endpoint == "chat":
        builder = build_chat
    else:
        builder = build_completion if endpoint == "completions" else build_responses
    created = state.created()
    plan = builder(raw, state.profiles, request_id=rid, created=created)
    pool = state.pools[plan.model]
    policy = pool.policy  # routing = "cache_aware" (sieproxy/cache_route.py)
    hints = RouteHints(
        pool=headers.get(b"x-sie-pool") or None,
        machine_profile=headers.get(b"x-sie-machine-profile") or None,
        affinity_key=plan.affinity_key,
        prefix_key=plan.prefix_key,
        route=None if policy is None else await policy.prepare(plan.bodies),
    )
    route = hints.route
    pool.check_hints(hints)
    stats = RequestStats(
        request_id=rid, model=plan.model, endpoint=endpoint, n=plan.n, stream=plan.stream
    )
    stats.sdk_version = headers.get(b"x-sie-sdk-version")
    fb: Fallbacks | None = None  # made when first needed (sieproxy/fallback.py)

    def fallbacks() -> Fallbacks:
        nonlocal fb
        if fb is None:
            fb = Fallbacks(
                plan=plan,
                hints=hints,
                targets=state.settings.fallback_chain(plan.model),
                planner=lambda m: builder(
                    raw, state.profiles, request_id=rid, created=created, model=m
                ),
                pools=state.pools,
                profiles=state.profiles,
                observer=state.observer,
            )
        return fb

    conf = state.settings.models.get(plan.model)
    has_fallbacks = conf is not None and bool(conf.fallbacks)
    try:
        replica = await pool.acquire(hints, len(plan.bodies))
    except ServiceUnavailable as exc:
        route = await fallbacks().next(cause_of(exc)) if has_fallbacks else None
        if route is None:
            raise
        pool, hints, replica, stats.model = route.pool, route.hints, route.replica, route.model
        plan = fallbacks().current
    stats.replica = replica.url
    if route is not None:
        stats.on_first_token = lambda: route.policy.first_token(route)

    def finish(b: GenerationBody) -> None:
        served = fb.current if fb is not None else plan
        b.stats.prompt_tokens, b.stats.completion_tokens = served.usage()
        if route is not None:
            reported = [c.cached_tokens for c in served.shaper.choices] if b.stats.responded else []
            b.stats.cached_tokens = min(reported) if reported else None
            b.stats.cached_predicted = route.predicted
            route.policy.done(route, b.stats.cached_tokens)
        b.stats.outcome = client.outcome()
        state.observer.request_done(b.stats)

    body = GenerationBody(
        g=g,
        client=state.client,
        pool=pool,
        replica=replica,
        hints=hints,
        bodies=plan.bodies,
        shaper=plan.shaper,
        streaming=plan.stream,
        stats=stats,
        on_done=finish,
        timer=state.timer,
        pump=state.pump,
        fallback=(lambda cause, failed: fallbacks().next(cause, failed)) if has_fallbacks else None,
        fields=plan.fields,
    )
    state.active.add(body)
    return body


async def _send_generation(
    send: Any, headers: list[tuple[bytes, bytes]], body: GenerationBody, client: _Client
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
            await _send_whole(send, error_response(err, body.stats.request_id))
            return
        # The head and the first frames go out in one socket write; the whole answer (not
        # streamed, or a stream that ended at once) with the body's end too.
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
            body.carry(direct)  # the relay pump may write its chunks (sieproxy/pump.py)
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


async def _send_whole(send: Any, resp: Response, *, close: bool = False) -> None:
    data = await resp.get_data()
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    start = {"type": "http.response.start", "status": resp.status_code, "headers": headers}
    await send_together(send, [start, _body(data, more=False)])


def request_id_for(given: str | None) -> str:
    """The client's ``X-Request-Id`` if it is well formed, else a new one: 32 random hex digits
    (the shape of ``uuid4().hex`` without building a ``UUID``: a fifth of its cost, on the path
    to a request's first token)."""
    if given and _REQUEST_ID_RE.match(given):
        return given
    return os.urandom(16).hex()
