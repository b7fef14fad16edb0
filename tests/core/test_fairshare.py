"""core.fairshare: priority classes first, then start-time fair queuing across tenants."""

from __future__ import annotations

from sieproxy.core.tenancy.fairshare import FairShare, Ticket


def order(fs: FairShare, waiting: list[tuple[Ticket, int, float]], now: float = 0.0) -> list[int]:
    """The seqs of ``waiting`` (ticket, seq, since) in the order they would be granted, each
    grant charging its tenant as the shell does."""
    left, out = list(waiting), []
    while left:
        best = min(left, key=lambda w: fs.rank(w[0], w[1], w[2], now))
        left.remove(best)
        fs.charge(best[0])
        out.append(best[1])
    return out


def test_a_tenant_that_took_the_slots_ranks_behind_one_that_did_not() -> None:
    fs = FairShare()
    a, b = Ticket("A", cost=100), Ticket("B", cost=100)
    for _ in range(4):  # A holds every slot
        fs.charge(a)
    waiting = [(a, 1, 0.0), (a, 2, 0.0), (a, 3, 0.0), (b, 4, 0.0)]
    assert order(fs, waiting)[0] == 4


def test_queued_tenants_alternate_and_each_keeps_its_own_order() -> None:
    fs = FairShare()
    a, b = Ticket("A", cost=10), Ticket("B", cost=10)
    waiting = [(a, 1, 0.0), (a, 2, 0.0), (a, 3, 0.0), (b, 4, 0.0), (b, 5, 0.0)]
    assert order(fs, waiting) == [1, 4, 2, 5, 3]


def test_share_follows_tokens_and_weight() -> None:
    fs = FairShare()
    big, small = Ticket("A", cost=400), Ticket("B", cost=100)
    waiting = [(big, i, 0.0) for i in range(3)] + [(small, 10 + i, 0.0) for i in range(8)]
    got = order(fs, waiting)
    assert got[:6] == [0, 10, 11, 12, 13, 1]  # B's four small requests per A's big one
    fs = FairShare()
    heavy, light = Ticket("A", cost=100, weight=3.0), Ticket("B", cost=100)
    got = order(fs, [(heavy, i, 0.0) for i in range(6)] + [(light, 10 + i, 0.0) for i in range(2)])
    assert got[:5] == [0, 10, 1, 2, 3]  # three of A's per one of B's


def test_interactive_before_batch_even_when_batch_came_first() -> None:
    fs = FairShare()
    batch, inter = Ticket("A", "batch", 10), Ticket("B", "interactive", 10)
    assert order(fs, [(batch, 1, 0.0), (inter, 2, 0.0)]) == [2, 1]


def test_a_batch_request_ranks_as_interactive_after_promote_after() -> None:
    fs = FairShare(promote_after=5.0)
    batch, inter = Ticket("A", "batch", 10), Ticket("B", "interactive", 10)
    assert fs.rank(batch, 1, 0.0, 4.9)[0] == 1
    assert fs.rank(batch, 1, 0.0, 5.0)[0] == 0
    assert order(fs, [(batch, 1, 0.0), (inter, 2, 4.0)], now=6.0) == [1, 2]


def test_an_idle_tenant_saves_no_credit() -> None:
    fs = FairShare()
    a, b = Ticket("A", cost=10), Ticket("B", cost=10)
    for _ in range(50):
        fs.charge(a)  # B idle all along
    waiting = [(b, i, 0.0) for i in range(3)] + [(a, 10 + i, 0.0) for i in range(3)]
    got = order(fs, waiting)
    # B comes back level with A (one request ahead: A's last one is still being served), not
    # ahead by the 50 requests it did not send
    assert got == [0, 1, 10, 2, 11, 12]
