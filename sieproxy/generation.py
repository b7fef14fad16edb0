"""One generation request's HTTP handling, from the ASGI scope to the response's last byte.

``sieproxy.app.GatewayHTTPConnection`` hands ``POST`` on the generation routes to
:func:`serve_generation`: it reads the headers it needs and the body (``read_body``,
sieproxy/request_body.py), plans and admits the request (:func:`_start`) and sends the response
(:func:`_send_generation`), while a ``ClientWatch`` cancels it all if the client leaves. The
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
from collections.abc import Callable
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
from .core.messages_out import error_reply
from .core.pipeline import (
    Prepared,
    build_chat,
    build_completion,
    build_count_tokens,
    build_messages,
    build_responses,
)
from .fallback import Fallbacks, cause_of, context_plan, context_targets
from .hypercorn_io import (
    ClientWatch,
    body_writer,
    prepare_head,
    refusal,
    send_together,
)
from .pool import RouteHints
from .relay import GenerationBody
from .request_body import ClientGone, read_body
from .state import GatewayState
from .stats import RequestStats
from .tenancy.gate import requested_model, reservation
from .tenancy.keys import KeyEntry
from .tenancy.limiter import Lease

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
    err: GatewayError, request_id: str | None = None, endpoint: str | None = None
) -> Response:
    """``err`` in the error envelope of ``endpoint``'s API (Anthropic's on the Messages
    routes, OpenAI's everywhere else)."""
    if endpoint in _ANTHROPIC:
        status, headers, body = error_reply(err)
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
    state: GatewayState, endpoint: str, body_timeout: float, scope: Any, receive: Any, send: Any
) -> None:
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
                entry = check_auth(state, _credentials(endpoint, headers))
                g = state.settings.gateway
                if state.draining:
                    raise ServiceUnavailable(
                        "The gateway is shutting down; retry on another instance.",
                        retry_after=g.retry_after,
                    )
                raw = await read_body(headers, receive, g.max_body_bytes, body_timeout)
                watch.watch(client.leave)
                started = await _start(state, endpoint, rid, headers, raw, client, entry)
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
                await _send_whole(send, error_response(err, rid, endpoint), close=raw is None)
                return
            ctype = b"text/event-stream" if body.streaming else _JSON_CT_B
            out = [(b"content-type", ctype), (b"x-request-id", rid.encode("latin-1"))]
            if body.streaming:
                out += _SSE_HEADERS
            out += limit_headers
            await _send_generation(send, out, body, client)
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


#: The endpoints of Anthropic's API: its error envelope, and ``x-api-key`` as the credential.
_ANTHROPIC = frozenset({"messages", "count_tokens"})


def _credentials(endpoint: str, headers: dict[bytes, str]) -> str | None:
    """The ``Authorization`` value to check: on Anthropic's routes an ``x-api-key`` (which
    Anthropic clients send) is checked as its bearer token, and wins over ``Authorization``."""
    key = headers.get(b"x-api-key") if endpoint in _ANTHROPIC else None
    return f"Bearer {key}" if key is not None else headers.get(b"authorization")


def check_auth(state: GatewayState, raw: str | None) -> KeyEntry | None:
    """The key's entry (its tenant), None with auth off; 401 otherwise."""
    return state.auth.check(raw.encode("utf-8", "surrogateescape") if raw is not None else None)


def tenant_of(entry: KeyEntry | None) -> str | None:
    return entry.tenant.name if entry is not None else None


async def _start(
    state: GatewayState,
    endpoint: str,
    rid: str,
    headers: dict[bytes, str],
    raw: bytes,
    client: _Client,
    entry: KeyEntry | None,
) -> tuple[GenerationBody, list[tuple[bytes, bytes]]]:
    """Plan the request and admit it: the response body, not entered yet (every status
    decision before the body is primed is taken here), and the rate-limit headers."""
    tenancy = state.tenancy
    if entry is not None and entry.models is not None:  # before the body's own checks
        tenancy.check_model(entry, requested_model(raw))
    builder = {  # each endpoint's planner (sieproxy/core/pipeline.py), looked up per request
        "chat": build_chat,
        "completions": build_completion,
        "responses": build_responses,
        "messages": build_messages,
        "count_tokens": build_count_tokens,
    }[endpoint]
    created = state.created()

    def planner(m: str | None = None) -> Prepared:
        return builder(raw, state.profiles, request_id=rid, created=created, model=m)

    try:
        plan = planner()
    except GatewayError as exc:  # too long for the model: its context_fallbacks
        if exc.code != "context_length_exceeded":
            raise
        plan = context_plan(exc, raw, state.settings, planner, state.observer)
    pool = state.pools[plan.model]
    policy = pool.policy  # routing = "cache_aware" (sieproxy/cache_route.py)
    hints = RouteHints(
        pool=headers.get(b"x-sie-pool") or None,
        machine_profile=headers.get(b"x-sie-machine-profile") or None,
        affinity_key=plan.affinity_key,
        prefix_key=plan.prefix_key,
        route=None if policy is None else await policy.prepare(plan.bodies),
    )
    pool.check_hints(hints)
    prompt_estimate, cap, k = reservation(plan.bodies)
    lease = await tenancy.admit(
        entry, prompt_tokens=prompt_estimate, max_tokens=cap, candidates=k,
        param=plan.fields.max_tokens,
    )  # fmt: skip
    try:
        return await _admitted(
            state, endpoint, rid, headers, client, entry, plan, planner, hints, lease,
            prompt_estimate,
        )  # fmt: skip
    except BaseException:
        tenancy.settle(lease, 0)  # refused or gone before it ran: nothing used
        raise


