"""Memory-channel sends and receives that skip the scheduler round trip when they need not wait.

Trio's ``send`` and ``receive`` on a memory channel always yield, even when the buffer has room
or already holds a value. On the gateway's hot paths the task yields soon anyway (at its next
upstream read or client write), so a second yield is only a task switch: these helpers take the
``*_nowait`` path when it succeeds and wait as trio does otherwise. Used for the relay's
candidate channel (``sieproxy.relay``) and for Hypercorn's queue between a connection and its
app (``sieproxy.front.hypercorn_io``).
"""

from __future__ import annotations

from typing import TypeVar

import trio

__all__ = ["put", "take"]

_T = TypeVar("_T")


async def put(channel: trio.MemorySendChannel[_T], value: _T) -> None:
    """``channel.send(value)``, without yielding when the buffer has room."""
    try:
        channel.send_nowait(value)
    except trio.WouldBlock:
        await channel.send(value)


async def take(channel: trio.MemoryReceiveChannel[_T]) -> _T:
    """``channel.receive()``, without yielding when a value is already buffered (raises
    ``EndOfChannel`` at the end, as ``receive`` does)."""
    try:
        return channel.receive_nowait()
    except trio.WouldBlock:
        return await channel.receive()
