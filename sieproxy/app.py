"""The Quart-Trio application: routes, status decisions, error envelopes.

The generation routes (``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``) are
answered by :class:`GatewayHTTPConnection` straight from the ASGI scope, before Quart builds a
request object or routes it (:func:`_serve_generation`): Quart's per-request machinery (its
``Request`` with every header re-cased, the request and app contexts, URL matching, the hooks,
the body handed over by a second task, the ``Response``) cost about a third of the gateway's own
time to first token at one client (docs/DESIGN.md). Every other request — other paths, other
methods on these paths (405 with ``Allow: POST``), health, metrics, models — goes through Quart
as usual.

Every status decision for a generation request happens before its status line is sent: auth
(401), draining (503), body size (413) and type (400), decoding and validation (400), the model
(404), routing headers (400) and readiness/admission (503, unless a fallback of the model
takes the request: sieproxy/fallback.py); then the response body is entered
and *primed* (first upstream event, or the whole answer when not streaming) before
``http.response.start`` is sent, so an engine that fails before producing anything still yields
a proper status (503 + Retry-After, 500 "malformed", ...), never a 200 with an error. An error
answered before the request body was read closes the connection (the unread body would wedge
it), as for every other route.

Quart's ``RESPONSE_TIMEOUT`` (60 s by default) would silently cut a long stream; it is disabled,
and the gateway's own deadlines end streams with an SSE error event instead.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import msgspec
import trio
from quart import Quart, Response, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from .auth import Authenticator
from .core.errors import (
    BodyTooLarge,
    GatewayError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    ServiceUnavailable,
)
from .core.pipeline import build_chat, build_completion, build_responses, find_profile
from .core.profile import ModelProfile
from .discovery import EngineSources
from .engine_client import EngineClient
from .fallback import Fallbacks, cause_of
from .hypercorn_io import (
    body_consumed,
    body_writer,
    prepare_head,
    refusal,
    send_together,
    watch_disconnect,
)
from .observe import Observer
from .pool import ModelPool, RouteHints
from .pump import Pump
from .relay import GenerationBody, RequestStats, WaitTimer
from .settings import Settings

__all__ = ["GatewayState", "create_app"]

log = logging.getLogger("sieproxy.app")

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_json = msgspec.json.Encoder()
_JSON_CT = "application/json"
_JSON_CT_B = b"application/json"
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


@dataclass
class GatewayState:
    """Everything the routes share; built once per process."""

    settings: Settings
    profiles: dict[str, ModelProfile]
    pools: dict[str, ModelPool]
    client: EngineClient
    auth: Authenticator
    observer: Observer
    draining: bool = False
    active: set[GenerationBody] = field(default_factory=set)
    timer: WaitTimer = field(default_factory=WaitTimer)
    pump: Pump = field(default_factory=Pump)
    #: Where each model's replicas come from (static entries, DNS names, an engines file).
    sources: dict[str, EngineSources] = field(default_factory=dict)
    created: Callable[[], int] = lambda: int(time.time())


def _error_response(err: GatewayError, request_id: str | None = None) -> Response:
    resp = Response(_json.encode(err.envelope()), status=err.status, content_type=_JSON_CT)
    for k, v in err.headers.items():
        resp.headers[k] = v
    if request_id:
        resp.headers["X-Request-Id"] = request_id
    return resp


class GatewayHTTPConnection(TrioASGIHTTPConnection):
    """Answers ``POST`` on the generation routes itself (see the module docstring); hands every
    other request to Quart."""

    async def __call__(self, receive: Any, send: Any) -> None:
        scope = self.scope
        endpoint = _GENERATION.get(_route_path(scope)) if scope["method"] == "POST" else None
        if endpoint is None:
            await super().__call__(receive, send)
            return
        state: GatewayState = self.app.extensions["sieproxy"]
        body_timeout = float(self.app.config["BODY_TIMEOUT"])
        await _serve_generation(state, endpoint, body_timeout, scope, receive, send)


#: The generation routes and their endpoint labels (metrics, logs).
_GENERATION = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}
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


def _route_path(scope: Any) -> str:
    """The path Quart would route (it strips the ``root_path`` the app is mounted at)."""
    path: str = scope["path"]
    if path[:1] != "/":
        path = urlparse(path).path
    root: str = scope.get("root_path", "")
    if root:
        _, sep, tail = path.partition(root)
        path = (tail or " ") if sep else " "
    return path


class _ClientGone(Exception):
    """The client left before its request body arrived: nothing is answered."""


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


async def _serve_generation(
    state: GatewayState, endpoint: str, body_timeout: float, scope: Any, receive: Any, send: Any
) -> None:
    headers: dict[bytes, str] = {}
    for name, value in scope["headers"]:
        if name in _WANTED and name not in headers:  # the first one, as Quart's get() returns
            headers[name] = value.decode("latin-1")
    rid = _request_id(headers.get(b"x-request-id"))
    raw: bytes | None = None  # the request body, once read to its end
    client = _Client()
    async with trio.open_nursery() as nursery:
        body: GenerationBody | None = None
        try:
            try:
                _check_auth(state, headers.get(b"authorization"))
                g = state.settings.gateway
                if state.draining:
                    raise ServiceUnavailable(
                        "The gateway is shutting down; retry on another instance.",
                        retry_after=g.retry_after,
                    )
                raw = await _read_body(headers, receive, g.max_body_bytes, body_timeout)
                nursery.start_soon(_watch_client, receive, nursery.cancel_scope, client)
                body = await _start(state, endpoint, rid, headers, raw, client)
            except _ClientGone:
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
                err = _as_error(exc, rid)  # counted with no model label: it may be unknown
                sdk = headers.get(b"x-sie-sdk-version")
                state.observer.refusal(endpoint, err, request_id=rid, sdk_version=sdk)
                client.ended = True
                await _send_whole(send, _error_response(err, rid), close=raw is None)
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


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"The request body is larger than the {limit}-byte limit.")


def _as_error(exc: Exception, request_id: str | None) -> GatewayError:
    """``exc`` if it is a gateway error (a refusal), else a logged 500: a bug in the gateway
    answers with the error envelope, never a traceback."""
    if isinstance(exc, GatewayError):
        return exc
    log.error("request %s: unhandled error", request_id, exc_info=exc)
    return InternalError("The gateway failed to process this request.")


def _check_auth(state: GatewayState, raw: str | None) -> None:
    state.auth.check(raw.encode("utf-8", "surrogateescape") if raw is not None else None)


async def _read_body(
    headers: dict[bytes, str], receive: Any, g_max: int, timeout: float
) -> bytes:
    length = headers.get(b"content-length")
    if length is not None and int(length) > g_max:  # h11 has checked it is a number
        raise _too_large(g_max)
    ctype = headers.get(b"content-type")
    if ctype is not None and ctype.split(";")[0].strip().lower() != _JSON_CT:
        raise InvalidRequest(
            "The request body must be JSON: send `Content-Type: application/json`."
        )
    body = _Body(g_max)
    # What is already queued needs no timer: on the gateway's own connections the whole body
    # of a small request usually is (hypercorn_io.Receive.nowait).
    nowait = getattr(receive, "nowait", None)
    if nowait is not None:
        while (msg := nowait()) is not None:
            if body.take(msg):
                return body.data()
    with trio.move_on_after(timeout) as scope:
        while not body.take(await receive()):
            pass
    if scope.cancelled_caught:
        raise InvalidRequest("The request body was not received in time.")
    return body.data()


class _Body:
    """A request body gathered from ASGI ``http.request`` messages, within ``limit`` bytes."""

    __slots__ = ("_limit", "_parts", "_size")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0

    def take(self, msg: dict[str, Any]) -> bool:
        """Add one message; True once the body is complete."""
        if msg["type"] != "http.request":  # http.disconnect
            raise _ClientGone
        data = msg.get("body", b"")
        if data:
            self._size += len(data)
            if self._size > self._limit:
                raise _too_large(self._limit)
            self._parts.append(data)
        return not msg.get("more_body", False)

    def data(self) -> bytes:
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)


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
    hints = RouteHints(
        pool=headers.get(b"x-sie-pool") or None,
        machine_profile=headers.get(b"x-sie-machine-profile") or None,
        affinity_key=plan.affinity_key,
        prefix_key=plan.prefix_key,
    )
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

    def finish(b: GenerationBody) -> None:
        served = fb.current if fb is not None else plan
        b.stats.prompt_tokens, b.stats.completion_tokens = served.usage()
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
            err = body.stats.error = _as_error(exc, body.stats.request_id)
            body.stats.responded = client.ended = True
            await _send_whole(send, _error_response(err, body.stats.request_id))
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


class GatewayApp(QuartTrio):
    asgi_http_class = GatewayHTTPConnection


def _request_id(given: str | None) -> str:
    """The client's ``X-Request-Id`` if it is well formed, else a new one: 32 random hex digits
    (the shape of ``uuid4().hex`` without building a ``UUID``: a fifth of its cost, on the path
    to a request's first token)."""
    if given and _REQUEST_ID_RE.match(given):
        return given
    return os.urandom(16).hex()


def _model_object(name: str) -> dict[str, Any]:
    """OpenAI's model object (``GET /v1/models`` lists them, ``/v1/models/{id}`` returns one)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "sieproxy"}


def create_app(state: GatewayState) -> Quart:
    """Build the Quart-Trio app around a ready :class:`GatewayState`."""
    app = GatewayApp("sieproxy")
    g = state.settings.gateway
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60  # seconds for a request body to arrive, on every route
    app.config["MAX_CONTENT_LENGTH"] = g.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    app.extensions["sieproxy"] = state

    @app.before_request
    async def _mint_request_id() -> None:
        rid = _request_id(request.headers.get("X-Request-Id"))
        request.sie_request_id = rid  # type: ignore[attr-defined]

    @app.after_request
    async def _echo_request_id(resp: Response) -> Response:
        rid = getattr(request, "sie_request_id", None)
        if rid and "X-Request-Id" not in resp.headers:
            resp.headers["X-Request-Id"] = rid
        if resp.status_code >= 400 and not body_consumed(request):
            # Refused before the upload was read (401, 413, bad content type): the unread body
            # would wedge a kept-alive connection, so this answer closes it.
            resp.headers["Connection"] = "close"
        return resp

    @app.errorhandler(GatewayError)
    async def _gateway_error(err: GatewayError) -> Response:
        return _error_response(err, getattr(request, "sie_request_id", None))

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        rid = getattr(request, "sie_request_id", None)
        code = exc.code or 500
        if code == 404:
            return _error_response(NotFound(f"No route for {request.method} {request.path}."), rid)
        if code == 405:
            err: GatewayError = MethodNotAllowed(
                f"{request.method} is not allowed on {request.path}."
            )
            resp = _error_response(err, rid)
            if exc.valid_methods:  # type: ignore[attr-defined]
                resp.headers["Allow"] = ", ".join(exc.valid_methods)  # type: ignore[attr-defined]
            return resp
        if code == 413:
            return _error_response(_too_large(g.max_body_bytes), rid)
        if code == 408:
            return _error_response(
                InvalidRequest("The request body was not received in time."), rid
            )
        if code == 400:
            return _error_response(InvalidRequest("The request could not be read."), rid)
        return _error_response(InternalError("The gateway could not process this request."), rid)

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        rid = getattr(request, "sie_request_id", None)
        return _error_response(_as_error(exc, rid), rid)

    def _auth(kind: str = "api") -> None:
        if kind == "health" and not g.auth_health:
            return
        if kind == "metrics" and not g.auth_metrics:
            return
        _check_auth(state, request.headers.get("Authorization"))

    # POST on the generation routes is answered before Quart routes it (GatewayHTTPConnection);
    # the rules, with no view, are here so that any other method gets 405 with `Allow: POST`.
    for path, endpoint in _GENERATION.items():
        app.add_url_rule(path, endpoint, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        _auth()
        data = [_model_object(name) for name in state.profiles]
        return Response(_json.encode({"object": "list", "data": data}), content_type=_JSON_CT)

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        _auth()
        find_profile(state.profiles, model_id)  # 404 model_not_found for an unknown id
        return Response(_json.encode(_model_object(model_id)), content_type=_JSON_CT)

    @app.get("/healthz")
    async def healthz() -> Response:
        _auth("health")
        return Response(b'{"status":"ok"}', content_type=_JSON_CT)

    @app.get("/readyz")
    async def readyz() -> Response:
        _auth("health")
        status = {m: p.any_ready() for m, p in state.pools.items()}
        ok = all(status.values()) and not state.draining
        body = _json.encode({"ready": ok, "models": status, "draining": state.draining})
        resp = Response(body, status=200 if ok else 503, content_type=_JSON_CT)
        if not ok:
            resp.headers["Retry-After"] = str(g.retry_after)
        return resp

    @app.get("/metrics")
    async def metrics() -> Response:
        _auth("metrics")
        data, ctype = state.observer.render()
        return Response(data, content_type=ctype)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        from .openapi import openapi_document

        return Response(_json.encode(openapi_document()), content_type=_JSON_CT)

    return app