async def _admitted(
    state: GatewayState,
    endpoint: str,
    rid: str,
    headers: dict[bytes, str],
    client: _Client,
    entry: KeyEntry | None,
    plan: Prepared,
    planner: Callable[[str | None], Prepared],
    hints: RouteHints,
    lease: Lease,
    prompt_estimate: int,
) -> tuple[GenerationBody, list[tuple[bytes, bytes]]]:
    """The rest of :func:`_start` once the tenant's limits admitted the request."""
    g = state.settings.gateway
    pool = state.pools[plan.model]
    stats = RequestStats(
        request_id=rid, model=plan.model, endpoint=endpoint, n=plan.n, stream=plan.stream
    )
    stats.tenant = tenant_of(entry)
    stats.sdk_version = headers.get(b"x-sie-sdk-version")
    fb: Fallbacks | None = None  # made when first needed (sieproxy/fallback.py)
    ctx: Fallbacks | None = None  # the same for context_fallbacks

    def fallbacks(cause: str = "failed") -> Fallbacks:
        nonlocal fb, ctx
        if cause == "context":
            if ctx is None:
                ctx = fb = Fallbacks(
                    plan=plan,
                    hints=hints,
                    targets=context_targets(state.settings, plan.model),
                    planner=planner,
                    pools=state.pools,
                    profiles=state.profiles,
                    observer=state.observer,
                )
            return ctx
        if fb is None or fb is ctx:
            fb = Fallbacks(
                plan=plan,
                hints=hints,
                targets=state.settings.fallback_chain(plan.model),
                planner=planner,
                pools=state.pools,
                profiles=state.profiles,
                observer=state.observer,
            )
        return fb

    conf = state.settings.models.get(plan.model)
    has_fallbacks = conf is not None and bool(conf.fallbacks or conf.context_fallbacks)
    queued_at = trio.current_time()
    try:
        if pool.failed is not None:  # the embedded engine was given up (sieproxy/child.py)
            raise ServiceUnavailable(
                f"The engine of model {plan.model!r} failed: {pool.failed}. The gateway's log "
                "has its error; fix the engine's settings and restart the gateway.",
                retry_after=g.retry_after,
                code="engine_failed",
            )
        replica = await pool.acquire(
            hints, len(plan.bodies), ticket=state.tenancy.ticket(entry, lease.reserved)
        )
    except ServiceUnavailable as exc:
        moved = await fallbacks().next(cause_of(exc)) if has_fallbacks else None
        if moved is None:
            raise
        pool, hints, replica, stats.model = moved.pool, moved.hints, moved.replica, moved.model
        plan = fallbacks().current
    stats.replica = replica.url
    stats.admission_wait = trio.current_time() - queued_at
    route = hints.route  # routing = "cache_aware" (None after a fallback to another pool)
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
        prompt = b.stats.prompt_tokens
        if not prompt and b.stats.first_token_at is not None:
            prompt = prompt_estimate  # the engine ran it but did not say (cut before usage)
        state.tenancy.settle(lease, prompt + b.stats.completion_tokens)
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
        fallback=(
            (lambda cause, failed: fallbacks(cause).next(cause, failed)) if has_fallbacks else None
        ),
        fields=plan.fields,
    )
    state.active.add(body)
    limits = lease.anthropic_headers() if endpoint in _ANTHROPIC else lease.headers()
    return body, [(k.encode(), v.encode()) for k, v in limits.items()]


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
            resp = error_response(err, body.stats.request_id, body.stats.endpoint)
            await _send_whole(send, resp)
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
