"""The per-request body: one nursery, one task per candidate, one merger (``n`` = 1: inline).

A :class:`GenerationBody` is the response body of a generation request, and the request only:
its nursery and channel, the merge loop, the retry before the first byte, and the end. Its
candidates are an :class:`~sieproxy.relay.attempt.Attempt` on one replica (each candidate's state
table and the token step every driver uses: ``sieproxy.candidate``). The HTTP layer
(``sieproxy.generation``) enters the body, may call :meth:`~GenerationBody.open` (the engine
requests go out at once, so writing the response head overlaps the engine's work), then calls
:meth:`~GenerationBody.prime`, which waits for the first upstream event. If the engine failed
before producing anything, ``prime`` raises the error for the status line (503 + Retry-After,
400, 500, ...) once the retry table has no move left (``core.retry``, carried out by
``sieproxy.failover``: the same replica, another one, the model's fallbacks). Otherwise the
status is 200 and the body streams (non-streaming: the whole answer is collected first).

``n`` > 1 (or best_of): one task per candidate streams into a *bounded* channel
(``sieproxy.relay.fanout``: backpressure end to end); the merger runs in the response task
(``__anext__``), one merged write per read. ``n`` = 1: no nursery, task or channel; the response
task reads its candidate itself (``sieproxy.inline``), and the relay pump may relay its tokens
while the task waits (``sieproxy.pump``).

The shaper's decisions come back as values (``Shaper.ends``), and the merger ends those
candidates (``sieproxy.merge``). A stalled client write (``sieproxy.timers``), the gateway's
shutdown, the client leaving and the end of the response end the rest. Every candidate that
ends without a terminal event from its engine is aborted exactly once (``sieproxy.attempt``);
``__aexit__`` cancels what is still running and waits for the nursery, so nothing outlives the
request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from ..core.errors import GatewayError, InternalError
from ..core.planning.prepared import Shaper
from ..core.request.refusal import RequestFields
from ..fleet.client import EngineClient
from ..fleet.pool import ModelPool, Replica, RouteHints
from ..observe.stats import RequestStats
from ..settings.load import GatewaySettings
from .attempt import Attempt
from .candidate import Event
from .failover import Failover, retry_bodies
from .fanout import Fanout
from .inline import QUIET, InlineReader
from .merge import Merger
from .pump import Outlet, Pump
from .resume import Resumer
from .timers import WaitTimer, sweep_stalls

if TYPE_CHECKING:
    from .fallback import FallBack, Route

__all__ = ["GenerationBody", "RequestStats", "Shaper", "WaitTimer", "sweep_stalls"]

log = logging.getLogger("sieproxy.relay")

_T = TypeVar("_T")


class GenerationBody:
    """The response body of one generation request (see the module docstring)."""

    __slots__ = (
        "_client",
        "_deadline",
        "_done",
        "_fan",
        "_fo",
        "_g",
        "_held",
        "_hints",
        "_il",
        "_k",
        "_m",
        "_now",
        "_on_done",
        "_ping",
        "_pump",
        "_timer",
        "_up",
        "entered",
        "stats",
        "streaming",
        "writing_since",
    )

    def __init__(
        self,
        *,
        g: GatewaySettings,
        client: EngineClient,
        pool: ModelPool,
        replica: Replica,
        hints: RouteHints,
        bodies: list[dict[str, Any]],
        shaper: Shaper,
        streaming: bool,
        stats: RequestStats,
        on_done: Callable[[GenerationBody], None] | None = None,
        timer: WaitTimer | None = None,
        pump: Pump | None = None,
        fallback: FallBack | None = None,
        fields: RequestFields | None = None,
    ) -> None:
        self._g = g
        self._fo = Failover(g, fallback)
        self._client = client
        self._hints = hints
        self.streaming = streaming
        self.stats = stats
        self._on_done = on_done
        self._timer = timer
        self._pump = pump
        self._k = len(bodies)
        # n > 1: the candidates' tasks and their channel (n = 1: the inline reader, ``_il``).
        self._fan = None if self._k == 1 else Fanout(g.channel_size)
        self._done = False
        self._held = self._k  # admission slots held on the replica
        self.writing_since: float | None = None  # while a client write waits (``client_write``)
        self._deadline = math.inf
        self.entered = False
        #: Trio's time, read from the run's clock (``trio.current_time`` is two calls more, and
        #: the relay reads the time once per token).
        self._now: Callable[[], float] = trio.current_time
        self._il: InlineReader | None = None
        # Keep-alives while the stream waits (the Messages API's ``ping``: relay/inline.py).
        self._ping = g.messages_ping_interval if getattr(shaper, "pings", False) else 0.0
        self._up = self._attempt(pool, replica, bodies)
        self._m = Merger(shaper, self._up, stats, fields or RequestFields())

    def _attempt(self, pool: ModelPool, replica: Replica, bodies: list[dict[str, Any]]) -> Attempt:
        """The request's candidates on ``replica`` (``n`` = 1: the inline reader)."""
        up = Attempt(
            g=self._g,
            client=self._client,
            pool=pool,
            replica=replica,
            bodies=bodies,
            stats=self.stats,
            deadline=self._deadline,
        )
        if pool.max_resumes:  # a broken stream continues elsewhere (sieproxy/relay/resume.py)
            up.resumer = Resumer(self._g, pool, self._hints, bodies, self._fo.fallback)
        if self._k == 1:  # n = 1 (no best_of): the response task reads it itself
            self._il = InlineReader(
                up, self, clock=self._now, timer=self._timer, pump=self._pump, ping=self._ping
            )
            up.reset([self._il])
        return up

    @property
    def replica(self) -> Replica:
        """The replica the request runs on (a retry switches after every candidate ended)."""
        return self._up.replica

    # ------------------------------------------------------------------ lifecycle
    def discard(self) -> None:
        """The body will never be entered (the client left first): release what it holds."""
        self._release()
        if self._on_done is not None:
            self._on_done(self)
            self._on_done = None

    async def __aenter__(self) -> GenerationBody:
        self.entered = True
        self._now = trio.lowlevel.current_clock().current_time
        self.stats.started = self._now()
        self._deadline = self._up.deadline = self.stats.started + self._g.request_deadline
        il = self._il
        if il is not None:
            il.deadline, il.clock = self._deadline, self._now
            return self
        assert self._fan is not None
        await self._fan.enter()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool | None:
        self._up.end_all("client" if exc_type is not None else "done")
        try:
            if self._il is not None:
                await self._il.close()
                return None
            assert self._fan is not None
            return await self._fan.exit(exc_type, exc, tb)
        finally:
            self._release()
            if self._on_done is not None:
                self._on_done(self)

    def _release(self) -> None:
        if self._up.resumer is not None:
            self._up.resumer.release()
        if self._held:
            self._up.pool.release(self._up.replica, self._held)
            self._held = 0

    async def open(self) -> bool:
        """Send the engine requests now, so that what the caller does before ``prime()`` (the
        response head's bytes) overlaps the engine's work; True if every request went out.
        A failure to send is handled when ``prime()`` reads (a retry on another replica).
        ``n`` > 1: the requests that find a free connection are sent here
        (``Attempt.send_all``), then the candidates' tasks start and send the rest."""
        if self._il is not None:
            return await self._il.send_now()
        assert self._fan is not None
        return await self._fan.open(self._up)

    def carry(self, out: Outlet) -> None:
        """The response head is out: the relay pump may write the body's chunks through ``out``
        while the response task waits (``n`` = 1, with a pump)."""
        if self._il is not None:
            self._il.carry(out, self._m.shaper)

    async def client_write(self, sending: Awaitable[_T]) -> _T:
        """Await ``sending``, a write to the client, as a parked write (the stall sweeper sees
        since when). The token gap measures the engine's silence only: an inline reader's gap
        clock is paused for the write (candidate tasks lift their gap while their channel is
        full instead)."""
        now = self._now  # the run's clock: cheaper than ``trio.current_time``
        since = self.writing_since = now()
        try:
            return await sending
        finally:
            self.writing_since = None
            il = self._il
            if il is not None:
                il.written = t = now()
                il.last += t - since

    # ------------------------------------------------------------------ ending from outside
    def check_stall(self, now: float) -> bool:
        """Abort every candidate when one client write has been parked too long; True when the
        caller must run :meth:`abort_stalled` (an inline reader is the stalled task itself)."""
        since = self.writing_since
        if since is None or now - since <= self._g.client_stall_timeout or self._done:
            return False
        if self._il is not None and self._il.cause is not None:
            return False  # already ended or stalled
        log.info("request %s: client stalled; aborting upstream", self.stats.request_id)
        self._up.end_all("stall")
        return self._il is not None

    async def abort_stalled(self) -> None:
        if self._il is not None:  # ``InlineReader.abort_stalled``
            await self._il.abort_stalled()

    def shut_down(self) -> None:
        """The shutdown grace is over: every candidate is aborted, and the client gets a 503
        "shutting down" (on a started stream an error event and ``[DONE]``), not a cut. An
        inline reader waiting for the engine is woken; one relaying stops at its next wait."""
        if not self.entered or self._done:
            return
        self._up.end_all("shutdown")
        il = self._il
        if il is not None and il.waiting:
            il.wake()

    # ------------------------------------------------------------------ merging
    def merge(self, events: list[Event]) -> bytes:
        """The frames of events that arrived together (``merge.Merger``)."""
        return self._m.merge(events)

    async def _next_frames(self) -> bytes | None:
        """One merged write: the next events that arrived together (None at the end)."""
        m = self._m
        if m.deferred is not None:  # an error drained behind frames: raised now
            return m.take_deferred()
        il = self._il
        if il is not None:  # the events of one upstream read
            events = await il.next()
            if events is QUIET:  # nothing went out for the keep-alive interval
                return m.ping()
            if not events:
                return None
            out = m.merge(events)
            if il.cause == "stop":  # the gateway matched a stop string: end it now
                out += m.merge(await il.next())
            return out
        assert self._fan is not None
        arrived = await self._fan.next(self._up)
        return None if arrived is None else m.merge(arrived)

    # ------------------------------------------------------------------ the first event
    async def prime(self) -> bytes:
        """Wait for the first upstream event (streaming) or the whole answer; raises the error
        for the status line, after the retry and the fallbacks (the module docstring)."""
        head = self._m.shaper.start()  # role chunks; sent only if the engine answers
        while True:
            try:
                if self.streaming:
                    first = await self._next_frames()
                    if first is None:
                        self._done = True
                        return head + self._m.shaper.end()
                    return head + first
                out = b""
                while (frames := await self._next_frames()) is not None:
                    out += frames
                self._done = True
                return out + self._m.shaper.end()
            except GatewayError as exc:
                # Nothing reached the client yet: the retry table decides (sieproxy.relay.failover).
                if self._m.handled_any or (moved := await self._fo.recover(self, exc)) is None:
                    raise
                if moved in ("fallback", "context"):
                    head = self._m.shaper.start()

    @property
    def deadline(self) -> float:
        return self._deadline

    async def other_replica(self) -> Replica | None:
        try:
            return await self._up.pool.acquire(self._hints, self._k, exclude=self.replica)
        except GatewayError:
            return None

    async def restart_on(
        self, other: Replica, route: Route | None = None, pause: float = 0.0
    ) -> None:
        """A new attempt on ``other`` (a retry), or on a fallback's route, once every
        candidate of the current one has ended; ``pause`` > 0: on the same replica after that
        pause (its slots are taken again after it)."""
        again = route is None and other is self._up.replica
        k = self._up.retry_no + 1
        self._up.end_all("retry")
        self._m.deferred = None
        if self._il is not None:
            await self._il.close()
        else:
            assert self._fan is not None
            await self._fan.drain()  # the old candidates finish their cleanup
        self._release()
        if again:
            await trio.sleep(pause)
            other.inflight += self._k
            other.total += self._k
        pool, bodies = self._up.pool, self._up.bodies
        if again:  # fresh rids: the old ones were aborted on this engine
            bodies = retry_bodies(bodies, k)
        if route is not None:  # a fallback: its model's pool, bodies and shaper from now on
            assert len(route.bodies) == self._k
            pool, bodies, self._hints = route.pool, route.bodies, route.hints
            self._m.reshape(route.shaper)
            self.stats.model = route.model
        self._up = self._m.up = self._attempt(pool, other, bodies)
        self._up.retry_no = k
        self._held = self._k
        self.stats.replica = other.url
        if self._fan is not None:
            self._fan.launch(self._up)

    # ------------------------------------------------------------------ the response
    @property
    def done(self) -> bool:
        """Nothing more to send after what the body last returned (the answer, or ``[DONE]``)."""
        return self._done

    def at_hand(self) -> bool:
        """The rest of the body can be made without waiting (``n`` = 1: all the engine sent)."""
        return not self._done and self._il is not None and self._il.at_hand()

    def __aiter__(self) -> GenerationBody:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        try:
            frames = await self._next_frames()
            if frames is None:
                self._done = True
                return self._m.shaper.end()
        except GatewayError as exc:
            self._done = True
            self._up.end_all("error")
            self.stats.error = exc
            return self._m.shaper.on_error(exc)
        except Exception:  # a bug in the core must not cut the stream silently
            log.exception("request %s: merger failed", self.stats.request_id)
            self._done = True
            self._up.end_all("error")
            err = InternalError("The gateway failed while relaying this response.")
            self.stats.error = err
            return self._m.shaper.on_error(err)
        return frames
