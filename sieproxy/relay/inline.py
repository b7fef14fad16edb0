"""The inline reader: the single candidate of an ``n`` = 1 request (no best_of), read by the
response task itself between two client writes — no task, no channel: one task switch and one
buffer fewer per chunk.

:meth:`InlineReader.next` is the response task's read: the candidate's next events, through
the same token step (:meth:`~sieproxy.relay.candidate.Candidate.step`) and the same edges (open,
abort, settle: :class:`~sieproxy.relay.attempt.Attempt`) as the candidate tasks of ``n`` > 1.
Its waits for the engine are bounded by the process's :class:`~sieproxy.relay.timers.WaitTimer`
(gap and deadline: :meth:`InlineReader.timer_due`) instead of a cancel scope each; a stalled
client write is handled by the stall sweeper closing the upstream connection and sending the
abort (:meth:`InlineReader.abort_stalled`).

Once the response head is out (:meth:`InlineReader.carry`), a wait for the engine parks the
response task in the relay pump (``sieproxy.pump``), which calls :meth:`InlineReader.ride` —
the same step, run synchronously for the bytes that are there: the common token through the
reader's express lane (the protocol's fast path), anything else through the token step and the
response's merger. ``ride`` hands the stream back (returns False) for anything it does not do
itself, leaving what it read and did not handle in ``stash`` for ``next``, so nothing is lost
or handled twice.

A stream whose shaper sends keep-alives (``ping``: the Messages API's ``ping`` event) has its
wait for the engine bounded by a cancel scope at ``written + ping`` too, ``written`` being when
the client was last written to (by the response task's ``client_write`` or by the pump):
``next`` then returns :data:`QUIET` instead of events, and the body writes the shaper's
keep-alive. Only such streams pay for that scope (one per wait; in the pump, one per park).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import trio

from ..core.errors import EngineHTTPError, EngineUnreachable, GatewayError
from ..core.upstream.protocol import CandidateReader, ExpressLane
from ..fleet.client import Exchange, UpstreamResponse
from .attempt import Attempt
from .candidate import Candidate, Event, Step
from .pump import Outlet, Pump
from .timers import Holder, WaitTimer

__all__ = ["QUIET", "Host", "InlineReader"]

_T = TypeVar("_T")

#: What :meth:`InlineReader.next` returns when nothing was written to the client for its
#: ``ping`` interval (told apart from the end, ``[]``, by identity; never filled).
QUIET: list[Event] = []


class Host(Protocol):
    """What the inline reader needs of its response body (``relay.GenerationBody``)."""

    def merge(self, events: list[Event]) -> bytes: ...

    async def client_write(self, sending: Awaitable[_T]) -> _T: ...


class InlineReader(Candidate):
    """The ``n`` = 1 candidate and its read state (see the module docstring)."""

    __slots__ = (
        "att",
        "clock",
        "closed",
        "cm",
        "deadline",
        "express",
        "failed",
        "fired",
        "holder",
        "host",
        "last",
        "out",
        "ping",
        "pump",
        "resp",
        "stash",
        "stats",
        "timer",
        "waiting",
        "written",
    )

    def __init__(
        self,
        att: Attempt,
        host: Host,
        *,
        clock: Callable[[], float],
        timer: WaitTimer | None,
        pump: Pump | None,
        ping: float = 0.0,
    ) -> None:
        super().__init__(0, att.reader())
        self.att = att
        self.host = host
        self.stats = att.stats
        self.deadline = att.deadline
        self.clock = clock
        self.timer = timer
        self.pump = pump
        self.cm: Exchange | None = None  # the exchange (entered once ``resp`` is set)
        self.failed: Exception | None = None  # why ``send_now`` could not send the request
        self.resp: UpstreamResponse | None = None
        # When the engine last sent bytes, moved later by the time spent in client writes since
        # (the gap limit counts from there: the engine's silence only, ``client_write``).
        self.last = 0.0
        # Keep-alives (the module docstring): the interval (0: none) and when the client was
        # last written to (from the request's send until the first write).
        self.ping = ping
        self.written = 0.0
        self.closed = False
        # WaitTimer state: the holder of this reader's entry in the timer's heap while it has one
        # (its limit only moves later, so one entry at a time suffices; emptied when the reader
        # ends), whether the reader is parked waiting for the engine, and whether the timer
        # closed the connection under it.
        self.holder: Holder | None = None
        self.waiting = False
        self.fired = False
        # The relay pump: the client writer it may write through (set once the response head is
        # out), and what the pump read but left to the response task (bytes, or the exception
        # to raise); the reader's express lane for the pump's step (None where it never applies).
        self.out: Outlet | None = None
        self.stash: bytes | Exception | None = None
        self.express: ExpressLane | None = None

    # ------------------------------------------------------------------ opening
    def exchange(self) -> Exchange:
        """The exchange with the engine (not sent yet). The request's deadline bounds the
        opening through the client's own scope (``until``): one cancel scope fewer on the way
        to the first token."""
        self.cm = self.att.open(0, until=self.deadline)
        self.mark_sent()
        self.last = self.written = trio.current_time()  # a first_token_timeout counts from here
        return self.cm

    async def send_now(self) -> bool:
        """Send the request now (``GenerationBody.open``); a failure is kept for :meth:`next`,
        which handles it as its own (a retry on another replica)."""
        if self.cm is not None or self.closed or self.cause is not None:
            return False
        cm = self.exchange()
        try:
            await cm.send()
        except (GatewayError, trio.TooSlowError) as exc:
            self.failed = exc
            return False
        return True

    def carry(self, out: Outlet, shaper: object) -> None:
        """The response head is out and ``out`` can write the body's chunks from another task:
        while the response task waits for the engine, the relay pump may relay them."""
        if self.pump is not None:
            self.out = out
            self.express = self.reader.express(shaper)

    # ------------------------------------------------------------------ reading
    async def next(self) -> list[Event]:
        """The candidate's next events; ``[]`` at its end. Errors come back as an event after
        the candidate was cleaned up; a broken stream resumed elsewhere reads on."""
        while True:
            events = await self._next()
            if events or self.closed or events is QUIET:
                return events  # (nothing, and not closed: it resumed on a new attempt)

    async def _next(self) -> list[Event]:
        if self.closed:
            return []
        if self.cause is not None:  # stopped or aborted from outside (stall)
            return await self.finish_with(None)
        att = self.att
        gap = att.g.token_gap_timeout
        try:
            if self.resp is None:
                if self.cm is None:
                    self.exchange()
                cm, failed, self.failed = self.cm, self.failed, None
                assert cm is not None
                if failed is not None:  # ``send_now`` could not send the request
                    self.cm = None
                    raise failed
                try:
                    self.resp = await cm.__aenter__()  # sends it first if not sent yet
                except BaseException:
                    self.cm = None  # the exchange let its connection go
                    raise
                self.to(Step.HEAD)
                if att.pool.first_token is None:  # else the first chunk's limit counts from
                    self.last = trio.current_time()  # the request's send (``exchange``)
            resp, reader, timer = self.resp, self.reader, self.timer
            while True:
                # Bytes already there need no timer (a cancel scope per chunk was a measurable
                # cost): the timer bounds only a wait; the deadline is checked either way.
                stash = self.stash
                if stash is None:
                    raw = resp.receive_nowait()
                else:  # what the pump read and left to this task
                    self.stash = None
                    if isinstance(stash, Exception):
                        raise stash
                    raw = stash
                if raw is None:
                    limit = min(self.deadline, self.last + (gap if self.heard else att.first))
                    quiet = math.inf
                    if self.ping:  # a stream that sends keep-alives while it waits
                        quiet = self.written + self.ping
                        if quiet <= self.clock():
                            return QUIET
                    if timer is None or not timer.running:
                        with trio.move_on_at(min(limit, quiet)) as scope:
                            await resp.wait_readable()
                        if not scope.cancelled_caught or self.clock() < limit:
                            continue  # bytes, or the keep-alive's time
                        return await self.finish_with(att.expired(self))
                    if self.holder is None:
                        self.holder = [self]
                        timer.arm(limit, self.holder)
                    if quiet == math.inf:
                        await self._wait(resp)
                    else:
                        with trio.move_on_at(quiet):
                            await self._wait(resp)
                    if self.cause is not None:  # the pump matched a stop string
                        return await self.finish_with(None)
                    continue
                now = self.clock()
                if now >= self.deadline:
                    return await self.finish_with(att.deadline_error(self))
                if not raw:
                    reader.eof()
                    return await self.finish_with(None)
                self.last = now
                events, err = self.step(raw)
                if err is not None:
                    return events + await self.finish_with(err)
                if events:
                    return events
        except GatewayError as e:
            if self.fired:
                # The wait timer closed the connection (the gap or the deadline passed): that,
                # not the broken read it caused, is the error — also when bytes arrived in the
                # same instant and the read after the wake-up is the one that failed.
                return await self.finish_with(att.expired(self))
            if isinstance(e, EngineUnreachable | EngineHTTPError) and self.resp is None:
                self.refused()
            return await self.finish_with(e)
        except trio.TooSlowError:  # no response head in time: by the deadline, or the gap
            return await self.finish_with(att.expired(self))

    def at_hand(self) -> bool:
        """Whether the candidate's remaining events can be read without waiting: the engine's
        whole body has arrived (or the candidate has ended)."""
        resp = self.resp
        return self.closed or (resp is not None and resp.finished and self.cause is None)

    async def _wait(self, resp: UpstreamResponse) -> None:
        """Wait for the engine's next bytes, in the relay pump once the head is out (it relays
        what it can meanwhile); a fired timer wakes the wait by closing the connection."""
        self.waiting = True
        try:
            pump, fd = self.pump, -1
            if self.out is not None and pump is not None and pump.running:
                fd = resp.fileno()
            if fd < 0:
                await resp.wait_readable()  # a fired timer: EngineTruncated, in ``next``
            else:
                assert pump is not None
                await pump.park(fd, self)
        finally:
            self.waiting = False
        out = self.out
        if out is not None and out.pending:
            # The pump's write did not complete: this is a client write, not a wait for the
            # engine, so the timer must not close the engine's connection under it (and its
            # time does not count in the gap, ``client_write``).
            await self.host.client_write(out.flush())

    def ride(self) -> bool:
        """The relay pump's step (``sieproxy.pump``), run by the pump's task while the response
        task is parked in ``next``: what that loop and the response's write do for bytes that
        are there, as long as nothing else is needed. False hands the stream back: the end of
        the engine's body, an error, the deadline, a stop string, or a client write that did
        not complete at once."""
        if TYPE_CHECKING:  # not run: ``resp`` was set before the task parked, ``out`` by carry
            assert self.resp is not None and self.out is not None
        resp, out = self.resp, self.out
        try:
            raw = resp.receive_nowait()
            if raw is None:
                return True  # a part of a frame: wait for the rest
            now = self.clock()
            if not raw or now >= self.deadline:
                self.stash = raw
                return False
            self.last = now
            ex = self.express
            # The common token in one step (the reader's express lane) once the first token was
            # counted (its time is the request's time to first token); else, or for anything
            # the lane does not take, the token step, from the same bytes.
            frame = (
                ex.relay(raw) if ex is not None and self.stats.first_token_at is not None else None
            )
            if frame is not None:
                if frame and not out.write_nowait(frame):
                    return False  # the rest of the frame: the task flushes it
            elif not self._ride_step(raw, out):
                return False
            if resp.finished:  # the body ended in these bytes: no readiness will tell
                self.stash = b""
                return False
        except Exception as exc:  # raised in the response task, as if it had read the bytes
            self.stash = exc
            return False
        return self.cause is None

    def _ride_step(self, raw: bytes, out: Outlet) -> bool:
        """``ride`` for a read the express lane did not take: False hands the stream back (an
        error, kept in ``stash``; or a write that did not complete)."""
        events, err = self.step(raw)
        if err is not None:
            self.stash = err
        if events:
            frames = self.host.merge(events)
            if frames:
                self.written = self.last  # the client was written to (keep-alives)
                if not out.write_nowait(frames):
                    return False  # the rest of the frame: the task flushes it
        return err is None

    # ------------------------------------------------------------------ the end
    async def finish_with(self, err: GatewayError | None) -> list[Event]:
        """End the candidate: abort it upstream if the engine may still be generating, release
        its connection, and return what the shaper must still see."""
        await self.close(err)
        att = self.att
        if err is not None and att.resumer is not None:
            got = await att.resumer.resume(self, att, err)
            if got is not None:
                if got.att is not None:  # reopened there: ``next`` reads on
                    self.att = got.att
                    return []
                return [] if got.last is None else [(0, got.last)]
        last = att.settle(self, err)
        return [] if last is None else [(0, last)]

    def restart(self, reader: CandidateReader) -> None:
        super().restart(reader)
        self.closed = self.fired = False
        self.holder = None  # (``close`` dropped its timer entry)
        self.cm = self.resp = self.failed = self.stash = self.express = None

    async def close(self, err: GatewayError | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        if self.holder is not None:
            assert self.timer is not None
            self.holder[0] = None  # the timer's entry no longer keeps this reader alive
            self.timer.drop()
        await self.att.abort(self, err)
        cm, self.cm, self.resp = self.cm, None, None
        if cm is not None:
            with trio.CancelScope(shield=True):
                await cm.__aexit__(None, None, None)

    def timer_due(self, now: float) -> float | None:
        """This reader's :class:`WaitTimer` entry is due: the time to re-arm it at, or None
        (the limit passed: if the reader waits, close its connection to wake it)."""
        att = self.att
        gap = att.g.token_gap_timeout if self.heard else att.first
        limit = min(self.deadline, self.last + gap)
        if limit > now:
            return limit  # still armed: the timer re-pushes the same holder
        self.holder = None  # the timer dropped the entry
        if self.waiting and self.resp is not None:
            self.fired = True
            self.wake()
        return None

    def wake(self) -> None:
        """Wake a reader waiting for the engine: close its connection (out of the pump first,
        if parked there, before its socket closes); ``next`` then reports why."""
        resp = self.resp
        if resp is not None:
            if self.pump is not None:
                self.pump.unpark(resp.fileno())
            resp.close()

    async def abort_stalled(self) -> None:
        """The client stalled: close the upstream connection (nobody reads it while the response
        task is parked in the client write, and an engine blocked writing to it would not end
        the generation) and abort it upstream."""
        if self.resp is not None:
            self.resp.close()
        await self.att.abort(self, None)
