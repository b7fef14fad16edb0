"""Failover before the first byte: where a request goes after its engine failed, and when.

``GenerationBody.prime`` hands every engine failure that came before any engine event reached
the response's shaper to :meth:`Failover.recover`. The decision is the retry table's
(``core.retry``: ``POLICY`` and ``decide``); this module carries it out, trying the moves in
the table's order and taking the first that works:

* ``other``: another ready replica of the model with room now (``ModelPool.acquire`` without a
  wait, the failed replica excluded);
* ``same``: the failed replica again, after the decision's pause (the engine's Retry-After, or
  the jittered backoff), if it is still available (ready, breaker closed) and the pause ends
  before the request's deadline; its admission slots are taken again;
* ``fallback`` / ``context``: the model's ``fallbacks`` / ``context_fallbacks``
  (``sieproxy.fallback``), the first target that can take the request at once.

The old attempt has ended (each of its candidates aborted once, as on any early end) before
the pause and the new attempt. A client that leaves during the pause cancels it like any other
wait. When no move is left, the error stands; if it is a 503 and an engine asked for a
Retry-After, the client's Retry-After is the longest one asked for (at least 1 s), not the
gateway's own ``retry_after``.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..core.errors import GatewayError, UpstreamError
from ..core.upstream.retry import Tried, decide
from ..fleet.pool import Replica
from ..settings.load import GatewaySettings

if TYPE_CHECKING:
    from ..observe.stats import RequestStats
    from .fallback import FallBack, Route

__all__ = ["Failover", "retry_bodies", "upstream_of"]

log = logging.getLogger("sieproxy.relay")

#: The fallback cause counted for each failure kind of the table (``sieproxy_fallbacks``).
_CAUSE = {"first_token": "first_token", "context": "context"}


class Moving(Protocol):
    """What the failover needs of its response body (``relay.GenerationBody``)."""

    stats: RequestStats

    @property
    def replica(self) -> Replica: ...

    @property
    def deadline(self) -> float: ...

    async def other_replica(self) -> Replica | None: ...

    async def restart_on(
        self, other: Replica, route: Route | None = None, pause: float = 0.0
    ) -> None: ...


def retry_bodies(bodies: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The engine bodies of the ``k``-th retry on the same engine: each rid
    ``<request_id>-<index>`` becomes ``<request_id>.r<k>-<index>`` (an abort of the failed
    attempt's rid can never reach the new one; the index stays last)."""
    out = []
    for b in bodies:
        rid = b.get("rid")
        if isinstance(rid, str):
            head, dash, index = rid.rpartition("-")
            b = {**b, "rid": f"{head}.r{k}{dash}{index}" if dash else f"{rid}.r{k}"}
        out.append(b)
    return out


def upstream_of(exc: GatewayError) -> UpstreamError | None:
    """The engine failure behind ``exc``: itself, or the refusal an explained 400 came from."""
    if isinstance(exc, UpstreamError):
        return exc
    cause = exc.__cause__
    return cause if isinstance(cause, UpstreamError) else None


class Failover:
    """One request's retries and fallbacks before its first byte (see the module docstring)."""

    __slots__ = ("_draw", "_g", "fallback", "tried")

    def __init__(
        self,
        g: GatewaySettings,
        fallback: FallBack | None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self._g = g
        self.fallback = fallback  # (also the resumes', sieproxy.relay.resume)
        self._draw = draw
        self.tried = Tried()

    async def recover(self, body: Moving, exc: GatewayError) -> str | None:
        """Move the request after ``exc`` (the move taken), or None: ``exc`` stands (its
        Retry-After set from the engines' when they asked for one)."""
        up = upstream_of(exc)
        if up is None:
            return None
        g = self._g
        d = decide(
            up,
            self.tried,
            now=trio.current_time(),
            deadline=body.deadline,
            draw=self._draw(),
            retry_after_max=g.retry_after_max,
            backoff_base=g.retry_backoff,
            backoff_cap=g.retry_backoff_max,
        )
        for move in d.moves:
            if move == "other":
                other = await body.other_replica()
                if other is None:
                    continue
                await self._take(body, move, d.kind, other)
                return move
            if move == "same":
                r = body.replica
                if r.retired or not r.available(trio.current_time()):
                    continue
                await self._take(body, move, d.kind, r, pause=d.pause)
                return move
            if self.fallback is None:
                continue
            cause = _CAUSE.get(d.kind, "failed") if move == "fallback" else "context"
            route = await self.fallback(cause, body.replica)
            if route is None:
                continue
            self.tried.took(move)
            log.info(
                "request %s: %s; moving to fallback %s",
                body.stats.request_id,
                d.kind,
                route.model,
            )
            await body.restart_on(route.replica, route)
            return move
        self._hint(exc)
        return None

    async def _take(
        self, body: Moving, move: str, kind: str, r: Replica, pause: float = 0.0
    ) -> None:
        self.tried.took(move)
        body.stats.retried = True
        log.info(
            "request %s: %s; retrying on %s replica %s%s",
            body.stats.request_id,
            kind,
            "the same" if move == "same" else "another",
            r.url,
            f" after {pause:.2f} s" if pause else "",
        )
        await body.restart_on(r, pause=pause)

    def _hint(self, exc: GatewayError) -> None:
        """The client's Retry-After on a final 503: the longest an engine asked for."""
        hint = self.tried.hint
        if hint is not None and exc.status == 503:
            exc.headers["Retry-After"] = str(max(1, math.ceil(hint)))
