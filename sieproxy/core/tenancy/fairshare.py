"""The order in which requests waiting for admission get a free slot: by priority class, then
fairly across tenants.

Sans-IO: the shell (sieproxy/tenancy/admission.py) keeps the waiting requests and asks
:meth:`FairShare.rank` for their order each time capacity appears.

- **Priority classes**: every waiting ``interactive`` request comes before every waiting
  ``batch`` one; a ``batch`` request gets a slot only when no interactive request waiting can
  use it (it runs on spare capacity and is the first to wait). It is not starved: it takes the
  first slot no interactive request wants, and a ``batch`` request that has waited
  ``promote_after`` seconds ranks as interactive.
- **Fair share within a class**: start-time fair queuing on tokens. Every admitted request
  (waited for or not) charges its tenant ``cost / weight`` (its reserved tokens over the
  tenant's weight); the tenant's *finish tag* is where its last charge ended, and the system's
  *virtual time* is the start tag of the last admission. A waiting request ranks by its
  tenant's start tag ``max(virtual time, finish tag)``: a tenant that has taken many slots
  lately ranks behind one that has not, so a tenant flooding the fleet cannot starve another's
  traffic; an idle tenant comes back at the virtual time (no credit is saved up while idle).
  A tenant's own requests keep their arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRIORITIES", "FairShare", "Ticket"]

#: The priority classes, first served first.
PRIORITIES = ("interactive", "batch")


@dataclass(frozen=True, slots=True)
class Ticket:
    """Who asks for admission: the tenant, its class and weight, and the request's cost."""

    tenant: str = ""
    priority: str = "interactive"
    cost: int = 1
    weight: float = 1.0


class FairShare:
    """The virtual clock and the tenants' finish tags."""

    def __init__(self, promote_after: float = 30.0) -> None:
        self.promote_after = promote_after
        self._virtual = 0.0
        self._finish: dict[str, float] = {}

    def start_tag(self, tenant: str) -> float:
        return max(self._virtual, self._finish.get(tenant, 0.0))

    def rank(
        self, ticket: Ticket, seq: int, waited_since: float, now: float
    ) -> tuple[int, float, int]:
        """Sort key of a waiting request (smaller first); ``seq`` is its arrival order."""
        cls = PRIORITIES.index(ticket.priority) if ticket.priority in PRIORITIES else 0
        if cls and now - waited_since >= self.promote_after:
            cls = 0
        return cls, self.start_tag(ticket.tenant), seq

    def charge(self, ticket: Ticket) -> None:
        """``ticket`` was admitted: advance the virtual time and its tenant's finish tag."""
        start = self.start_tag(ticket.tenant)
        self._virtual = start
        self._finish[ticket.tenant] = start + max(1, ticket.cost) / max(ticket.weight, 1e-9)
        if len(self._finish) > 1024:  # tags at or behind the virtual time are the default
            self._finish = {t: f for t, f in self._finish.items() if f > self._virtual}
