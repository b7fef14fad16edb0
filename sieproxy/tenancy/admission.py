"""Requests waiting for a replica slot, granted in fair-share order (``core.fairshare``).

A model's pool (sieproxy/fleet/pool.py) keeps one :class:`AdmissionQueue`. A request that finds no
replica with room waits in it; whenever capacity may have appeared (a slot released, a replica
ready or back) the pool calls :meth:`AdmissionQueue.dispatch`, which walks the waiting requests
in rank order (priority class, then the tenant's fair-share tag, then arrival) and hands each
one that a replica can take its slot directly — no waiting task races another for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from ..core.tenancy.fairshare import FairShare, Ticket

__all__ = ["AdmissionQueue", "Waiter"]

#: ``choose(hints, k, exclude) -> (replica or None, any replica live)``: the pool's routing.
Choose = Callable[[Any, int, Any], tuple[Any, bool]]


@dataclass(eq=False, slots=True)
class Waiter:
    ticket: Ticket
    hints: Any
    k: int
    exclude: Any
    seq: int
    since: float
    event: trio.Event = field(default_factory=trio.Event)
    replica: Any = None  # the granted replica (its slots already taken)
    gone: bool = False  # no matching replica is live any more


class AdmissionQueue:
    def __init__(self, fair: FairShare) -> None:
        self.fair = fair
        self.waiters: list[Waiter] = []
        self._seq = itertools.count()

    def add(self, ticket: Ticket, hints: Any, k: int, exclude: Any) -> Waiter:
        w = Waiter(ticket, hints, k, exclude, next(self._seq), trio.current_time())
        self.waiters.append(w)
        return w

    async def wait(
        self,
        ticket: Ticket,
        hints: Any,
        k: int,
        exclude: Any,
        timeout: float,
        release: Callable[[Any, int], None],
    ) -> Any:
        """Wait up to ``timeout`` s for a slot: the granted replica (its slots taken), or None.
        Cancelled as it was granted, the slots go back (``release``)."""
        w = self.add(ticket, hints, k, exclude)
        try:
            with trio.move_on_after(timeout):
                await w.event.wait()
        except BaseException:
            if w.replica is not None:
                release(w.replica, k)
            raise
        finally:
            self.remove(w)
        return w.replica

    def remove(self, w: Waiter) -> None:
        if w in self.waiters:
            self.waiters.remove(w)

    def dispatch(self, choose: Choose) -> None:
        """Grant free slots to the waiting requests, best ranked first."""
        if not self.waiters:
            return
        now = trio.current_time()
        ranked = sorted(self.waiters, key=lambda w: self.fair.rank(w.ticket, w.seq, w.since, now))
        for w in ranked:
            r, live = choose(w.hints, w.k, w.exclude)
            if r is None:
                if not live:
                    w.gone = True
                    self.waiters.remove(w)
                    w.event.set()
                continue
            r.inflight += w.k
            r.total += w.k
            w.replica = r
            self.fair.charge(w.ticket)
            self.waiters.remove(w)
            w.event.set()
