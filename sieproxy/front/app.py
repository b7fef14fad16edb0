"""The Quart-Trio application: the app factory, its small routes, and where a request goes.

The generation routes (``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``) are
answered by :class:`GatewayHTTPConnection` straight from the ASGI scope, before Quart builds a
request object or routes it (``serve_generation`` in sieproxy/front/intake.py): Quart's
per-request machinery (its ``Request`` with every header re-cased, the request and app contexts,
URL matching, the hooks, the body handed over by a second task, the ``Response``) cost about a
third of the gateway's own time to first token at one client (docs/DESIGN.md). Every other
request — other paths, other methods on these paths (405 with ``Allow: POST``), health, metrics,
models — goes through Quart as usual.

Quart's ``RESPONSE_TIMEOUT`` (60 s by default) would silently cut a long stream; it is disabled,
and the gateway's own deadlines end streams with an SSE error event instead.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

import msgspec
from quart import Quart, Response, request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import HTTPException

from ..core.errors import (
    GatewayError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
)
from ..core.planning.prepared import find_profile
from ..settings.keys import KeyEntry
from ..surfaces import SURFACES, Surface
from .hypercorn_io import body_consumed
from .intake import (
    as_error,
    check_auth,
    error_response,
    request_id_for,
    serve_generation,
)
from .request_body import too_large
from .state import GatewayState

__all__ = ["GatewayApp", "GatewayHTTPConnection", "GatewayState", "create_app"]

_json = msgspec.json.Encoder()
_JSON_CT = "application/json"


class GatewayHTTPConnection(TrioASGIHTTPConnection):
    """Answers ``POST`` on the generation routes itself (see the module docstring); hands every
    other request to Quart."""

    async def __call__(self, receive: Any, send: Any) -> None:
        scope = self.scope
        surfaces: dict[str, Surface] = self.app.extensions["sieproxy.surfaces"]
        surface = surfaces.get(_route_path(scope)) if scope["method"] == "POST" else None
        if surface is None:
            await super().__call__(receive, send)
            return
        state: GatewayState = self.app.extensions["sieproxy"]
        body_timeout = float(self.app.config["BODY_TIMEOUT"])
        await serve_generation(state, surface, body_timeout, scope, receive, send)


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


class GatewayApp(QuartTrio):
    asgi_http_class = GatewayHTTPConnection


def _model_object(name: str) -> dict[str, Any]:
    """OpenAI's model object (``GET /v1/models`` lists them, ``/v1/models/{id}`` returns one)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "sieproxy"}


def create_app(state: GatewayState, surfaces: tuple[Surface, ...] = SURFACES) -> Quart:
    """Build the Quart-Trio app around a ready :class:`GatewayState`, serving ``surfaces``
    (``POST`` on each one's path; sieproxy/surfaces/)."""
    app = GatewayApp("sieproxy")
    surfaces_at = app.extensions["sieproxy.surfaces"] = {s.path: s for s in surfaces}
    g = state.settings.gateway
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60  # seconds for a request body to arrive, on every route
    app.config["MAX_CONTENT_LENGTH"] = g.max_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    app.extensions["sieproxy"] = state

    @app.before_request
    async def _mint_request_id() -> None:
        rid = request_id_for(request.headers.get("X-Request-Id"))
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
        return error_response(err, getattr(request, "sie_request_id", None))

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        rid = getattr(request, "sie_request_id", None)
        code = exc.code or 500
        if code == 404:
            return error_response(NotFound(f"No route for {request.method} {request.path}."), rid)
        if code == 405:
            err: GatewayError = MethodNotAllowed(
                f"{request.method} is not allowed on {request.path}."
            )
            resp = error_response(err, rid, surfaces_at.get(request.path))
            if exc.valid_methods:  # type: ignore[attr-defined]
                resp.headers["Allow"] = ", ".join(exc.valid_methods)  # type: ignore[attr-defined]
            return resp
        if code == 413:
            return error_response(too_large(g.max_body_bytes), rid)
        if code == 408:
            return error_response(InvalidRequest("The request body was not received in time."), rid)
        if code == 400:
            return error_response(InvalidRequest("The request could not be read."), rid)
        return error_response(InternalError("The gateway could not process this request."), rid)

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        rid = getattr(request, "sie_request_id", None)
        return error_response(as_error(exc, rid), rid)

    def _auth(kind: str = "api") -> KeyEntry | None:
        if kind == "health" and not g.auth_health:
            return None
        if kind == "metrics" and not g.auth_metrics:
            return None
        return check_auth(state, request.headers.get("Authorization"))

    # POST on the generation routes is answered before Quart routes it (GatewayHTTPConnection);
    # the rules, with no view, are here so that any other method gets 405 with `Allow: POST`.
    for surface in surfaces:
        app.add_url_rule(surface.path, surface.name, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        entry = _auth()  # a key lists only the models it may use
        data = [_model_object(m) for m in state.profiles if entry is None or entry.may_use(m)]
        return Response(_json.encode({"object": "list", "data": data}), content_type=_JSON_CT)

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        state.tenancy.check_model(_auth(), model_id)  # the same 404 as for an unknown id
        find_profile(state.profiles, model_id)  # 404 model_not_found for an unknown id
        return Response(_json.encode(_model_object(model_id)), content_type=_JSON_CT)

    @app.get("/healthz")
    @app.get("/health")  # the alias benchmark tools (guidellm, vllm bench) probe
    async def healthz() -> Response:
        _auth("health")
        return Response(b'{"status":"ok"}', content_type=_JSON_CT)

    @app.get("/readyz")
    async def readyz() -> Response:
        _auth("health")
        status = {m: p.any_ready() for m, p in state.pools.items()}
        ok = all(status.values()) and not state.draining
        out: dict[str, object] = {"ready": ok, "models": status, "draining": state.draining}
        failed = {m: p.failed for m, p in state.pools.items() if p.failed is not None}
        if failed:  # models whose engine was given up, and why
            out["failed"] = failed
        body = _json.encode(out)
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
