"""The candidates of one request on one replica (:class:`Attempt`): how each is opened, read,
aborted and settled, and the candidate task that streams one of them into the request's channel
(``n`` > 1). A retry on another replica, or a fallback, is a new attempt.

Who aborts: a candidate whose request may have reached the engine (``sent``: from the moment
it is sent until the engine refuses it — no connection, an error status before any output)
and that the engine did not end itself gets exactly one abort, :meth:`Attempt.abort`, on its
way out, inside ``move_on_after(abort_timeout, shield=True)``: SGLang's ``/abort_request`` for
its rid, or nothing more than closing its connection where the protocol has no abort request.
What the shaper must still see of an ended candidate is :meth:`Attempt.settle`'s answer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from ..core.errors import (
    ClientStalled,
    EngineHTTPError,
    EngineTimeout,
    EngineUnreachable,
    GatewayError,
    ServiceUnavailable,
    UpstreamError,
)
from ..core.shaping.events import CandidateFinish
from ..core.upstream.protocol import CandidateReader, protocol_for
from ..core.upstream.retry import FirstTokenTimeout
from ..core.upstream.status import breaker_counts
from ..fleet.client import EngineClient, Exchange, UpstreamResponse
from ..fleet.pool import ModelPool, Replica
from ..observe.stats import RequestStats
from ..settings.load import GatewaySettings
from .candidate import SHOWN, Candidate, Event, Step

if TYPE_CHECKING:
    from .resume import Resumer

__all__ = ["Attempt"]

log = logging.getLogger("sieproxy.relay")

#: Share of ``token_gap_timeout`` by which the gap limit may fire early (see ``_feed``).
_GAP_SLACK = 0.02


class Attempt:
    """The candidates of one request on one replica: how one is opened, read, aborted and
    settled. A retry on another replica, or a fallback, is a new attempt."""

    __slots__ = (
        "bodies",
        "cands",
        "client",
        "deadline",
        "g",
        "model",
        "pool",
        "proto",
        "replica",
        "resumer",
        "retry_no",
        "stats",
        "unsent",
    )

    def __init__(
        self,
        *,
        g: GatewaySettings,
        client: EngineClient,
        pool: ModelPool,
        replica: Replica,
        bodies: list[dict[str, Any]],
        stats: RequestStats,
        deadline: float = math.inf,
    ) -> None:
        self.g = g
        self.client = client
        self.pool = pool
        self.replica = replica
        self.proto = protocol_for(replica.protocol)
        self.bodies = bodies
        self.stats = stats
        self.deadline = deadline
        self.retry_no = 0  # how many attempts of the request came before this one
        self.resumer: Resumer | None = None  # continues a broken candidate (sieproxy.relay.resume)
        self.model: str | None = None  # the engines' model, if not the request's (a resume)
        self.cands: list[Candidate] = []
        # The engine's finish of a candidate cancelled while its task waited to queue it (the
        # channel was full): ``settle`` hands it to the shaper in its place.
        self.unsent: list[CandidateFinish | None] = []

    @property
    def first(self) -> float:
        """The limit to a candidate's first chunk: the model's ``first_token_timeout``, else
        the token gap."""
        first = self.pool.first_token
        return self.g.token_gap_timeout if first is None else first

    def launch(
        self,
        nursery: trio.Nursery,
        send: trio.MemorySendChannel[Event],
        sent: Sequence[Exchange | Exception] = (),
    ) -> None:
        """Fresh candidates, each streamed by its own task (:meth:`run`) into its clone of
        ``send`` (closed here); ``sent[i]``: candidate ``i``'s request, already sent."""
        cands = [Candidate(i, self.reader(i)) for i in range(len(self.bodies))]
        for c in cands:
            c.scope = trio.CancelScope(deadline=self.deadline)
        self.reset(cands)
        with send:
            for i in range(len(cands)):
                nursery.start_soon(self.run, i, send.clone(), sent[i] if i < len(sent) else None)

    def reset(self, cands: Sequence[Candidate]) -> None:
        """Fresh candidates (at the launch; a retry is a new attempt)."""
        self.cands = list(cands)
        self.unsent = [None] * len(cands)

    def reader(self, i: int = 0) -> CandidateReader:
        """A new reader for candidate ``i``'s response, in the replica's protocol."""
        return self.proto.reader(
            incremental=self.replica.incremental,
            max_line=self.g.max_sse_line_bytes,
            body=self.bodies[i],
        )

    def open(self, i: int, until: float = math.inf) -> Exchange:
        """The exchange of candidate ``i`` (an async context manager); its head must arrive
        within the first-token limit, and by ``until`` (``trio.TooSlowError``)."""
        head = self.first
        if until < math.inf:
            head = max(min(head, until - trio.current_time()), 0.0)
        model = self.model or self.stats.model
        path, payload = self.proto.request(self.bodies[i], self.stats.endpoint, model)
        return self.client.stream(self.replica.url, path, payload, head_timeout=head)

    async def send_all(self, sent: list[Exchange | Exception]) -> None:
        """Send the candidates' requests one after the other, each into ``sent`` as it goes
        (its exchange, or why it could not be sent), while a connection slot is free: the
        rest are sent by their tasks, which can wait for one (the sender would wait for a slot
        its own unread requests hold)."""
        for i in range(len(self.bodies)):
            if not self.client.spare_connections:
                return
            ex = self.open(i, until=self.deadline)
            try:
                await ex.send()
            except (GatewayError, trio.TooSlowError) as exc:
                sent.append(exc)
            else:
                sent.append(ex)

    def end_all(self, cause: str) -> None:
        """End every candidate the engine has not ended itself."""
        for c in self.cands:
            if not c.engine_done:
                c.end(cause)

    def gap_error(self, c: Candidate) -> GatewayError:
        c.cause = c.cause or "timeout"
        c.to(Step.FAIL)
        return EngineTimeout(
            "The engine produced no token within the configured gap; the request was aborted."
        )

    def deadline_error(self, c: Candidate) -> GatewayError:
        c.cause = "deadline"
        c.to(Step.FAIL)
        return EngineTimeout("The request exceeded its deadline and was aborted.")

    def expired(self, c: Candidate) -> GatewayError | None:
        """What a candidate's fired timer means: nothing if the engine already finished (it
        kept the body open), else the request deadline, the model's first-token timeout (no
        chunk yet) or the token gap, by the clock."""
        if c.reader.done:
            return None
        if trio.current_time() >= self.deadline:
            return self.deadline_error(c)
        if not c.heard and self.pool.first_token is not None:
            c.cause = c.cause or "first_token"
            c.to(Step.FAIL)
            return FirstTokenTimeout()
        return self.gap_error(c)

    async def abort(self, c: Candidate, err: GatewayError | None) -> None:
        """The abort of a candidate the engine may still be generating (see the module
        docstring); counted by cause in the request's stats."""
        if not c.sent or c.aborted or c.engine_done:
            return
        c.aborted = True
        cause = c.cause or ("error" if err is not None else "client")
        causes = self.stats.abort_causes
        causes[cause] = causes.get(cause, 0) + 1
        call = self.proto.abort(self.bodies[c.index])
        if call is None:
            return  # closing the candidate's connection (on the way out) is the abort
        with trio.move_on_after(self.g.abort_timeout, shield=True):
            try:
                await self.client.post(self.replica.url, *call)
            except GatewayError:
                rid = self.bodies[c.index].get("rid")
                log.warning("abort of %s on %s failed", rid, self.replica.url)

    def settle(
        self, c: Candidate, err: GatewayError | None, *, record: bool = True
    ) -> CandidateFinish | GatewayError | None:
        """What the shaper must still see of an ended candidate (and, with ``record``, the
        replica's record)."""
        if err is not None:
            c.to(Step.FAIL)
        cause = c.cause
        if cause in SHOWN:
            # The gateway ended this candidate; the shaper still needs its finish: the engine's
            # own if it was read (none if it is already in the channel: an end can land after
            # it was queued; the engine's if the end landed while its task waited for room to
            # queue it, ``unsent``), else a local one.
            return self.unsent[c.index] if c.engine_done else c.reader.local_finish()
        if cause == "stall":
            # The writer of this response was parked when the candidate was aborted: should the
            # client read again, the stream ends with an error event, not a silent cut.
            return ClientStalled()
        if cause == "shutdown":  # see ``GenerationBody.shut_down``
            return ServiceUnavailable(
                "The gateway is shutting down and stopped this generation before it finished; "
                "retry on another instance.",
                retry_after=self.g.retry_after,
            )
        if err is None:
            self.pool.record_success(self.replica)
            return None
        engine_status = getattr(err, "engine_status", None)  # (EngineHTTPError's)
        if record and isinstance(err, UpstreamError) and breaker_counts(engine_status, err.status):
            self.pool.record_failure(self.replica)
        if cause in ("client", "done", "retry", "error"):
            return None
        return err

    # ------------------------------------------------------------------ the candidate task
    async def run(
        self,
        i: int,
        send: trio.MemorySendChannel[Event],
        sent: Exchange | Exception | None = None,
    ) -> None:
        """Stream candidate ``i`` from the engine into the channel (``n`` > 1); ``sent``: its
        request as ``GenerationBody.open`` sent it (or why it could not), else it is sent
        here. A broken stream may continue on another attempt (``sieproxy.relay.resume``)."""
        with send:
            att: Attempt | None = self
            while att is not None:
                c = att.cands[i]
                err = await att._stream(c, send, sent)
                sent = None
                got = None
                if err is not None and att.resumer is not None:
                    got = await att.resumer.resume(c, att, err)
                if got is None:
                    last = att.settle(c, err)
                elif got.att is None:
                    last = got.last
                att = None if got is None else got.att
            if last is not None:
                await send.send((i, last))

    async def _stream(
        self, c: Candidate, send: trio.MemorySendChannel[Event], sent: Exchange | Exception | None
    ) -> GatewayError | None:
        """One attempt of ``run``: the candidate's stream into the channel; why it ended early
        (it was aborted on the way out if the engine may still be generating it)."""
        scope = c.scope
        assert scope is not None
        i = c.index
        err: GatewayError | None = None
        try:
            with scope:
                try:
                    c.mark_sent()  # from here an early end aborts it, unless the engine refused
                    if isinstance(sent, Exception):  # open() could not send it
                        raise sent
                    since = trio.current_time()
                    async with sent or self.open(i) as resp:
                        c.to(Step.HEAD)
                        await self._feed(c, resp, send, scope, since)
                except GatewayError as e:
                    err = e
                    if isinstance(e, EngineUnreachable | EngineHTTPError):
                        c.refused()
                except trio.TooSlowError:  # no response head within the first-token limit
                    err = self.expired(c)
            if scope.cancelled_caught and c.cause is None:
                err = self.expired(c)  # the request's deadline or the gap (_feed)
        finally:
            # Runs on every exit, including the client leaving (an outer cancellation).
            await self.abort(c, err)
        return err

    async def _feed(
        self,
        c: Candidate,
        resp: UpstreamResponse,
        send: trio.MemorySendChannel[Event],
        scope: trio.CancelScope,
        since: float,
    ) -> None:
        """Read the candidate's body into the channel (``since``: when its request went out,
        from which a ``first_token_timeout`` counts). The token gap is enforced by moving the
        deadline of the candidate's own ``scope`` (one scope fewer per candidate); the request
        deadline caps it."""
        gap = self.g.token_gap_timeout
        end = self.deadline
        # Moving a cancel scope's deadline costs a trio deadline-heap update; doing it for every
        # chunk was measurable. The deadline is moved when a chunk arrives and at least
        # ``slack`` has passed since the last move, so the gap limit fires between
        # ``gap - slack`` and ``gap`` after the last chunk.
        slack = gap * _GAP_SLACK
        receive = resp.receive
        clock = trio.lowlevel.current_clock().current_time
        # Until the first chunk: the first-token limit, from the request's send.
        moved = (clock() if self.pool.first_token is None else since) + self.first
        scope.deadline = min(end, moved)
        step = c.step
        while raw := await receive():
            now = clock()
            if now + gap - moved > slack:
                moved = now + gap
                scope.deadline = min(end, moved)
            events, err = step(raw)
            for ev in events:
                try:
                    send.send_nowait(ev)  # no yield: the next upstream read is the checkpoint
                except trio.WouldBlock:
                    await self._put_waiting(c, send, scope, ev, events)
                    moved = clock() + gap  # the gap counts again from the end of the wait
                    scope.deadline = min(end, moved)
            if err is not None:
                raise err
        c.reader.eof()

    async def _put_waiting(
        self,
        c: Candidate,
        send: trio.MemorySendChannel[Event],
        scope: trio.CancelScope,
        ev: Event,
        events: list[Event],
    ) -> None:
        """Queue ``ev`` when the channel is full: the merger is behind, held by a client that
        reads slower than the engine writes. The token gap measures the engine's silence, so it
        is lifted while this task waits (the request deadline still bounds the wait, and a
        client that stopped reading is the stall sweeper's to report); the caller restarts it.
        A cancel here drops ``ev`` and what follows it; if that includes the engine's finish
        (always the read's last event), it is kept for ``settle``."""
        scope.deadline = self.deadline
        try:
            await send.send(ev)
        except trio.Cancelled:
            last = events[-1][1]
            if isinstance(last, CandidateFinish):
                self.unsent[c.index] = last
            raise
