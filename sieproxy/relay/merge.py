"""The merger of one request: candidate events in, the client's frames out, through the
sans-IO response shaper; the shaper's decisions (``Shaper.ends``) applied to the candidates.

Events that arrived together (one upstream read of an inline candidate, or what a channel held
at once) become one write: :meth:`Merger.merge`. An error ends the response; one that follows
other events is kept (``deferred``) so that what came before it is written first. A refusal by
the engine (an ``UpstreamError`` with a ``refusal``) is said in the request's own field names
(``core.refusal.explain``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, cast

import trio

from ..core.errors import GatewayError, UpstreamError
from ..core.planning.prepared import Shaper
from ..core.request.refusal import RequestFields, explain
from ..core.shaping.events import CandidateDelta, CandidateFinish
from ..observe.stats import RequestStats
from .attempt import Attempt
from .candidate import Event

__all__ = ["Merger", "Pinging", "buffered"]


class Pinging(Protocol):
    """A shaper that sends keep-alives while its stream waits (``pings`` true: the Messages
    API's ``ping`` events; sieproxy/relay/inline.py decides when)."""

    pings: bool

    def ping(self) -> bytes: ...


class Merger:
    """Turns one request's events into frames (see the module docstring)."""

    __slots__ = ("deferred", "ends", "fields", "handled_any", "shaper", "stats", "up")

    def __init__(
        self, shaper: Shaper, up: Attempt, stats: RequestStats, fields: RequestFields
    ) -> None:
        self.shaper = shaper
        self.ends = shaper.ends
        self.up = up  # the candidates the decisions apply to (a retry replaces it)
        self.stats = stats  # the time to first token
        self.fields = fields
        self.handled_any = False  # an engine event reached the shaper (no retry after that)
        self.deferred: Event | None = None  # an error drained after frames; raised next

    def reshape(self, shaper: Shaper) -> None:
        """A fallback's shaper from now on."""
        self.shaper, self.ends = shaper, shaper.ends

    def handle(self, ev: Event) -> bytes:
        i, item = ev
        if isinstance(item, CandidateDelta):
            self.handled_any = True
            if self.stats.first_token_at is None and item.text:
                self.stats.first_token_at = trio.current_time()
                if self.stats.on_first_token is not None:
                    self.stats.on_first_token()
            out = self.shaper.on_delta(i, item)
        elif isinstance(item, CandidateFinish):
            self.handled_any = True
            out = self.shaper.on_finish(i, item)
        elif isinstance(item, UpstreamError) and item.refusal is not None:
            # The engine refused the request: said in the request's own field names.
            raise explain(item.refusal, self.fields) from item
        else:
            raise item
        if self.ends:
            self._decide()
        return out

    def _decide(self) -> None:
        """End the candidates the core decided to end: a stop string matched (always), a
        best_of loser (if its engine has not ended it already)."""
        cands = self.up.cands
        for j, cause in self.ends:
            c = cands[j]
            if cause == "stop" or not c.engine_done:
                c.end(cause)
        self.ends.clear()

    def merge(self, events: Iterable[Event]) -> bytes:
        """The frames of events that arrived together (see the module docstring)."""
        if type(events) is list and len(events) == 1:  # most reads: one token (never deferred)
            return self.handle(events[0])
        out = b""
        for k, ev in enumerate(events):
            if k and isinstance(ev[1], GatewayError):
                self.deferred = ev
                break
            out += self.handle(ev)
        return out

    def ping(self) -> bytes:
        """The shaper's keep-alive frames. They may be the response's first bytes (the engine is
        slow to its first output): from then on nothing is retried, as after any first byte."""
        self.handled_any = True
        return cast(Pinging, self.shaper).ping()

    def take_deferred(self) -> bytes | None:
        """The frames of an error drained behind frames (raised now), or None."""
        ev = self.deferred
        if ev is None:
            return None
        self.deferred = None
        return self.handle(ev)


def buffered(recv: trio.MemoryReceiveChannel[Event], first: Event) -> Iterator[Event]:
    """``first``, then every event already in the channel (taken only as consumed)."""
    yield first
    while True:
        try:
            yield recv.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return
