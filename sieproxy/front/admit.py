"""Planning and admission of one generation request: the step between its body and its
response (``sieproxy/front/intake.py`` calls :func:`start`).

The request's surface plans it (``Surface.prepare``: engine bodies and a shaper), a prompt too
long for the model moves to its ``context_fallbacks``, the routing hints are made (and, with
``routing = "cache_aware"``, the prompt's cached prefix looked up), the tenant's limits admit it
(``sieproxy/tenancy/``), a replica is reserved (or a fallback model takes it) and the response
body is built, not entered yet. Every status decision before the body is primed is taken here.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ..core.errors import GatewayError, ServiceUnavailable
from ..core.planning.prepared import Prepared
from ..fleet.pool import RouteHints
from ..observe.stats import RequestStats
from ..relay.body import GenerationBody
from ..relay.fallback import Fallbacks, cause_of, context_plan, context_targets
from ..settings.keys import KeyEntry
from ..surfaces import Surface
from ..tenancy.gate import requested_model, reservation
from ..tenancy.limiter import Lease
from .state import GatewayState

__all__ = ["start", "tenant_of"]

#: The surfaces of Anthropic's API: the rate-limit headers Anthropic's clients read.
_ANTHROPIC = frozenset({"messages", "count_tokens"})


def tenant_of(entry: KeyEntry | None) -> str | None:
    """The tenant's name for metrics and logs (None with auth off)."""
    return entry.tenant.name if entry is not None else None


async def start(
    state: GatewayState,
    surface: Surface,
    rid: str,
    headers: dict[bytes, str],
    raw: bytes,
    outcome: Callable[[], str],
    entry: KeyEntry | None,
) -> tuple[GenerationBody, list[tuple[bytes, bytes]]]:
    """Plan the request and admit it: the response body, not entered yet (every status
    decision before the body is primed is taken here), and the rate-limit headers."""
    tenancy = state.tenancy
    if entry is not None and entry.models is not None:  # before the body's own checks
        tenancy.check_model(entry, requested_model(raw))
    created = state.created()

    def planner(m: str | None = None) -> Prepared:  # the surface plans it (sieproxy/surfaces/)
        return surface.prepare(raw, state.profiles, request_id=rid, created=created, model=m)

    try:
        plan = planner()
    except GatewayError as exc:  # too long for the model: its context_fallbacks
        if exc.code != "context_length_exceeded":
            raise
        plan = context_plan(exc, raw, state.settings, planner, state.observer)
    pool = state.pools[plan.model]
    policy = pool.policy  # routing = "cache_aware" (sieproxy/fleet/cache_route.py)
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
            state, surface.name, rid, headers, outcome, entry, plan, planner, hints, lease,
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
    outcome: Callable[[], str],
    entry: KeyEntry | None,
    plan: Prepared,
    planner: Callable[[str | None], Prepared],
    hints: RouteHints,
    lease: Lease,
    prompt_estimate: int,
) -> tuple[GenerationBody, list[tuple[bytes, bytes]]]:
    """The rest of :func:`start` once the tenant's limits admitted the request."""
    g = state.settings.gateway
    pool = state.pools[plan.model]
    stats = RequestStats(
        request_id=rid, model=plan.model, endpoint=endpoint, n=plan.n, stream=plan.stream
    )
    stats.tenant = tenant_of(entry)
    stats.sdk_version = headers.get(b"x-sie-sdk-version")
    fb: Fallbacks | None = None  # made when first needed (sieproxy/relay/fallback.py)
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
        if pool.failed is not None:  # the embedded engine was given up (operations/child.py)
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
        b.stats.outcome = outcome()
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
