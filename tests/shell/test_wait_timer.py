"""The inline reader's gap/deadline timer (``relay.WaitTimer``): one task per process instead of a
cancel scope per upstream wait. It must fire at the limit (not at some later sweep), follow a
limit that moves later, wake early for an earlier entry, keep no ended body alive, let a reader
whose limit passed between reads arm again, and the gateway must still time out a hung engine
at the configured gap — with the timer task and, where no timer task runs, with the per-wait
cancel scope it replaces."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from engine.fake import FakeEngine, Fault, Plan
from sieproxy.relay.body import WaitTimer
from sieproxy.relay.inline import InlineReader

from .harness import running_gateway
from .test_faults import (
    CHAT,
    TOKENS,
    aborted_once,
    chat_body,
    check_sse_error_tail,
    faulty,
    settled,
    still_serves,
)


class _Reader:
    """Stands in for a body: records when the timer called it and answers with the next
    re-arm time from ``moves`` (None: the limit has passed)."""

    def __init__(self, moves: list[float | None]) -> None:
        self.moves = moves
        self.calls: list[float] = []

    def timer_due(self, now: float) -> float | None:
        self.calls.append(now)
        return self.moves.pop(0) if self.moves else None


def _holder(reader: _Reader) -> list[Any]:
    return [reader]


def test_fires_at_the_limit_and_follows_a_later_one() -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    timer = WaitTimer()
    reader = _Reader([7.5, None])  # due at 5: moved to 7.5; due at 7.5: passed

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer.run)
            await trio.testing.wait_all_tasks_blocked()  # the timer task is asleep
            assert timer.running
            timer.arm(trio.current_time() + 5, _holder(reader))
            await trio.sleep(20)
            nursery.cancel_scope.cancel()

    t0 = clock.current_time()
    trio.run(main, clock=clock)
    assert [round(t - t0, 6) for t in reader.calls] == [5.0, 7.5]
    assert not timer.running and len(timer) == 0


def test_an_earlier_entry_wakes_the_sleeping_timer() -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    timer = WaitTimer()
    late, early = _Reader([]), _Reader([])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer.run)
            await trio.testing.wait_all_tasks_blocked()  # the timer task is asleep
            timer.arm(trio.current_time() + 100, _holder(late))
            await trio.sleep(1)  # the timer now sleeps until +100
            timer.arm(trio.current_time() + 2, _holder(early))
            await trio.sleep(200)
            nursery.cancel_scope.cancel()

    t0 = clock.current_time()
    trio.run(main, clock=clock)
    assert [round(t - t0, 6) for t in early.calls] == [3.0]
    assert [round(t - t0, 6) for t in late.calls] == [100.0]


def test_emptied_holders_are_skipped_and_compacted() -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    timer = WaitTimer()
    readers = [_Reader([]) for _ in range(300)]
    holders = [_holder(r) for r in readers]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(timer.run)
            await trio.testing.wait_all_tasks_blocked()  # the timer task is asleep
            now = trio.current_time()
            for k, h in enumerate(holders):
                timer.arm(now + 10 + k, h)
            for h in holders[:200]:  # these readers ended: the heap must let them go
                h[0] = None
                timer.drop()
            assert len(timer) < 300, "the heap was not rebuilt without the ended entries"
            dead = sum(e[2][0] is None for e in timer._heap)
            assert dead * 2 <= len(timer), "ended entries are more than half the heap"
            await trio.sleep(400)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    assert all(not r.calls for r in readers[:200])
    assert all(len(r.calls) == 1 for r in readers[200:])
    assert len(timer) == 0


class _Resp:
    closed = False

    def close(self) -> None:
        self.closed = True


def _due_reader(waiting: bool) -> tuple[InlineReader, _Resp]:
    """An inline reader with a timer entry; its engine last sent bytes at 0, gap 1 s."""
    g = SimpleNamespace(token_gap_timeout=1.0)
    att = SimpleNamespace(g=g, stats=None, deadline=100.0, reader=lambda: None, first=1.0)
    il = InlineReader(att, None, clock=trio.current_time, timer=None, pump=None)  # type: ignore[arg-type]
    resp = _Resp()
    il.resp, il.last, il.waiting = resp, 0.0, waiting  # type: ignore[assignment]
    il.holder = [il]
    return il, resp


@pytest.mark.parametrize("waiting", [True, False], ids=["waiting", "between-reads"])
def test_an_entry_due_after_its_limit_is_dropped_and_the_next_wait_re_arms(
    waiting: bool,
) -> None:
    """Limit passed: a waiting reader's connection is closed under it; a reader between reads
    (processing, or writing to its client) is left alone, and its entry is gone, so its next
    wait arms a new one (which is due at once). A limit that moved later is re-armed."""
    il, resp = _due_reader(waiting)
    assert il.timer_due(0.5) == 1.0  # the limit is still ahead: re-armed there
    assert il.holder is not None and not resp.closed
    assert il.timer_due(1.5) is None
    assert il.holder is None, "the reader would never arm again: a later hang not timed out"
    assert resp.closed is waiting and il.fired is waiting


@pytest.mark.parametrize("with_timer", [True, False], ids=["timer-task", "cancel-scope"])
async def test_a_hung_engine_times_out_at_the_gap(
    with_timer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n = 1, the engine hangs after two tokens: the stream ends with upstream_timeout close to
    the configured gap (0.5 s), the rid is aborted once, and the process keeps no body in the
    timer's heap afterwards."""
    if not with_timer:

        async def no_timer(self: WaitTimer) -> None:  # as where no timer task runs
            return None

        monkeypatch.setattr(WaitTimer, "run", no_timer)
    engine = FakeEngine(script=faulty(Plan(TOKENS, fault=Fault.hang(2))))
    async with running_gateway(engine, token_gap_timeout=0.5) as gw:
        assert gw.state.timer.running is with_timer
        t0 = trio.current_time()
        with trio.fail_after(8):
            r = await gw.client.post(
                CHAT, json=chat_body(stream=True), headers={"X-Request-Id": "fault-gap"}
            )
        elapsed = trio.current_time() - t0
        assert r.status_code == 200
        err, _ = check_sse_error_tail(r.text)
        assert err["code"] == "upstream_timeout", err
        assert 0.5 <= elapsed < 1.5, f"timed out after {elapsed:.2f}s with a 0.5s gap"
        await aborted_once(engine, ["fault-gap-0"])
        await settled(engine)
        await still_serves(gw)
        heap = gw.state.timer._heap
        assert all(e[2][0] is None for e in heap), "an ended request is still in the timer"
