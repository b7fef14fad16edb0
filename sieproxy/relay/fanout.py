"""The candidate tasks of an ``n`` > 1 request (or best_of): the nursery they run in and the
*bounded* channel they all stream into (``n`` = 1 has neither: ``inline.py``).

Each candidate's task (:meth:`~sieproxy.relay.attempt.Attempt.run`) streams into its
``clone()`` of the channel; the response task reads it (:meth:`Fanout.next`): one event, plus
whatever else is already buffered, for one merged write. A slow client stalls that read, which
stalls the channel, which stalls the candidates, which stop reading upstream: backpressure end
to end, with no buffer growing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import trio

from ..fleet.client import Exchange
from .attempt import Attempt
from .candidate import Event
from .channels import take
from .merge import buffered

__all__ = ["Fanout"]


class Fanout:
    """One request's candidate tasks: nursery and channel (see the module docstring)."""

    __slots__ = ("_cm", "_size", "nursery", "recv")

    def __init__(self, channel_size: int) -> None:
        self._size = channel_size
        self._cm: Any = None
        self.nursery: trio.Nursery | None = None  # once entered
        self.recv: trio.MemoryReceiveChannel[Event] | None = None  # once launched

    async def enter(self) -> None:
        self._cm = trio.open_nursery()
        self.nursery = await self._cm.__aenter__()

    async def exit(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        assert self.nursery is not None
        return bool(await self._cm.__aexit__(exc_type, exc, tb))

    def launch(self, up: Attempt, sent: Sequence[Exchange | Exception] = ()) -> None:
        """Start the candidates' tasks (``sent``: the requests ``open()`` sent, or why not)."""
        assert self.nursery is not None
        send, self.recv = trio.open_memory_channel[Event](self._size)
        up.launch(self.nursery, send, sent)

    async def open(self, up: Attempt) -> bool:
        """``GenerationBody.open``: send the requests that find a free connection now
        (``Attempt.send_all``), then start the tasks, which send the rest."""
        if self.nursery is None or self.recv is not None:  # not entered, or launched
            return False
        sent: list[Exchange | Exception] = []
        try:
            await up.send_all(sent)
        finally:
            # Also when cancelled here (the client left): the tasks let what was sent go
            # (each aborts its rid and closes its connection, as on any early end).
            self.launch(up, sent)
        return len(sent) == len(up.bodies) and not any(isinstance(x, Exception) for x in sent)

    async def next(self, up: Attempt) -> Iterator[Event] | None:
        """The next events that arrived together (None at the end)."""
        if self.recv is None:  # open() was not called: the tasks send their requests
            self.launch(up)
        assert self.recv is not None
        try:
            first = await take(self.recv)  # the response's next write yields
        except trio.EndOfChannel:
            return None
        return buffered(self.recv, first)

    async def drain(self) -> None:
        """Wait for the old candidates to finish their cleanup (before a retry's launch)."""
        assert self.recv is not None
        with self.recv:
            async for _ in self.recv:
                pass
