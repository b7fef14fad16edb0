"""The per-process timers of in-flight requests: the inline readers' wait timer and the stall
sweeper. One task each per process (``serve.build_app`` starts them), not one per request.

:class:`WaitTimer` bounds the waits of inline candidates (``n`` = 1, ``sieproxy.inline``) for
the engine: the token gap and the request deadline. A trio cancel scope per upstream wait cost
7–12 µs on the benchmark machine, ~8 % of a relayed chunk's CPU at 64 clients. Instead, a
waiting reader makes sure it has one entry in this heap, at a time no later than its limit
(``min(deadline, last bytes + gap)``); as bytes arrive its limit only moves later, so a wait
usually costs two attribute writes. The task sleeps until the earliest entry. An entry that is
due asks its reader (:meth:`Timed.timer_due`): the reader re-arms at its current limit if that
is later; if the limit has passed while the reader is parked waiting, the reader closes its
upstream connection, which wakes it, and it reports the gap or the deadline. A reader that is
not waiting when its limit passes re-arms at the passed limit on its next wait, which fires at
once. The timer fires at the limit, not at the next sweep. An ended reader empties its entry's
holder (so the heap keeps no request alive); the heap is rebuilt without such entries once they
are half of it. A reader used where no timer task runs (an app built without ``serve``'s
background tasks) keeps a cancel scope per wait.

:func:`sweep_stalls` aborts the candidates of a request whose single client write has been
parked longer than ``client_stall_timeout`` (Hypercorn shields socket writes, so the write
itself may outlive cancellation; the GPU time is freed regardless).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable
from typing import Protocol

import trio

__all__ = ["Stallable", "Timed", "WaitTimer", "sweep_stalls"]


class Timed(Protocol):
    """A reader with an entry in the :class:`WaitTimer`."""

    def timer_due(self, now: float) -> float | None:
        """The entry is due: the time to re-arm it at, or None (it fired, or the reader
        ended)."""
        ...


class Stallable(Protocol):
    """A request the stall sweeper watches (``relay.GenerationBody``)."""

    def check_stall(self, now: float) -> bool: ...

    async def abort_stalled(self) -> None: ...


#: A timer entry's holder: the reader while it has an entry, emptied when the reader ends.
Holder = list["Timed | None"]


async def sweep_stalls(active: Iterable[Stallable], limit: float) -> None:
    """Check every in-flight request for a stalled client write, every quarter of the stall
    limit; run :meth:`Stallable.abort_stalled` where the check says so."""
    async with trio.open_nursery() as nursery:
        while True:
            await trio.sleep(max(limit / 4, 0.05))
            now = trio.current_time()
            for body in list(active):
                if body.check_stall(now):
                    nursery.start_soon(body.abort_stalled)


class WaitTimer:
    """The token-gap and deadline timer of inline readers (see the module docstring)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Holder]] = []
        self._seq = itertools.count()
        self._sleep: trio.CancelScope | None = None
        self._dead = 0
        self.running = False

    def __len__(self) -> int:
        return len(self._heap)

    def arm(self, at: float, holder: Holder) -> None:
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
                    reader = holder[0]
                    if reader is None:
                        self._dead -= 1
                        continue
                    again = reader.timer_due(now)
                    if again is not None:
                        heapq.heappush(heap, (again, next(self._seq), holder))
                with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as sleep:
                    self._sleep = sleep
                    await trio.sleep_forever()
                self._sleep = None
        finally:
            self.running = False
            self._sleep = None
