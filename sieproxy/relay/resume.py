"""Resuming a broken stream: one request's resumes, carried out.

A candidate whose engine stream breaks after it produced output (``core.resume.break_cause``:
a cut, an engine error event, a stall past ``token_gap_timeout``, a malformed event that could
not be skipped) ends on its replica as any early end does (aborted once, its connection
closed). Then, instead of the stream's error, its driver — the candidate task of ``n`` > 1
(``Attempt.run``) or the inline reader of ``n`` = 1 (``InlineReader.finish_with``) — asks
:meth:`Resumer.resume` for a continuation, at most the model's ``max_resumes`` times per
candidate (``0``: never). The resumer

* takes the first place that can take the candidate at once, in the retry table's order for a
  server failure (``core.retry``): another ready replica of the candidate's model with room, else
  the same replica after the jittered backoff (if it is still available: ready, breaker closed,
  and the pause ends before the request's deadline), else the model's next ``fallbacks`` entry
  (``sieproxy.fallback``, cause ``resume``), re-planned for that model;
* builds the continuation (``core.resume.continuation``: the prompt plus the output so far, the
  budget reduced, a fresh rid) and a one-candidate :class:`~sieproxy.attempt.Attempt` on that
  place, whose reader continues the old one's events (``core.resume.ResumedReader``);
* counts it (``RequestStats.resumes`` by cause: ``sieproxy_resumes_total`` and the access log).

The candidate keeps its index, its choice state in the shaper (stop strings, parsers, the text
it showed), the response's ids and ``model``: the client sees one stream. The new attempt holds
one admission slot on its replica, given back when the request ends (as the request's own
slots are). When no place can take it, or the candidate cannot be continued, the break's error
stands: the stream's error event then ``[DONE]`` (non-streaming: the error status). A
continuation the engine refuses (a 4xx: an engine without assistant prefill) is such an error
too, and is not resumed again. The client leaving cancels the resume like any other wait.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from ..core.errors import GatewayError
from ..core.shaping.events import CandidateFinish
from ..core.upstream.resume import NotResumable, Progress, ResumedReader, break_cause, continuation
from ..core.upstream.retry import backoff
from ..core.upstream.status import breaker_counts
from ..fleet.pool import ModelPool, Replica, RouteHints

if TYPE_CHECKING:
    from ..settings.load import GatewaySettings
    from .attempt import Attempt
    from .candidate import Candidate
    from .fallback import FallBack

__all__ = ["Outcome", "Resumer"]

log = logging.getLogger("sieproxy.relay")


@dataclass(slots=True)
class Outcome:
    """A resume's result: the attempt the candidate continues on, or (``att`` None) what the
    shaper must see instead (the break's error, or a ``length`` finish)."""

    att: Attempt | None
    last: CandidateFinish | GatewayError | None = None


@dataclass(slots=True)
class _Place:
    pool: ModelPool
    replica: Replica
    body: dict[str, Any] | None = None  # a fallback's planned body for the candidate


class Resumer:
    """One request's resumes (see the module docstring)."""

    __slots__ = (
        "_draw", "_fallback", "_g", "_held", "bases", "hints", "max", "models", "pools", "used",
    )  # fmt: skip

    def __init__(
        self,
        g: GatewaySettings,
        pool: ModelPool,
        hints: RouteHints,
        bodies: list[dict[str, Any]],
        fallback: FallBack | None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self._g = g
        self._fallback = fallback
        self._draw = draw
        self.max = pool.max_resumes  # per candidate (the model's ``max_resumes``)
        k = len(bodies)
        #: Per candidate: its resumes so far, its model's pool and routing hints, and the
        #: planned body a continuation starts from (the model's; after a fallback, its).
        self.used = [0] * k
        plain = RouteHints(hints.pool, hints.machine_profile, hints.affinity_key)
        self.pools = [pool] * k
        self.hints = [plain] * k
        self.bases = list(bodies)
        self.models: list[str | None] = [None] * k  # after a fallback: its model
        self._held: list[tuple[ModelPool, Replica]] = []

    def release(self) -> None:
        """Give back the slots the resumed attempts took (at the request's end)."""
        held, self._held = self._held, []
        for pool, replica in held:
            pool.release(replica, 1)

    async def resume(self, c: Candidate, att: Attempt, err: GatewayError) -> Outcome | None:
        """Continue candidate ``c``, broken on ``att`` by ``err`` (its connection is closed and
        it was aborted); None: not resumed (the caller settles ``err`` as before)."""
        i = c.index
        cause = break_cause(err, c.cause)
        if cause is None:
            return None
        done: Progress = c.reader.progress()
        if cause == "cut" and done.finish is not None:  # finished; only its usage was lost
            att.settle(c, err, record=False)
            return Outcome(None, done.finish)
        if self.used[i] >= self.max or not done.any:
            return None  # nothing was shown: nothing to continue
        k = self.used[i] + 1
        try:
            body = continuation(self.bases[i], done, k)
        except NotResumable as exc:
            log.info("request %s: candidate %d not resumed: %s", att.stats.request_id, i, exc)
            return None
        if body is None:  # its budget was used up: the engine would have ended with length
            att.settle(c, err)
            return Outcome(None, c.reader.local_finish("length"))
        self.used[i] = k
        status = getattr(err, "engine_status", None)
        if breaker_counts(status, err.status):  # the broken replica's breaker counts it first
            att.pool.record_failure(att.replica)
        ended, c.cause = c.cause, None  # from here an end from outside cancels the resume
        c.scope = trio.CancelScope(deadline=att.deadline)
        with c.scope:
            place = await self._place(att, i, k)
        if place is not None and c.cause is not None:  # ended meanwhile (the client left)
            place.pool.release(place.replica, 1)
            place = None
        if place is not None and place.body is not None:  # a fallback: its own planned body
            try:
                body = continuation(place.body, done, k)
            except NotResumable:
                body = None
            if body is None:
                place.pool.release(place.replica, 1)
                place = None
        if place is None or body is None:
            c.cause = c.cause or ended
            return Outcome(None, att.settle(c, err, record=False))
        self._held.append((place.pool, place.replica))
        att.settle(c, err, record=False)
        stats = att.stats
        stats.resumes[cause] = stats.resumes.get(cause, 0) + 1
        log.info(
            "request %s: candidate %d broke (%s) after %d tokens; resuming on %s",
            stats.request_id, i, cause, done.tokens, place.replica.url,
        )  # fmt: skip
        return Outcome(self._attempt(att, place, body, i, done))

    def _attempt(
        self, att: Attempt, place: _Place, body: dict[str, Any], i: int, done: Progress
    ) -> Attempt:
        from .attempt import Attempt  # (attempt imports this module)

        bodies = list(att.bodies)
        bodies[i] = body
        new = Attempt(
            g=att.g,
            client=att.client,
            pool=place.pool,
            replica=place.replica,
            bodies=bodies,
            stats=att.stats,
            deadline=att.deadline,
        )
        new.resumer = self
        new.model = self.models[i]
        new.cands = att.cands  # the request's candidates (the merger's decisions reach them)
        new.unsent = [None] * len(bodies)
        c = att.cands[i]
        c.restart(ResumedReader(new.reader(i), done))
        c.scope = trio.CancelScope(deadline=att.deadline)  # (a candidate task's: ``run``)
        return new

    async def _place(self, att: Attempt, i: int, k: int) -> _Place | None:
        """Where candidate ``i`` continues (the module docstring), its slot taken; None when
        nowhere can take it now."""
        pool = self.pools[i]
        try:
            other = await pool.acquire(self.hints[i], 1, exclude=att.replica, wait=False)
        except GatewayError:
            pass
        else:
            return _Place(pool, other)
        r = att.replica
        now = trio.current_time()
        if r in pool.replicas and not r.retired and r.available(now):
            g = self._g
            pause = backoff(k - 1, self._draw(), base=g.retry_backoff, cap=g.retry_backoff_max)
            if now + pause < att.deadline:
                await trio.sleep(pause)
                if r.available(trio.current_time()) and not r.retired:
                    r.inflight += 1
                    r.total += 1
                    return _Place(pool, r)
        if self._fallback is None:
            return None
        route = await self._fallback("resume", att.replica)
        if route is None:
            return None
        extra = len(route.bodies) - 1
        if extra:
            route.pool.release(route.replica, extra)  # one candidate continues there
        self.pools[i], self.hints[i] = route.pool, route.hints
        self.bases[i] = route.bodies[i]
        self.models[i] = route.model
        return _Place(route.pool, route.replica, route.bodies[i])
