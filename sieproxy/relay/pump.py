"""The relay pump: one task per process that carries the tokens of every waiting stream.

A streamed ``n`` = 1 response is relayed by its own task (``relay.GenerationBody``): wait until
the engine's socket is readable, read, shape, write to the client, wait again. On this stack the
wait is the most expensive part of a relayed token: Trio wakes the task through its scheduler
(an ``epoll_ctl`` to arm the wait, the task's step, the coroutine switch back in), about 20 µs a
token on the benchmark machine — more than reading, shaping and writing the token together
(bench/RESULTS.md: a trio TCP pipe with one task per stream against the same pipe driven this
way).

The pump removes that wait from the common case. A response task with nothing to read parks
here (``park``) with its engine socket's descriptor; the pump keeps every parked descriptor in
its own ``epoll`` set (level-triggered, registered once per park, not once per token) and waits
on that set's descriptor, so one wake-up of the pump serves every stream that has bytes. For
each ready stream it calls the stream's ``ride()``, a synchronous step that reads what the
engine sent, shapes it and writes it to the client when the client's socket takes it at once.
The response task stays parked, at no cost, for as long as its tokens flow that way.

Anything else — the end of the engine's body, an error, a deadline, a client that reads slower
than tokens arrive (a partial write), a stop string — makes ``ride()`` return ``False``: the pump
hands the stream back (``unpark``) and the response task resumes exactly where it parked, with
what was read, and handles it as it always did. A cancelled response task (its client left, the
gateway shuts down) leaves the pump at once, by Trio's abort callback: the pump never touches a
stream whose task has moved on. The pump yields to the scheduler after every batch of at most
``batch`` ready streams, so other tasks (new requests, Hypercorn's connections) keep their turn.
The default, 16, was chosen by measurement (docs/DESIGN.md, "The relay pump"): at 1,000 streams
a batch of 64 starved the starts of new requests (a time to first token of 200–530 ms and a
quarter to a third fewer requests served), 16 and 8 did not, and 16 relayed the most chunks.

Where there is no ``epoll`` (macOS, the BSDs) ``run`` logs one line and returns, and with the
gateway's ``fast_paths`` off it is not started: nothing parks, and every stream waits the usual
way. Only plain-TCP engine connections ride (a TLS stream cannot be read by descriptor readiness);
a response task that cannot park waits the usual way. When the pump task is not running (an
app built without ``serve.build_app``'s background tasks), nothing parks.
"""

from __future__ import annotations

import contextlib
import logging
import select
from typing import Protocol

import trio

__all__ = ["Outlet", "Pump", "Rider"]

log = logging.getLogger("sieproxy.pump")


class Rider(Protocol):
    def ride(self) -> bool:
        """The stream's descriptor is readable: relay what can be relayed without waiting.
        ``True`` to stay parked, ``False`` to be handed back to the stream's task."""
        ...


class Outlet(Protocol):
    """Where a rider writes: the client's connection (``hypercorn_io.ChunkWriter``)."""

    def write_nowait(self, data: bytes) -> bool:
        """Send ``data`` if the connection takes all of it at once, without yielding; ``False``
        if not (what is left waits for ``flush``)."""
        ...

    @property
    def pending(self) -> bool:
        """``write_nowait`` left part of a frame: the response's task must ``flush`` it."""
        ...

    async def flush(self) -> None:
        """From the response's own task: send what ``write_nowait`` left."""
        ...


class Pump:
    """See the module docstring. ``run`` is the pump's task; ``park`` is awaited by a stream's
    own task; ``unpark`` hands a stream back from outside (its wait timer fired)."""

    __slots__ = ("_ep", "_parked", "batch", "running")

    def __init__(self, batch: int = 16) -> None:
        self._ep: select.epoll | None = None
        self._parked: dict[int, tuple[Rider, trio.lowlevel.Task]] = {}
        self.batch = batch
        self.running = False

    def __len__(self) -> int:
        return len(self._parked)

    async def run(self) -> None:
        if not hasattr(select, "epoll"):  # macOS, the BSDs: every stream waits the usual way
            log.info("relay pump: off (no epoll on this platform); streams relay from their tasks")
            return
        ep = select.epoll()
        self._ep = ep
        self.running = True
        parked = self._parked
        try:
            fd = ep.fileno()
            while True:
                await trio.lowlevel.wait_readable(fd)
                for ready, _ in ep.poll(0, self.batch):
                    entry = parked.get(ready)
                    if entry is None:
                        continue
                    try:
                        keep = entry[0].ride()
                    except Exception:  # a rider reports its own errors; this is a last guard
                        log.exception("relay pump: a stream failed; handing it back")
                        keep = False
                    if not keep:
                        self.unpark(ready)
        finally:
            self.running = False
            for ready in list(parked):  # nobody carries them any more: their tasks resume
                self.unpark(ready)
            self._ep = None
            ep.close()

    async def park(self, fd: int, rider: Rider) -> None:
        """Until the pump hands the stream back (``rider.ride()`` returned ``False``, or
        ``unpark``), or the calling task is cancelled (which takes it out of the pump first).
        Call only while ``running``, with a descriptor that is not parked yet."""
        ep = self._ep
        assert ep is not None and fd not in self._parked
        ep.register(fd, select.EPOLLIN)
        self._parked[fd] = (rider, trio.lowlevel.current_task())

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._forget(fd)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def unpark(self, fd: int) -> None:
        """Hand the stream parked on ``fd`` back to its task (nothing if none is)."""
        entry = self._forget(fd)
        if entry is not None:
            trio.lowlevel.reschedule(entry[1])

    def _forget(self, fd: int) -> tuple[Rider, trio.lowlevel.Task] | None:
        entry = self._parked.pop(fd, None)
        if entry is not None and self._ep is not None:
            with contextlib.suppress(OSError, ValueError):  # already closed: epoll dropped it
                self._ep.unregister(fd)
        return entry
