"""The load: which conversation starts when, bounded by a request count or a duration.

Three modes (:class:`Load`): a fixed ``concurrency`` (a closed loop: that many clients, each
starting its next conversation when its last one ends); a ``rate`` with an arrival process
(an open loop: conversations start on the process's schedule, at most ``max_concurrency`` at
once, later arrivals waiting for a slot); a trace (each conversation starts at its own ``at``).
A conversation's later turns follow its previous reply (after ``think_s``).

Bounds: ``num_requests`` counts requests (turns); ``duration_s`` stops starting new requests
after that many seconds; requests in flight then run to their end (or their timeout).
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import trio

from bench.serve import arrivals
from bench.serve.client import Endpoint, count_tokens, prompt_text, send
from bench.serve.metrics import RequestRecord
from bench.serve.workloads import Conversation, Tokenizer


@dataclass
class Load:
    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "poisson"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    trace: bool = False
    num_requests: int | None = None
    duration_s: float | None = None
    think_s: float = 0.0
    seed: int = 0

    def label(self) -> str:
        if self.trace:
            return "trace"
        if self.rate is not None:
            return f"rate={self.rate:g}/s"
        return f"concurrency={self.concurrency}"


@dataclass
class _State:
    load: Load
    t0: float
    records: list[RequestRecord] = field(default_factory=list)
    taken: int = 0
    inflight: int = 0
    stopped: bool = False
    replies: list[tuple[RequestRecord, str, str]] = field(default_factory=list)

    def take(self) -> bool:
        """Claim the next request if the bounds allow one."""
        ld = self.load
        if self.stopped:
            return False
        if ld.num_requests is not None and self.taken >= ld.num_requests:
            self.stopped = True
            return False
        if ld.duration_s is not None and time.perf_counter() - self.t0 >= ld.duration_s:
            self.stopped = True
            return False
        self.taken += 1
        return True


class ProgressBar:
    """A progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, load: Load, enabled: bool | None = None) -> None:
        self.label = label
        self.load = load
        self.on = sys.stderr.isatty() if enabled is None else enabled

    def draw(self, st: _State, final: bool = False) -> None:
        if not self.on:
            return
        el = time.perf_counter() - st.t0
        fr = 0.0
        if self.load.num_requests:
            fr = len(st.records) / self.load.num_requests
        if self.load.duration_s:
            fr = max(fr, min(1.0, el / self.load.duration_s))
        bar = "#" * round(fr * 30)
        errs = sum(1 for r in st.records if not r.ok)
        sys.stderr.write(f"\r\x1b[K{self.label} [{bar:<30}] {len(st.records)} done, "
                         f"{st.inflight} in flight, {errs} errors, {el:.1f} s")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def _conversation(client: httpx.AsyncClient, ep: Endpoint, st: _State, conv: Conversation,
                        cid: int, scheduled: float, tokenizer: Tokenizer | None) -> None:
    history: list[dict[str, str]] = []
    for i, turn in enumerate(conv.turns):
        if not st.take():
            return
        history.append({"role": "user", "content": turn.text})
        rec = RequestRecord(index=st.taken - 1, conversation=cid, turn=i,
                            scheduled_s=scheduled, start_s=0.0)
        st.inflight += 1
        try:
            reply = await send(client, ep, rec, st.t0, conv.system, history, turn.max_tokens)
        finally:
            st.inflight -= 1
        if i > 0:
            rec.scheduled_s = rec.start_s
        st.records.append(rec)
        if not rec.ok:
            return
        if tokenizer is not None:  # counted after the point (see ``count_tokens``)
            st.replies.append((rec, prompt_text(conv.system, history), reply))
        history.append({"role": "assistant", "content": reply})
        if st.load.think_s and i + 1 < len(conv.turns):
            await trio.sleep(st.load.think_s)


async def run(client: httpx.AsyncClient, ep: Endpoint, convs: Iterator[Conversation],
              load: Load, tokenizer: Tokenizer | None = None,
              progress: ProgressBar | None = None) -> list[RequestRecord]:
    """Run one load point; returns its records in order of completion."""
    if load.num_requests is None and load.duration_s is None and not load.trace:
        raise ValueError("a run needs --num-requests or --duration")
    st = _State(load, time.perf_counter())
    cids = iter(range(1 << 62))

    async def ticker() -> None:
        while True:
            if progress is not None:
                progress.draw(st)
            await trio.sleep(0.25)

    async with trio.open_nursery() as outer:
        outer.start_soon(ticker)
        async with trio.open_nursery() as nursery:
            if load.trace or load.rate is not None:
                nursery.start_soon(_open_loop, client, ep, st, convs, cids, tokenizer)
            else:
                assert load.concurrency is not None and load.concurrency > 0

                async def worker() -> None:
                    for conv in convs:
                        if st.stopped:
                            return
                        await _conversation(client, ep, st, conv, next(cids),
                                            time.perf_counter() - st.t0, tokenizer)

                for _ in range(load.concurrency):
                    nursery.start_soon(worker)
        outer.cancel_scope.cancel()
    if progress is not None:
        progress.draw(st, final=True)
    if tokenizer is not None:
        for rec, prompt, reply in st.replies:
            count_tokens(rec, tokenizer, prompt, reply)
    return st.records


async def _open_loop(client: httpx.AsyncClient, ep: Endpoint, st: _State,
                     convs: Iterator[Conversation], cids: Iterator[int],
                     tokenizer: Tokenizer | None) -> None:
    load = st.load
    limit = trio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    if load.trace:
        times: Iterator[float] | None = None
    else:
        assert load.rate is not None
        times = arrivals.start_times(load.arrival, load.rate, random.Random(load.seed),
                                     load.burstiness)

    async def one(conv: Conversation, cid: int, at: float) -> None:
        try:
            await _conversation(client, ep, st, conv, cid, at, tokenizer)
        finally:
            if limit is not None:
                limit.release()

    async with trio.open_nursery() as nursery:
        for conv in convs:
            at = conv.at if times is None else next(times)
            if at is None:
                raise ValueError("a trace record without a start time")
            if load.duration_s is not None and at >= load.duration_s:
                break
            if math.isfinite(at):
                await trio.sleep_until(_trio_deadline(st.t0 + at))
            if limit is not None:
                await limit.acquire()
            if st.stopped or (load.num_requests is not None and st.taken >= load.num_requests):
                if limit is not None:
                    limit.release()
                break
            nursery.start_soon(one, conv, next(cids), at)


def _trio_deadline(perf_at: float) -> float:
    """A ``time.perf_counter()`` instant as a deadline on trio's clock."""
    return trio.current_time() + (perf_at - time.perf_counter())
