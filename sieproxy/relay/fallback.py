"""Fallbacks: where a request goes when the model it names cannot serve it, before any byte.

A model's ``fallbacks`` (``[models.<name>]``, checked at load: ``Settings.fallback_chain``) are
``(model, pool)`` targets tried in order, each at most once per request, when

* the model has no ready replica for the request (cause ``no_replica``) or every matching one
  stayed full for ``admission_wait`` (``full``): at admission, before the status line;
* its engine failed in a way the retry table allows (``failed``; ``first_token``: nothing came
  within the model's ``first_token_timeout``) and the table's retries within the model were
  used or had no replica to go to: from ``GenerationBody.prime`` (``sieproxy.failover``).

A model's ``context_fallbacks`` are tried in the same way (cause ``context``) when the request
is too long for it: the gateway's own check at planning (:func:`context_plan`: the first
target the request fits) or the engine's ``context_length_exceeded`` before any event.

Never after the first byte: once an event of the engine reached the response's shaper, an
engine failure is the stream's error event. A target is taken only if it can take the request
at once (no second admission wait): its model plans the request (a model the request does not
fit, such as one without image input, is skipped), the request's routing headers still apply
(``X-SIE-Pool`` is replaced by the target's ``pool`` when it names one), and one of its ready
replicas has room. The request is then planned for the target's model, so the response's
``model`` names the model that served it; each move counts in
``sieproxy_fallbacks_total{model,cause}`` under the model the client asked for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from ..core.errors import GatewayError
from ..core.planning.prepared import Prepared, Shaper
from ..core.request.profile import ModelProfile
from ..fleet.pool import ModelPool, Replica, RouteHints
from ..observe.observer import Observer
from ..settings.schema import Settings, fallback_target

__all__ = ["FallBack", "Fallbacks", "Route", "cause_of", "context_plan", "context_targets"]


@dataclass(slots=True)
class Route:
    """Where a request runs after a fallback: the model and its pool, the replica holding the
    request's slots, the routing hints, and the engine bodies and response shaper planned for
    that model."""

    model: str
    pool: ModelPool
    replica: Replica
    hints: RouteHints
    bodies: list[dict[str, Any]]
    shaper: Shaper


#: The next fallback of a request that failed (cause, the failed replica), or None.
FallBack = Callable[[str, Replica], Awaitable[Route | None]]

#: Plans the request for a model: its surface's ``prepare`` with everything but ``model`` bound.
Planner = Callable[[str], Prepared]


def cause_of(err: GatewayError) -> str:
    """The fallback cause of an admission refusal (a 503 from ``ModelPool.acquire``)."""
    return "no_replica" if err.code == "model_loading" else "full"


class Fallbacks:
    """The fallback targets of one request, consumed in order (see the module docstring)."""

    __slots__ = ("_hints", "_observer", "_planner", "_pools", "_targets", "current", "model")

    def __init__(
        self,
        *,
        plan: Prepared,
        hints: RouteHints,
        targets: list[tuple[str, str | None]],
        planner: Planner,
        pools: Mapping[str, ModelPool],
        profiles: Mapping[str, ModelProfile],
        observer: Observer,
    ) -> None:
        self.model = plan.model  # the model the client asked for (the counter's label)
        #: The plan of the model serving the request now (its usage is the request's).
        self.current = plan
        self._hints = hints
        self._planner = planner
        self._pools = pools
        self._observer = observer
        own = (plan.model, hints.pool)
        self._targets = [
            t for t in targets if (t[0], t[1] or hints.pool) != own and t[0] in profiles
        ]

    async def next(self, cause: str, failed: Replica | None = None) -> Route | None:
        """Reserve a place on the next target that can take the request at once, or None
        when none is left. ``failed``: a replica the request just failed on (not chosen)."""
        while self._targets:
            model, pool_name = self._targets.pop(0)
            pool = self._pools[model]
            hints = RouteHints(
                pool=pool_name or self._hints.pool,
                machine_profile=self._hints.machine_profile,
                affinity_key=self._hints.affinity_key,
            )
            try:
                plan = self._planner(model)
                pool.check_hints(hints)
                exclude = failed if failed is not None and failed in pool.replicas else None
                replica = await pool.acquire(hints, len(plan.bodies), exclude=exclude, wait=False)
            except GatewayError:
                continue  # this target cannot take the request: the next one
            if cause != "resume":  # a resumed candidate keeps the response's shaper
                self.current = plan
            self._observer.fallback(self.model, cause)
            return Route(model, pool, replica, hints, plan.bodies, plan.shaper)
        return None


class _Named(msgspec.Struct):
    model: str = ""


def context_targets(settings: Settings, model: str) -> list[tuple[str, str | None]]:
    """The ``(model, pool)`` targets of ``model``'s ``context_fallbacks``, in order."""
    conf = settings.models.get(model)
    return [fallback_target(model, e) for e in conf.context_fallbacks] if conf else []


def context_plan(
    exc: GatewayError, raw: bytes, settings: Settings, planner: Planner, observer: Observer
) -> Prepared:
    """The plan on the first of the requested model's ``context_fallbacks`` whose context the
    request fits, after the gateway's own check refused it for that model (``exc``, a
    ``context_length_exceeded``); ``exc`` when none fits. The target's ``pool`` is not
    applied here (the request's own routing headers are)."""
    try:
        model = msgspec.json.decode(raw, type=_Named).model
    except msgspec.DecodeError:
        raise exc from None
    for target, _pool in context_targets(settings, model):
        try:
            plan = planner(target)
        except GatewayError as err:
            if err.code == "context_length_exceeded":
                continue
            raise
        observer.fallback(model, "context")
        return plan
    raise exc
