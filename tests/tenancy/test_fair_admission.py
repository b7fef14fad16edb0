"""Fair-share admission in a model's pool: with every slot busy, waiting requests get freed
slots by priority class, then fairly across tenants (sieproxy/tenancy/admission.py)."""

from __future__ import annotations

import trio
import trio.testing

from sieproxy.core.tenancy.fairshare import Ticket
from sieproxy.fleet.pool import ModelPool, Replica, RouteHints
from tests.core.test_pool_unit import make_pool

H = RouteHints()


async def _queue(pool: ModelPool, tickets: list[Ticket], order: list[str], names: list[str],
                 nursery: trio.Nursery) -> None:  # fmt: skip
    """Start one waiting acquire per ticket (in list order) and wait until all are queued."""
    for ticket, name in zip(tickets, names, strict=True):

        async def wait(t: Ticket = ticket, n: str = name) -> None:
            await pool.acquire(H, 1, ticket=t)
            order.append(n)

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
    assert pool.waiting == len(tickets)


async def test_tenant_b_gets_the_next_free_slot_not_behind_a_queue() -> None:
    pool = make_pool(1, replica_max_inflight=2, admission_wait=30)
    a = Ticket("A", cost=100)
    held: list[Replica] = [await pool.acquire(H, 1, ticket=a) for _ in range(2)]  # A fills it
    order: list[str] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await _queue(pool, [a, a, a, Ticket("B", cost=100)], order, ["a1", "a2", "a3", "b"],
                         nursery)  # fmt: skip
            pool.release(held.pop(), 1)  # the next free slot
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["b"]
            for _ in range(3):
                pool.release(pool.replicas[0], 1)
                await trio.testing.wait_all_tasks_blocked()
            assert order == ["b", "a1", "a2", "a3"]  # A's own requests keep their order


async def test_a_later_interactive_request_goes_before_an_earlier_batch_one() -> None:
    pool = make_pool(1, replica_max_inflight=1, admission_wait=30)
    r = await pool.acquire(H, 1, ticket=Ticket("A", cost=10))
    order: list[str] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            tickets = [Ticket("A", "batch", 10), Ticket("A", "batch", 10),
                       Ticket("B", "interactive", 10)]  # fmt: skip
            await _queue(pool, tickets, order, ["batch1", "batch2", "inter"], nursery)
            pool.release(r, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["inter"]
            # batch is not starved: it runs as soon as no interactive request waits
            pool.release(r, 1)
            await trio.testing.wait_all_tasks_blocked()
            pool.release(r, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["inter", "batch1", "batch2"]


async def test_a_waiting_batch_request_is_promoted_after_batch_promote_after() -> None:
    pool = make_pool(1, replica_max_inflight=1, admission_wait=60, batch_promote_after=5)
    r = await pool.acquire(H, 1)
    order: list[str] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await _queue(pool, [Ticket("A", "batch", 10)], order, ["batch"], nursery)
            pool.queue.waiters[0].since -= 5  # it has waited batch_promote_after
            await _queue_more(pool, nursery, order)
            pool.release(r, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["batch"]
            pool.release(r, 1)
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["batch", "inter"]


async def _queue_more(pool: ModelPool, nursery: trio.Nursery, order: list[str]) -> None:
    async def wait() -> None:
        await pool.acquire(H, 1, ticket=Ticket("B", "interactive", 10))
        order.append("inter")

    nursery.start_soon(wait)
    await trio.testing.wait_all_tasks_blocked()
    assert pool.waiting == 2


async def test_a_waiter_whose_client_left_takes_no_slot() -> None:
    pool = make_pool(1, replica_max_inflight=1, admission_wait=30)
    r = await pool.acquire(H, 1)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def wait() -> None:
                with scope:
                    await pool.acquire(H, 1)

            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()  # its client leaves while it waits
        assert pool.waiting == 0 and not pool.queue.waiters
        pool.release(r, 1)
        assert pool.replicas[0].inflight == 0
