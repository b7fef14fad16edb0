"""The per-request body: one nursery, one task per candidate, one merger (``n`` = 1: inline).

Theory of operation
-------------------
A :class:`GenerationBody` is the response body of a generation request. The HTTP layer
(``app.GatewayHTTPConnection``) enters it (``__aenter__`` opens the request's nursery), may call
:meth:`open` (which sends the engine requests and starts one task per candidate; otherwise
``prime`` starts them and they send their own), then calls :meth:`prime`, which waits for the
first upstream event:

* if the engine failed before producing anything, ``prime`` raises the error and the status line
  carries it (503 + Retry-After, 400, 500, ...) — after one retry on another ready replica when
  the failure is a server-side one that came without waiting (an engine that could not be
  reached, an error status, a broken connection); never after a timeout (504): an engine that
  took the request and then stayed silent for the token gap has reached a model, and a retry
  would make the client wait for the gap a second time; then on the model's fallbacks, each
  once (another model or pool: ``sieproxy.fallback``, whose plan replaces the body's);
* otherwise the status is 200 and the body streams (or, for non-streaming requests, ``prime``
  collects the whole answer first and the body is one JSON document).

Candidate tasks stream ``/generate`` from the engine, decode SSE from raw bytes with the sans-IO
decoder, and send ``(index, event)`` into their ``clone()`` of a *bounded* channel. The merger
runs in the response task itself (``__anext__``): it receives one event, drains whatever else
is already buffered (coalescing frames that arrive together into one write), feeds the sans-IO
shaper and returns the encoded frames. A slow client therefore stalls ``__anext__``, which
stalls the channel, which stalls the candidates, which stop reading upstream: backpressure end
to end, with no buffer growing. A sweeper (one task per process, :func:`sweep_stalls`) aborts the
candidates when a single client write has been parked longer than ``client_stall_timeout``
(Hypercorn shields socket writes, so the write itself may outlive cancellation; the GPU
time is freed regardless).

With ``n`` = 1 (and no best_of) there is no nursery, task or channel: the response task reads
its single candidate itself between two client writes (``_inline_next``), through the same
edge helpers as the candidate tasks; a stalled write there is handled by the sweeper closing the
upstream connection and sending the abort (``abort_stalled``), and its waits for the engine are
bounded by the process's :class:`WaitTimer` (gap and deadline) instead of a cancel scope each.
The HTTP layer may call :meth:`open` before ``prime``: the requests are then sent at once (for
``n`` > 1 one after the other from the response task, before the candidates' tasks start), and
what the HTTP layer does before ``prime`` (the response head's bytes) overlaps the engine's work
on them.

Every candidate that ends without a terminal event from its engine (client gone, deadline,
stop string matched by the gateway, best_of loser, error, stall) sends exactly one
``/abort_request`` for its rid, inside ``move_on_after(abort_timeout, shield=True)``, and its
upstream connection is closed (never returned to the pool half-read). ``__aexit__`` cancels what
is still running and waits for the nursery, so nothing outlives the request.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import trio

from .channels import take
from .core.errors import (
    ClientStalled,
    EngineHTTPError,
    EngineTimeout,
    EngineUnreachable,
    GatewayError,
    InternalError,
    ServiceUnavailable,
    UpstreamError,
)
from .core.events import CandidateDelta, CandidateFinish
from .core.protocol import CandidateReader, ExpressLane, protocol_for
from .core.refusal import RequestFields, explain
from .engine_client import EngineClient, Exchange, UpstreamResponse
from .pool import ModelPool, Replica, RouteHints
from .pump import Outlet, Pump
from .settings import GatewaySettings

__all__ = ["GenerationBody", "RequestStats", "Route", "Shaper", "WaitTimer", "sweep_stalls"]

log = logging.getLogger("sieproxy.relay")

Event = tuple[int, CandidateDelta | CandidateFinish | GatewayError]
_T = TypeVar("_T")
#: Share of ``token_gap_timeout`` by which the gap limit may fire early (see ``_feed``).
_GAP_SLACK = 0.02


class Shaper(Protocol):
    """The sans-IO response builder the body drives (a chat/completions stream or collector)."""

    def start(self) -> bytes: ...

    def on_delta(self, index: int, delta: CandidateDelta) -> bytes: ...

    def on_finish(self, index: int, finish: CandidateFinish) -> bytes: ...

    def on_error(self, err: GatewayError) -> bytes: ...

    def end(self) -> bytes: ...

    def stopped(self, index: int) -> bool: ...


@dataclass(slots=True)
class Route:
    """Where a request runs after a fallback (``sieproxy.fallback``): the model and its pool,
    the replica holding the request's slots, the routing hints, and the engine bodies and
    response shaper planned for that model."""

    model: str
    pool: ModelPool
    replica: Replica
    hints: RouteHints
    bodies: list[dict[str, Any]]
    shaper: Shaper
    losers: Callable[[], list[int]] | None


#: The next fallback of a request that failed (cause, the failed replica), or None.
FallBack = Callable[[str, Replica], Awaitable[Route | None]]


@dataclass(slots=True)
class RequestStats:
    """What the access log and metrics record about one request."""

    request_id: str
    model: str
    endpoint: str
    n: int
    stream: bool
    replica: str | None = None
    started: float = 0.0
    first_token_at: float | None = None
    abort_causes: dict[str, int] = field(default_factory=dict)
    retried: bool = False
    error: GatewayError | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    sdk_version: str | None = None
    #: How the response ended for its client: ``complete`` (its end was sent), ``client_closed``
    #: (the client left first) or ``cut`` (the gateway stopped first: a shutdown stopping at
    #: once).
    outcome: str = "complete"
    responded: bool = False  # its status line was sent


async def sweep_stalls(active: set[GenerationBody], limit: float) -> None:
    """One task per process (not per request) checks every in-flight body for a stalled
    client write, every quarter of the stall limit."""
    async with trio.open_nursery() as nursery:
        while True:
            await trio.sleep(max(limit / 4, 0.05))
            now = trio.current_time()
            for body in list(active):
                if body.check_stall(now):
                    nursery.start_soon(body.abort_stalled)


@dataclass(slots=True)
class _Inline:
    """The read state of an inline candidate (``n`` = 1, see ``GenerationBody._inline_next``)."""

    cm: Any = None  # the ``EngineClient.stream`` exchange (entered once ``resp`` is set)
    failed: Exception | None = None  # why ``GenerationBody.open`` could not send the request
    resp: UpstreamResponse | None = None
    reader: CandidateReader | None = None
    # When the engine last sent bytes, moved later by the time spent in client writes since
    # (the gap limit counts from there: the engine's silence only, ``client_write``).
    last: float = 0.0
    opened: bool = False  # the engine may be generating this rid
    ended: bool = False
    # WaitTimer state: the holder of this reader's entry in the timer's heap while it has one
    # (its limit only moves later, so one entry at a time suffices; emptied when the reader
    # ends), whether the reader is parked waiting for the engine, and whether the timer closed
    # the connection under it.
    holder: list[GenerationBody | None] | None = None
    waiting: bool = False
    fired: bool = False
    # The relay pump (``sieproxy.pump``): the client writer it may write through (set once the
    # response head is out), and what the pump read but left to the response task (bytes, or
    # the exception to raise).
    out: Outlet | None = None
    stash: bytes | Exception | None = None
    # The reader's express lane for the pump's step (None where it never applies).
    express: ExpressLane | None = None


class WaitTimer:
    """The token-gap and deadline timer of inline candidates (``n`` = 1) while they wait for the
    engine. One task per process, like the stall sweeper.

    A trio cancel scope per upstream wait cost 7–12 µs on the benchmark machine, ~8 % of a
    relayed chunk's CPU at 64 clients. Instead, a waiting reader makes sure it has one entry in
    this heap, at a time no later than its limit (``min(deadline, last bytes + gap)``); as
    bytes arrive its limit only moves later, so a wait usually costs two attribute writes. The
    task sleeps until the earliest entry. An entry that is due re-arms at the reader's current
    limit if that is later; if the limit has passed while the reader is parked waiting, the
    timer closes the upstream connection, which wakes the reader, which reports the gap or the
    deadline exactly as the cancel scope did (``GenerationBody._inline_next``). A reader that
    is not waiting when its limit passes re-arms at the passed limit on its next wait, which
    fires at once. The timer fires at the limit, not at the next sweep. An ended reader empties
    its entry's holder (so the heap keeps no body alive); the heap is rebuilt without such
    entries once they are half of it.

    A body used where no timer task runs (an app built without ``serve.build_app``'s background
    tasks) keeps a cancel scope per wait.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, list[GenerationBody | None]]] = []
        self._seq = itertools.count()
        self._sleep: trio.CancelScope | None = None
        self._dead = 0
        self.running = False

    def __len__(self) -> int:
        return len(self._heap)

    def arm(self, at: float, holder: list[GenerationBody | None]) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), holder))
        sleep = self._sleep
        if sleep is not None and at < sleep.deadline:
            sleep.deadline = at

    def drop(self) -> None:
        """An entry's holder was emptied; rebuild the heap once half of it is such entries."""
        self._dead += 1
        if self._dead > 64 and self._dead * 2 > len(self._heap):
            self._heap = [e for e in self._heap if e[2][0] is not None]
            heapq.heapify(self._heap)
            self._dead = 0

    async def run(self) -> None:
        self.running = True
        try:
            while True:
                heap = self._heap
                now = trio.current_time()
                while heap and heap[0][0] <= now:
                    holder = heapq.heappop(heap)[2]
                    body = holder[0]
                    if body is None:
                        self._dead -= 1
                        continue
                    again = body.timer_due(now)
                    if again is not None:
                        heapq.heappush(heap, (again, next(self._seq), holder))
                with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as sleep:
                    self._sleep = sleep
                    await trio.sleep_forever()
                self._sleep = None
        finally:
            self.running = False
            self._sleep = None


