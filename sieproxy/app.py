"""The Quart-Trio application: routes, status decisions, error envelopes.

Every status decision for a generation request happens before its status line is sent: the view
checks auth (401), body size (413), decodes and validates (400), finds the model (404), checks
routing headers (400) and readiness/admission (503); then :class:`GatewayHTTPConnection` enters
the response body and *primes* it (first upstream event, or the whole answer when not streaming)
before sending ``http.response.start``, so an engine that fails before producing anything still
yields a proper status (503 + Retry-After, 500 "malformed", ...), never a 200 with an error.

Quart's ``RESPONSE_TIMEOUT`` (60 s by default) would silently cut a long stream; it is disabled,
and the gateway's own deadlines end streams with an SSE error event instead.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import trio
from quart import Quart, Request, Response, request
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
from .core.pipeline import build_chat, build_completion
from .core.profile import ModelProfile
from .engine_client import EngineClient
from .hypercorn_io import body_writer
from .observe import Observer
from .pool import ModelPool, RouteHints
from .relay import GenerationBody, RequestStats, WaitTimer
from .settings import Settings

__all__ = ["GatewayState", "create_app"]

log = logging.getLogger("sieproxy.app")

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_json = msgspec.json.Encoder()
_JSON_CT = "application/json"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
    created: Callable[[], int] = lambda: int(time.time())


def _error_response(err: GatewayError, request_id: str | None = None) -> Response:
    resp = Response(_json.encode(err.envelope()), status=err.status, content_type=_JSON_CT)
    for k, v in err.headers.items():
        resp.headers[k] = v
    if request_id:
        resp.headers["X-Request-Id"] = request_id
    return resp


class GatewayHTTPConnection(TrioASGIHTTPConnection):
    """Sends generation bodies only after priming them (see the module docstring)."""

    async def handle_request(  # type: ignore[override]
        self, nursery: Any, request: Any, send: Any
    ) -> None:
        try:
            await super().handle_request(nursery, request, send)
        finally:
            # A client gone between the view and the body leaves a body never entered:
            # give back its admission slots (entered bodies release in __aexit__).
            body = getattr(request, "sie_body", None)
            if isinstance(body, GenerationBody) and not body.entered:
                body.discard()
                body.active.discard(body)

    async def _send_response(self, send: Any, response: Any) -> None:
        body = getattr(response, "response", None)
        if not isinstance(body, GenerationBody):
            await super()._send_response(send, response)
            return
        try:
            await self._send_generation(send, response, body)
        finally:
            body.active.discard(body)  # only once its last byte is out (graceful drain)

    async def _send_generation(self, send: Any, response: Any, body: GenerationBody) -> None:
        async with body:
            try:
                head = await body.prime()
            except GatewayError as err:
                body.stats.error = err
                await _send_whole(send, _error_response(err, body.stats.request_id))
                return
            except Exception:
                log.exception("request %s failed before the response", body.stats.request_id)
                internal = InternalError("The gateway failed to process this request.")
                body.stats.error = internal
                await _send_whole(send, _error_response(internal, body.stats.request_id))
                return
            headers = [
                (k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in response.headers.items()
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            write = body_writer(send)
            data: bytes | None = head
            while data is not None:
                if data:
                    body.writing_since = trio.current_time()
                    await write(data)
                    body.writing_since = None
                try:
                    data = await body.__anext__()
                except StopAsyncIteration:
                    data = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_whole(send: Any, resp: Response) -> None:
    data = await resp.get_data()
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()]
    await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class GatewayApp(QuartTrio):
    asgi_http_class = GatewayHTTPConnection


def _request_id(req: Request) -> str:
    given = req.headers.get("X-Request-Id")
    if given and _REQUEST_ID_RE.match(given):
        return given
    return uuid.uuid4().hex


async def _read_body(req: Request, g_max: int, timeout: float) -> bytes:
    if req.content_length is not None and req.content_length > g_max:
        raise BodyTooLarge(f"The request body is larger than the {g_max}-byte limit.")
    ctype = req.headers.get("Content-Type")
    if ctype is not None and ctype.split(";")[0].strip().lower() != _JSON_CT:
        raise InvalidRequest(
            "The request body must be JSON: send `Content-Type: application/json`."
        )
    with trio.move_on_after(timeout) as scope:
        data = await req.get_data(as_text=False, cache=False)
    if scope.cancelled_caught:
        raise InvalidRequest("The request body was not received in time.")
    if len(data) > g_max:
        raise BodyTooLarge(f"The request body is larger than the {g_max}-byte limit.")
    return cast(bytes, data)


def _body_consumed(req: Request) -> bool:
    body = req.body
    complete = getattr(body, "_complete", None)
    return complete is None or bool(complete.is_set() and not getattr(body, "_data", b""))


def create_app(state: GatewayState) -> Quart:
    """Build the Quart-Trio app around a ready :class:`GatewayState`."""
    app = GatewayApp("sieproxy")
    g = state.settings.gateway
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    app.config["MAX_CONTENT_LENGTH"] = g.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    app.extensions["sieproxy"] = state

    @app.before_request
    async def _mint_request_id() -> None:
        request.sie_request_id = _request_id(request)  # type: ignore[attr-defined]

    @app.after_request
    async def _echo_request_id(resp: Response) -> Response:
        rid = getattr(request, "sie_request_id", None)
        if rid and "X-Request-Id" not in resp.headers:
            resp.headers["X-Request-Id"] = rid
        if resp.status_code >= 400 and not _body_consumed(request):
            # Refused before the upload was read (401, 413, bad content type): the unread body
            # would wedge a kept-alive connection, so this answer closes it.
            resp.headers["Connection"] = "close"
        return resp

    _ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

    @app.errorhandler(GatewayError)
    async def _gateway_error(err: GatewayError) -> Response:
        endpoint = _ENDPOINTS.get(request.path)
        if endpoint is not None:  # refusals count too; the model label is never user text
            state.observer.refusal(
                endpoint,
                err,
                request_id=getattr(request, "sie_request_id", None),
                sdk_version=request.headers.get("X-SIE-SDK-Version"),
            )
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
            return _error_response(
                BodyTooLarge(f"The request body is larger than the {g.max_body_bytes}-byte limit."),
                rid,
            )
        if code == 408:
            return _error_response(
                InvalidRequest("The request body was not received in time."), rid
            )
        if code == 400:
            return _error_response(InvalidRequest("The request could not be read."), rid)
        return _error_response(InternalError("The gateway could not process this request."), rid)

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error")
        return _error_response(
            InternalError("The gateway failed to process this request."),
            getattr(request, "sie_request_id", None),
        )

    def _auth(kind: str = "api") -> None:
        if kind == "health" and not g.auth_health:
            return
        if kind == "metrics" and not g.auth_metrics:
            return
        raw = request.headers.get("Authorization")
        state.auth.check(raw.encode("utf-8", "surrogateescape") if raw is not None else None)

    async def _generate(endpoint: str) -> Response:
        rid: str = request.sie_request_id  # type: ignore[attr-defined]
        _auth()
        if state.draining:
            raise ServiceUnavailable(
                "The gateway is shutting down; retry on another instance.",
                retry_after=g.retry_after,
            )
        raw = await _read_body(request, g.max_body_bytes, float(app.config["BODY_TIMEOUT"]))
        builder = build_chat if endpoint == "chat" else build_completion
        plan = builder(raw, state.profiles, request_id=rid, created=state.created())
        pool = state.pools[plan.model]
        hints = RouteHints(
            pool=request.headers.get("X-SIE-Pool") or None,
            machine_profile=request.headers.get("X-SIE-MACHINE-PROFILE") or None,
            affinity_key=plan.affinity_key,
        )
        pool.check_hints(hints)
        stats = RequestStats(
            request_id=rid, model=plan.model, endpoint=endpoint, n=plan.n, stream=plan.stream
        )
        stats.sdk_version = request.headers.get("X-SIE-SDK-Version")
        replica = await pool.acquire(hints, len(plan.bodies))
        stats.replica = replica.url
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
            losers=plan.losers,
            on_done=lambda b: _finish(b, plan.usage),
            timer=state.timer,
        )
        state.active.add(body)
        body.active = state.active
        request.sie_body = body  # type: ignore[attr-defined]
        ctype = "text/event-stream" if plan.stream else _JSON_CT
        resp = Response(body, status=200, content_type=ctype)
        resp.timeout = None
        resp.headers["X-Request-Id"] = rid
        if plan.stream:
            for k, v in _SSE_HEADERS.items():
                resp.headers[k] = v
        return resp

    def _finish(body: GenerationBody, usage: Callable[[], tuple[int, int]]) -> None:
        body.stats.prompt_tokens, body.stats.completion_tokens = usage()
        state.observer.request_done(body.stats)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await _generate("chat")

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _generate("completions")

    @app.get("/v1/models")
    async def models() -> Response:
        _auth()
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "sieproxy"}
            for name in state.profiles
        ]
        return Response(_json.encode({"object": "list", "data": data}), content_type=_JSON_CT)

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
