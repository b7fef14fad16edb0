"""One candidate of a request, as a state table, and the token step every driver uses.

A candidate's lifecycle, from the gateway's side (:data:`TRANSITIONS`)::

    NEW ─send─▶ SENT ─head─▶ STREAMING ─finish─▶ FINISHED     (the engine ended it)
    NEW | SENT | STREAMING ─stop─▶ STOPPED        (the gateway ended it; its finish is shown:
                                                   a stop string matched, a best_of loser)
    NEW | SENT | STREAMING ─cancel─▶ CANCELLED    (client gone, deadline, gap, stall, retry,
                                                   shutdown, the response ended)
    NEW | SENT | STREAMING ─fail─▶ FAILED         (an error ended it)

An ended candidate stays in its phase whatever still arrives (a finish read after the gateway
stopped it is recorded in ``engine_done``: the shaper gets the engine's finish, not a local
one). Every driver — the candidate task of ``n`` > 1 (``sieproxy.attempt``), the inline
reader of ``n`` = 1 (``sieproxy.inline``) and the relay pump's step — turns engine bytes into
events with the one token step, :meth:`Candidate.step`, and ends a candidate only through
:meth:`Candidate.end` (a decision of the gateway, with its cause) or through what the engine
sent.
"""

from __future__ import annotations

import enum

import trio

from ..core.errors import GatewayError
from ..core.shaping.events import CandidateDelta, CandidateFinish
from ..core.upstream.protocol import CandidateReader

__all__ = ["SHOWN", "TRANSITIONS", "Candidate", "Event", "Phase", "Step"]

Event = tuple[int, CandidateDelta | CandidateFinish | GatewayError]


class Phase(enum.Enum):
    NEW = "new"
    SENT = "sent"
    STREAMING = "streaming"
    FINISHED = "finished"
    STOPPED = "stopped"
    CANCELLED = "cancelled"
    FAILED = "failed"


class Step(enum.Enum):
    SEND = "send"  # the request may reach the engine
    HEAD = "head"  # the engine's response head arrived
    FINISH = "finish"  # the engine's terminal event was read
    STOP = "stop"  # the gateway ended it and shows its finish (stop string, best_of loser)
    CANCEL = "cancel"  # the gateway ended it for any other cause
    FAIL = "fail"  # an error ended it


#: Causes of :meth:`Candidate.end` after which the candidate's finish still goes to the shaper.
SHOWN = frozenset({"stop", "best_of"})
_LIVE = (Phase.NEW, Phase.SENT, Phase.STREAMING)
_ENDED = (Phase.FINISHED, Phase.STOPPED, Phase.CANCELLED, Phase.FAILED)

TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (Phase.NEW, Step.SEND): Phase.SENT,
    (Phase.SENT, Step.HEAD): Phase.STREAMING,
    (Phase.STREAMING, Step.FINISH): Phase.FINISHED,
    **{(p, Step.STOP): Phase.STOPPED for p in _LIVE},
    **{(p, Step.CANCEL): Phase.CANCELLED for p in _LIVE},
    **{(p, Step.FAIL): Phase.FAILED for p in _LIVE},
    # An ended candidate stays ended: what still arrives changes nothing.
    **{(p, s): p for p in _ENDED for s in Step},
}


class Candidate:
    """One candidate's state: its phase, why the gateway ended it, and its reader."""

    __slots__ = (
        "aborted",
        "cause",
        "engine_done",
        "heard",
        "index",
        "phase",
        "reader",
        "scope",
        "sent",
    )

    def __init__(self, index: int, reader: CandidateReader) -> None:
        self.index = index
        self.reader = reader
        self.phase = Phase.NEW
        self.cause: str | None = None  # why the gateway ended it (the first cause counts)
        self.engine_done = False  # the engine's terminal event was read
        self.sent = False  # the engine may be generating it (an early end aborts it)
        self.heard = False  # a chunk of its stream arrived (the first-token limit is over)
        self.aborted = False  # its abort went out
        self.scope: trio.CancelScope | None = None  # its task's scope (``n`` > 1)

    def to(self, step: Step) -> None:
        self.phase = TRANSITIONS[self.phase, step]

    def mark_sent(self) -> None:
        """The request is on its way: from here an early end aborts it."""
        self.sent = True
        self.to(Step.SEND)

    def restart(self, reader: CandidateReader) -> None:
        """The candidate continues on a new attempt (a resume of its broken stream,
        ``sieproxy.relay.resume``): live again, read by ``reader``."""
        self.reader = reader
        self.phase = Phase.NEW
        self.cause = None
        self.engine_done = self.sent = self.heard = self.aborted = False

    def refused(self) -> None:
        """The engine did not take the request (no connection, an error status): nothing to
        abort."""
        self.sent = False

    def step(self, raw: bytes) -> tuple[list[Event], GatewayError | None]:
        """The token step: the events in one upstream read, and the error that ends the stream
        there if any (the events before it still count). Past the stream's end marker the
        bytes are dropped (the body is read to its end so the connection is reused)."""
        reader = self.reader
        if reader.done:
            return [], None
        self.heard = True
        events, err = reader.feed(raw)
        if reader.finished and not self.engine_done:
            self.engine_done = True
            self.to(Step.FINISH)
        i = self.index
        return [(i, ev) for ev in events], err

    def end(self, cause: str) -> None:
        """The gateway ends this candidate (the first cause counts); its task, if any, is
        cancelled."""
        if self.cause is None:
            self.cause = cause
            self.to(Step.STOP if cause in SHOWN else Step.CANCEL)
        if self.scope is not None:
            self.scope.cancel()