class GenerationBody:
    """The response body of one generation request (see the module docstring)."""

    __slots__ = (
        "_aborted",
        "_bodies",
        "_causes",
        "_client",
        "_deadline",
        "_deferred",
        "_done",
        "_fallback",
        "_fields",
        "_g",
        "_handled_any",
        "_held",
        "_hints",
        "_il",
        "_k",
        "_losers",
        "_now",
        "_nursery",
        "_nursery_cm",
        "_on_done",
        "_pool",
        "_pump",
        "_recv",
        "_scopes",
        "_shaper",
        "_terminal",
        "_timer",
        "_unsent",
        "entered",
        "replica",
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
        losers: Callable[[], list[int]] | None = None,
        on_done: Callable[[GenerationBody], None] | None = None,
        timer: WaitTimer | None = None,
        pump: Pump | None = None,
        fallback: FallBack | None = None,
        fields: RequestFields | None = None,
    ) -> None:
        self._g = g
        self._fallback = fallback
        self._fields = fields or RequestFields()
        self._client = client
        self._pool = pool
        self.replica = replica
        self._hints = hints
        self._bodies = bodies
        self._shaper = shaper
        self.streaming = streaming
        self.stats = stats
        self._losers = losers
        self._on_done = on_done
        self._timer = timer
        self._pump = pump
        k = len(bodies)
        self._k = k
        self._scopes: list[trio.CancelScope] = []
        self._il: _Inline | None = None
        self._reset_candidates()
        if k == 1 and losers is None:  # n = 1 (no best_of): the response task reads it itself
            self._il = _Inline()
        self._recv: trio.MemoryReceiveChannel[Event] | None = None
        self._nursery_cm: Any = None
        self._nursery: trio.Nursery | None = None
        self._done = False
        self._held = k  # admission slots held on self.replica
        self.writing_since: float | None = None  # while a client write waits (``client_write``)
        self._deadline = math.inf
        self._handled_any = False  # an engine event reached the shaper (no retry after that)
        self._deferred: Event | None = None  # an error drained after frames; raised next
        self.entered = False
        #: Trio's time, read from the run's clock (``trio.current_time`` is two calls more, and
        #: the relay reads the time once per token).
        self._now: Callable[[], float] = trio.current_time

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
        self._deadline = self.stats.started + self._g.request_deadline
        if self._il is not None:
            return self
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: Any, exc: Any, tb: Any
    ) -> bool | None:
        self._cancel_all("client" if exc_type is not None else "done")
        try:
            if self._il is not None:
                await self._inline_close()
                return None
            assert self._nursery is not None
            return bool(await self._nursery_cm.__aexit__(exc_type, exc, tb))
        finally:
            self._release()
            if self._on_done is not None:
                self._on_done(self)

    def _release(self) -> None:
        if self._held:
            self._pool.release(self.replica, self._held)
            self._held = 0

    def _launch(self, sent: Sequence[Exchange | Exception] = ()) -> None:
        """Start the candidates' tasks; ``sent[i]``: candidate ``i``'s request as ``open()``
        sent it (or why it could not), else the task sends it."""
        assert self._nursery is not None
        send, recv = trio.open_memory_channel[Event](self._g.channel_size)
        self._recv = recv
        self._scopes = [trio.CancelScope(deadline=self._deadline) for _ in range(self._k)]
        self._reset_candidates()
        with send:
            for i in range(self._k):
                ex = sent[i] if i < len(sent) else None
                self._nursery.start_soon(self._candidate, i, send.clone(), ex)

    def _reset_candidates(self) -> None:
        """Fresh per-candidate state (at start, and for a retry on another replica)."""
        k = self._k
        self._terminal = [False] * k  # the engine ended this candidate itself
        self._causes: list[str | None] = [None] * k
        self._aborted = [False] * k  # an /abort_request went out for this candidate
        # The engine's finish of a candidate cancelled while its task waited to queue it (the
        # channel was full): ``_settle`` hands it to the shaper in its place.
        self._unsent: list[CandidateFinish | None] = [None] * k
        if self._il is not None:
            self._il = _Inline()

    # ------------------------------------------------------------------ candidates
    # One lifecycle, two drivers: a task per candidate feeding the channel (``n`` > 1), or the
    # response task reading its single candidate itself (``_inline``). Both use the helpers
    # below for what happens at the edges: opening, turning bytes into events, errors,
    # aborting, and what the shaper must still see at the end.
    def _open(self, i: int, until: float = math.inf) -> Any:
        """The ``/generate`` stream of candidate ``i`` (an async context manager); its head
        must arrive within the token gap, and by ``until`` (``trio.TooSlowError``)."""
        head = self._g.token_gap_timeout
        if until < math.inf:
            head = max(min(head, until - trio.current_time()), 0.0)
        path, payload = protocol_for(self.replica.protocol).request(
            self._bodies[i], self.stats.endpoint, self.stats.model
        )
        return self._client.stream(self.replica.url, path, payload, head_timeout=head)

    def _reader(self) -> CandidateReader:
        """A new reader for one candidate's response, in the replica's protocol."""
        return protocol_for(self.replica.protocol).reader(
            incremental=self.replica.incremental, max_line=self._g.max_sse_line_bytes
        )

    def _gap_error(self, i: int) -> GatewayError:
        self._causes[i] = self._causes[i] or "timeout"
        return EngineTimeout(
            "The engine produced no token within the configured gap; the request was aborted."
        )

    def _deadline_error(self, i: int) -> GatewayError:
        self._causes[i] = "deadline"
        return EngineTimeout("The request exceeded its deadline and was aborted.")

    def _expired(self, i: int, reader: CandidateReader) -> GatewayError | None:
        """What a candidate's fired timer means: nothing if the engine already finished (it
        kept the body open), else the request deadline or the token gap, by the clock."""
        if reader.done:
            return None
        if trio.current_time() >= self._deadline:
            return self._deadline_error(i)
        return self._gap_error(i)

    def _events(
        self, i: int, raw: bytes, reader: CandidateReader
    ) -> tuple[list[Event], GatewayError | None]:
        """The events in one upstream read, and the error that ends the stream there if any
        (the events before it still count)."""
        events, err = reader.feed(raw)
        if reader.finished:
            self._terminal[i] = True
        return [(i, ev) for ev in events], err

    async def _abort(self, i: int, err: GatewayError | None) -> None:
        """``/abort_request`` for a candidate the engine may still be generating."""
        if self._aborted[i] or self._terminal[i]:
            return
        self._aborted[i] = True
        cause = self._causes[i] or ("error" if err is not None else "client")
        self.stats.abort_causes[cause] = self.stats.abort_causes.get(cause, 0) + 1
        call = protocol_for(self.replica.protocol).abort(self._bodies[i])
        if call is None:
            return  # closing the candidate's connection (on the way out) is the abort
        with trio.move_on_after(self._g.abort_timeout, shield=True):
            try:
                await self._client.post(self.replica.url, *call)
            except GatewayError:
                rid = self._bodies[i].get("rid")
                log.warning("abort of %s on %s failed", rid, self.replica.url)

    def _settle(
        self, i: int, reader: CandidateReader, err: GatewayError | None
    ) -> CandidateFinish | GatewayError | None:
        """What the shaper must still see of an ended candidate (and the replica's record;
        ``self.replica`` is the candidate's: a retry switches only after they all ended)."""
        cause = self._causes[i]
        if cause in ("stop", "best_of"):
            # The gateway ended this candidate; the shaper still needs its finish: the engine's
            # own if it was read (none if it is already in the channel: a cancel can land after
            # it was queued; the engine's if the cancel landed while its task waited for room to
            # queue it, ``_unsent``), else a local one.
            return self._unsent[i] if self._terminal[i] else reader.local_finish()
        if cause == "stall":
            # The writer of this response was parked when the candidate was aborted: should the
            # client read again, the stream ends with an error event, not a silent cut.
            return ClientStalled()
        if cause == "shutdown":  # see ``shut_down``
            return ServiceUnavailable(
                "The gateway is shutting down and stopped this generation before it finished; "
                "retry on another instance.",
                retry_after=self._g.retry_after,
            )
        if err is None:
            self._pool.record_success(self.replica)
            return None
        if isinstance(err, UpstreamError) and err.status >= 500:
            self._pool.record_failure(self.replica)
        if cause in ("client", "done", "retry", "error"):
            return None
        return err

    async def _candidate(
        self,
        i: int,
        send: trio.MemorySendChannel[Event],
        sent: Exchange | Exception | None = None,
    ) -> None:
        """Stream one candidate from the engine into the channel (theory: module docstring)."""
        scope = self._scopes[i]
        reader = self._reader()
        err: GatewayError | None = None
        opened = False
        with send:
            try:
                with scope:
                    try:
                        # From here the engine may be generating this rid: an early end aborts
                        # it, unless the engine itself refused it (no connection, an error
                        # status before any output).
                        opened = True
                        if isinstance(sent, Exception):  # open() could not send it
                            raise sent
                        async with sent or self._open(i) as resp:
                            await self._feed(i, resp, reader, send, scope)
                    except GatewayError as e:
                        err = e
                        if isinstance(e, EngineUnreachable | EngineHTTPError):
                            opened = False
                    except trio.TooSlowError:  # no response head within the gap
                        err = self._gap_error(i)
                if scope.cancelled_caught and self._causes[i] is None:
                    err = self._expired(i, reader)  # the request's deadline or the gap (_feed)
            finally:
                # Runs on every exit, including the client leaving (an outer cancellation).
                if opened:
                    await self._abort(i, err)
            last = self._settle(i, reader, err)
            if last is not None:
                await send.send((i, last))

    async def _feed(
        self,
        i: int,
        resp: UpstreamResponse,
        reader: CandidateReader,
        send: trio.MemorySendChannel[Event],
        scope: trio.CancelScope,
    ) -> None:
        """Read the candidate's body into the channel. The token gap is enforced by moving the
        deadline of the candidate's own ``scope`` (one scope fewer per candidate); the request
        deadline caps it."""
        gap = self._g.token_gap_timeout
        end = self._deadline
        # Moving a cancel scope's deadline costs a trio deadline-heap update; doing it for every
        # chunk was measurable. The deadline is moved when a chunk arrives and at least
        # ``slack`` has passed since the last move, so the gap limit fires between
        # ``gap - slack`` and ``gap`` after the last chunk.
        slack = gap * _GAP_SLACK
        receive = resp.receive
        clock = self._now
        moved = clock() + gap
        scope.deadline = min(end, moved)
        while raw := await receive():
            now = clock()
            if now + gap - moved > slack:
                moved = now + gap
                scope.deadline = min(end, moved)
            if reader.done:
                continue  # past [DONE]: read the body to its end so the connection is reused
            events, err = self._events(i, raw, reader)
            for ev in events:
                try:
                    send.send_nowait(ev)  # no yield: the next upstream read is the checkpoint
                except trio.WouldBlock:
                    await self._put_waiting(i, send, scope, ev, events)
                    moved = clock() + gap  # the gap counts again from the end of the wait
                    scope.deadline = min(end, moved)
            if err is not None:
                raise err
        reader.eof()

    async def _put_waiting(
        self,
        i: int,
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
        (always the read's last event), it is kept for ``_settle``."""
        scope.deadline = self._deadline
        try:
            await send.send(ev)
        except trio.Cancelled:
            last = events[-1][1]
            if isinstance(last, CandidateFinish):
                self._unsent[i] = last
            raise

    # ------------------------------------------------------------------ n = 1, inline
    async def open(self) -> bool:
        """Send the engine requests now: what the caller does before ``prime()`` then
        overlaps the engine's work on them (the response head's bytes, ``sieproxy.app``).
        ``prime()`` waits for the answers. True if every request went out.

        ``n`` = 1 (inline): a failure to send is kept for ``prime()``, which handles it as it
        would its own (a retry on another replica). ``n`` > 1: this task sends every
        candidate's request, one after the other, and then starts the candidates' tasks,
        which wait for the answers (``_launch``); a candidate whose request could not be sent
        fails in its task as if the task had sent it. Only requests that find a connection
        slot free are sent here: the rest are sent by their tasks, which can wait for one
        (this task would wait for a slot its own unread requests hold)."""
        il = self._il
        if il is None:
            return await self._send_candidates()
        if il.cm is not None or il.ended or self._causes[0] is not None:
            return False
        cm = self._inline_exchange()
        try:
            await cm.send()
        except (GatewayError, trio.TooSlowError) as exc:
            il.failed = exc
            return False
        return True

    async def _send_candidates(self) -> bool:
        if self._nursery is None or self._recv is not None:  # not entered, or launched
            return False
        sent: list[Exchange | Exception] = []
        try:
            for i in range(self._k):
                if not self._client.spare_connections:
                    break
                ex = self._open(i, until=self._deadline)
                try:
                    await ex.send()
                except (GatewayError, trio.TooSlowError) as exc:
                    sent.append(exc)
                else:
                    sent.append(ex)
        finally:
            # Also when cancelled here (the client left): the tasks let what was sent go
            # (each aborts its rid and closes its connection, as on any early end).
            self._launch(sent)
        return len(sent) == self._k and not any(isinstance(x, Exception) for x in sent)

    def _inline_exchange(self) -> Any:
        """The inline candidate's exchange with the engine (``il.cm``, not sent yet), and its
        reader."""
        il = self._il
        assert il is not None
        il.reader = self._reader()
        # The request's deadline bounds the opening through the client's own scope
        # (``until``): one cancel scope fewer on the way to the first token.
        il.cm = self._open(0, until=self._deadline)
        il.opened = True
        return il.cm

    def carry(self, out: Outlet) -> None:
        """The response head is out and ``out`` can write the body's chunks from another task:
        while the response task waits for the engine, the relay pump may relay them
        (``ride``; ``n`` = 1 only, and only with a pump)."""
        il = self._il
        if il is not None and self._pump is not None:
            il.out = out
            assert il.reader is not None  # made before the head
            il.express = il.reader.express(self._shaper)

    async def _inline_next(self) -> list[Event]:
        """The single candidate's next events, read by the response task itself (no task, no
        channel: one task switch and one buffer fewer per chunk); ``[]`` at its end. Errors
        come back as an event after the candidate was cleaned up."""
        il = self._il
        assert il is not None
        if il.ended:
            return []
        if self._causes[0] is not None:  # stopped or aborted from outside (stall)
            return await self._inline_end(None)
        gap = self._g.token_gap_timeout
        try:
            if il.resp is None:
                if il.cm is None:
                    self._inline_exchange()
                cm, failed, il.failed = il.cm, il.failed, None
                if failed is not None:  # ``open()`` could not send the request
                    il.cm = None
                    raise failed
                try:
                    il.resp = await cm.__aenter__()  # sends it first if ``open()`` did not
                except BaseException:
                    il.cm = None  # the exchange let its connection go
                    raise
                il.last = trio.current_time()
            resp, reader = il.resp, il.reader
            assert resp is not None and reader is not None
            timer = self._timer
            while True:
                # Bytes already there need no timer (a cancel scope per chunk was a measurable
                # cost): the timer bounds only a wait; the deadline is checked either way.
                stash = il.stash
                if stash is None:
                    raw = resp.receive_nowait()
                else:  # what the pump read and left to this task
                    il.stash = None
                    if isinstance(stash, Exception):
                        raise stash
                    raw = stash
                if raw is None:
                    limit = min(self._deadline, il.last + gap)
                    if timer is None or not timer.running:
                        with trio.move_on_at(limit) as scope:
                            await resp.wait_readable()
                        if not scope.cancelled_caught:
                            continue
                        return await self._inline_end(self._expired(0, reader))
                    if il.holder is None:
                        il.holder = [self]
                        timer.arm(limit, il.holder)
                    il.waiting = True
                    try:
                        pump, fd = self._pump, -1
                        if il.out is not None and pump is not None and pump.running:
                            fd = resp.fileno()
                        if fd < 0:
                            await resp.wait_readable()  # a fired timer: EngineTruncated, below
                        else:
                            assert pump is not None
                            await pump.park(fd, self)  # the pump relays what it can
                    finally:
                        il.waiting = False
                    if il.out is not None and il.out.pending:
                        # The pump's write did not complete: this is a client write, not a wait
                        # for the engine, so the timer must not close the engine's connection
                        # under it (and its time does not count in the gap, ``client_write``).
                        await self._flush(il.out)
                    if self._causes[0] is not None:  # the pump matched a stop string
                        return await self._inline_end(None)
                    continue
                now = self._now()
                if now >= self._deadline:
                    return await self._inline_end(self._deadline_error(0))
                if not raw:
                    reader.eof()
                    return await self._inline_end(None)
                il.last = now
                if reader.done:
                    continue  # past [DONE]: read the body to its end so the connection is reused
                events, err = self._events(0, raw, reader)
                if err is not None:
                    return events + await self._inline_end(err)
                if events:
                    return events
        except GatewayError as e:
            if il.fired and il.reader is not None:
                # The wait timer closed the connection (the gap or the deadline passed): that,
                # not the broken read it caused, is the error — also when bytes arrived in the
                # same instant and the read after the wake-up is the one that failed.
                return await self._inline_end(self._expired(0, il.reader))
            if isinstance(e, EngineUnreachable | EngineHTTPError) and il.resp is None:
                il.opened = False  # the engine did not take the request, or refused it
            return await self._inline_end(e)
        except trio.TooSlowError:  # no response head in time: by the deadline, or the gap
            assert il.reader is not None  # made before the opening
            return await self._inline_end(self._expired(0, il.reader))

    def ride(self) -> bool:
        """The relay pump's step for the inline reader (``sieproxy.pump``), run by the pump's
        task while the response task is parked in ``_inline_next``: what that loop and the
        response's write do for bytes that are there, as long as nothing else is needed. False
        hands the stream back: the end of the engine's body, an error, the deadline, a stop
        string, or a client write that did not complete at once. What was read and not handled
        is left in ``stash`` for ``_inline_next``, so nothing is lost or handled twice."""
        il = self._il
        if TYPE_CHECKING:  # not run: ``resp`` was set before the task parked, ``out`` by carry
            assert il is not None and il.resp is not None and il.out is not None
        resp, out = il.resp, il.out
        try:
            raw = resp.receive_nowait()
            if raw is None:
                return True  # a part of a frame: wait for the rest
            now = self._now()
            if not raw or now >= self._deadline:
                il.stash = raw
                return False
            il.last = now
            ex = il.express
            # The common token in one step (the reader's express lane) once the first token was
            # counted (its time is the request's time to first token); else, or for anything
            # the lane does not take, the general path, from the same bytes.
            frame = (
                ex.relay(raw) if ex is not None and self.stats.first_token_at is not None
                else None
            )
            if frame is not None:
                if frame and not out.write_nowait(frame):
                    return False  # the rest of the frame: the task flushes it
            elif not self._ride_general(raw):
                return False
            if resp.finished:  # the body ended in these bytes: no readiness will tell
                il.stash = b""
                return False
        except Exception as exc:  # raised in the response task, as if it had read the bytes
            il.stash = exc
            return False
        return self._causes[0] is None

    def _ride_general(self, raw: bytes) -> bool:
        """``ride``'s general path for a read the express lane did not take: False hands the
        stream back (an error, kept in ``stash``; or a write that did not complete)."""
        il = self._il
        assert il is not None and il.out is not None
        reader = il.reader
        assert reader is not None
        if reader.done:  # past [DONE]: read the body to its end (connection reuse)
            return True
        events, err = self._events(0, raw, reader)
        if err is not None:
            il.stash = err
        if events and not il.out.write_nowait(self._merge(events)):
            return False  # the rest of the frame: the task flushes it
        return err is None

    async def _flush(self, out: Outlet) -> None:
        """Send what the pump's last write left, before anything else is written."""
        await self.client_write(out.flush())

    async def client_write(self, sending: Awaitable[_T]) -> _T:
        """Await ``sending``, a write to the client, as a parked write: while it waits, the
        stall sweeper sees since when (``writing_since``, ``check_stall``).

        The token gap measures the engine's silence only: the time an inline reader spends in
        a client write does not count (a client that reads slowly blocks the write, and the
        engine, unread meanwhile, may be blocked by TCP in turn). The gap clock is paused for
        the write's duration (``_Inline.last`` moves later by it), so the wait timer does not
        take a slow client for a silent engine; a client that stops reading is reported as
        stalled, by the stall sweeper, whatever the two limits are. (Candidates of a channel
        lift their gap while their queue is full instead, ``_put_waiting``.)"""
        now = self._now  # the run's clock: cheaper than ``trio.current_time``
        since = self.writing_since = now()
        try:
            return await sending
        finally:
            self.writing_since = None
            il = self._il
            if il is not None:
                il.last += now() - since

    async def _inline_end(self, err: GatewayError | None) -> list[Event]:
        """End the inline candidate: abort it upstream if the engine may still be generating,
        release its connection, and return what the shaper must still see."""
        il = self._il
        assert il is not None
        await self._inline_close(err)
        reader = il.reader or self._reader()
        last = self._settle(0, reader, err)
        return [] if last is None else [(0, last)]

    def timer_due(self, now: float) -> float | None:
        """The :class:`WaitTimer` entry of the inline reader is due: the time to re-arm it at,
        or None (the limit passed: if the reader waits, close its connection to wake it)."""
        il = self._il
        assert il is not None
        limit = min(self._deadline, il.last + self._g.token_gap_timeout)
        if limit > now:
            return limit  # still armed: the timer re-pushes the same holder
        il.holder = None  # the timer dropped the entry
        if il.waiting and il.resp is not None:
            il.fired = True
            if self._pump is not None:  # out of the pump (if parked) before its socket closes
                self._pump.unpark(il.resp.fileno())
            il.resp.close()
        return None

    async def _inline_close(self, err: GatewayError | None = None) -> None:
        il = self._il
        if il is None or il.ended:
            return
        il.ended = True
        if il.holder is not None:
            assert self._timer is not None
            il.holder[0] = None  # the timer's entry no longer keeps this body alive
            self._timer.drop()
        if il.opened:
            await self._abort(0, err)
        cm, il.cm, il.resp = il.cm, None, None
        if cm is not None:
            with trio.CancelScope(shield=True):
                await cm.__aexit__(None, None, None)

    def _cancel(self, i: int, cause: str) -> None:
        if self._causes[i] is None:
            self._causes[i] = cause
        if i < len(self._scopes):
            self._scopes[i].cancel()

    def _cancel_all(self, cause: str) -> None:
        for i in range(self._k):
            if not self._terminal[i]:
                self._cancel(i, cause)

    def check_stall(self, now: float) -> bool:
        """Abort every candidate when one client write has been parked too long. True when
        the caller must run :meth:`abort_stalled` (an inline candidate has no task to cancel:
        its reader is the stalled response task)."""
        since = self.writing_since
        if since is None or now - since <= self._g.client_stall_timeout or self._done:
            return False
        if self._il is not None and self._causes[0] is not None:
            return False  # already ended or stalled
        log.info("request %s: client stalled; aborting upstream", self.stats.request_id)
        self._cancel_all("stall")
        return self._il is not None

    def shut_down(self) -> None:
        """The gateway's shutdown grace is over: end this request now. Every candidate is
        aborted upstream, as when the client leaves, and the client gets a 503 "shutting down"
        error — an SSE error event and ``[DONE]`` once a stream has started — instead of a cut
        connection. An inline reader waiting for the engine is woken (its connection closed, as
        the wait timer does); one busy relaying stops at its next wait."""
        if not self.entered or self._done:
            return
        self._cancel_all("shutdown")
        il = self._il
        if il is not None and il.waiting and il.resp is not None:
            if self._pump is not None:  # out of the pump (if parked) before its socket closes
                self._pump.unpark(il.resp.fileno())
            il.resp.close()

    async def abort_stalled(self) -> None:
        """The inline candidate of a stalled client: close its upstream connection (nobody
        reads it while the response task is parked in the client write, and an engine blocked
        writing to it would not end the generation) and abort it upstream."""
        il = self._il
        if il is not None and il.resp is not None:
            il.resp.close()
        await self._abort(0, None)

    # ------------------------------------------------------------------ merging
    def _handle(self, ev: Event) -> bytes:
        i, item = ev
        if not isinstance(item, GatewayError):
            self._handled_any = True
        if isinstance(item, CandidateDelta):
            if self.stats.first_token_at is None and item.text:
                self.stats.first_token_at = trio.current_time()
            out = self._shaper.on_delta(i, item)
            if self._shaper.stopped(i):
                self._cancel(i, "stop")
        elif isinstance(item, CandidateFinish):
            out = self._shaper.on_finish(i, item)
        elif isinstance(item, UpstreamError) and item.refusal is not None:
            # The engine refused the request: said in the request's own field names.
            raise explain(item.refusal, self._fields) from item
        else:
            raise item
        if self._losers is not None:
            for j in self._losers():
                if not self._terminal[j]:
                    self._cancel(j, "best_of")
        return out

    async def _next_frames(self) -> bytes | None:
        """One merged write: the next events that arrived together (None at the end)."""
        if self._deferred is not None:  # an error drained behind frames: raised now
            ev, self._deferred = self._deferred, None
            return self._handle(ev)
        if self._il is not None:  # the events of one upstream read
            events = await self._inline_next()
            if not events:
                return None
            out = self._merge(events)
            if self._causes[0] == "stop":  # the gateway matched a stop string: end it now
                out += self._merge(await self._inline_next())
            return out
        if self._recv is None:  # open() was not called: the tasks send their requests
            self._launch()
        assert self._recv is not None
        try:
            first = await take(self._recv)  # the response's next write yields
        except trio.EndOfChannel:
            return None
        return self._merge(self._buffered(first))

    def _buffered(self, first: Event) -> Iterator[Event]:
        """``first``, then every event already in the channel (taken only as consumed)."""
        assert self._recv is not None
        yield first
        while True:
            try:
                yield self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return

    def _merge(self, events: Iterable[Event]) -> bytes:
        """The frames of events that arrived together. An error ends the response: one that
        follows other events is kept for the next write, so what came before it goes first."""
        if type(events) is list and len(events) == 1:  # most reads: one token (never deferred)
            return self._handle(events[0])
        out = b""
        for k, ev in enumerate(events):
            if k and isinstance(ev[1], GatewayError):
                self._deferred = ev
                break
            out += self._handle(ev)
        return out

    async def prime(self) -> bytes:
        """Wait for the first upstream event (streaming) or the whole answer (not streaming).

        Raises the error that decides the status line if the engine failed before any byte went
        to the client; retries once on another ready replica when that error is retryable.
        """
        retried = False
        head = self._shaper.start()  # role chunks; sent only if the engine answers
        while True:
            try:
                if self.streaming:
                    first = await self._next_frames()
                    if first is None:
                        self._done = True
                        return head + self._shaper.end()
                    return head + first
                out = b""
                while (frames := await self._next_frames()) is not None:
                    out += frames
                self._done = True
                return out + self._shaper.end()
            except UpstreamError as exc:
                # Nothing reached the client yet: a server-side failure is retried once on
                # another ready replica, then on the model's fallbacks in order (each once); a
                # refusal of the request itself (4xx) is not, nor a timeout: the engine took
                # the request (a model may be working on it) and the client already waited the
                # whole gap or its deadline for it.
                if (
                    self._handled_any
                    or isinstance(exc, EngineTimeout)
                    or not (exc.retryable or exc.status >= 500)
                ):
                    raise
                other = None if retried else await self._other_replica()
                if other is not None:
                    retried = True
                    self.stats.retried = True
                    await self._restart_on(other)
                    continue
                route = None
                if self._fallback is not None:
                    route = await self._fallback("failed", self.replica)
                if route is None:
                    raise
                await self._restart_on(route.replica, route)
                head = self._shaper.start()

    async def _other_replica(self) -> Replica | None:
        try:
            return await self._pool.acquire(self._hints, self._k, exclude=self.replica)
        except GatewayError:
            return None

    async def _restart_on(self, other: Replica, route: Route | None = None) -> None:
        self._cancel_all("retry")
        self._deferred = None
        if self._il is not None:
            await self._inline_close()
            self._switch_to(other, route)
            self._reset_candidates()
            return
        assert self._recv is not None
        with self._recv:
            async for _ in self._recv:  # wait for the old candidates to finish their cleanup
                pass
        self._switch_to(other, route)
        self._launch()

    def _switch_to(self, other: Replica, route: Route | None = None) -> None:
        self._release()
        if route is not None:  # a fallback: its model's pool, bodies and shaper from now on
            assert len(route.bodies) == self._k
            self._pool, self._hints = route.pool, route.hints
            self._bodies, self._shaper, self._losers = route.bodies, route.shaper, route.losers
            self.stats.model = route.model
        self.replica = other
        self._held = self._k
        self.stats.replica = other.url

    @property
    def done(self) -> bool:
        """Nothing more to send after what the body last returned: ``prime()``'s whole answer,
        or a stream's last frames (``[DONE]``, or an error event and ``[DONE]``)."""
        return self._done

    def __aiter__(self) -> GenerationBody:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        try:
            frames = await self._next_frames()
        except GatewayError as exc:
            self._done = True
            self._cancel_all("error")
            self.stats.error = exc
            return self._shaper.on_error(exc)
        except Exception:  # a bug in the core must not cut the stream silently
            log.exception("request %s: merger failed", self.stats.request_id)
            self._done = True
            self._cancel_all("error")
            err = InternalError("The gateway failed while relaying this response.")
            self.stats.error = err
            return self._shaper.on_error(err)
        if frames is None:
            self._done = True
            return self._shaper.end()
        return frames
