"""Following one engine's KV-event stream over ZMQ (the shell of :mod:`sieproxy.core.kvindex`).

The engine publishes on a PUB socket ``[topic, sequence (8 bytes big-endian), payload]`` and,
when it has a replay endpoint, answers on a ROUTER socket a request ``[b"", start sequence]``
with ``[b"", sequence, payload]`` for each batch it still holds from there, then an end marker
(sequence −1, empty payload). The gateway subscribes with a SUB socket and asks for a replay
with a short-lived DEALER socket, whenever
:class:`~sieproxy.core.routing.kvindex.EventStream` says so: on a gap in the sequence, and on
each connection to the publisher. A PUB socket drops what it sends before a subscription
reaches it, so a batch published while the gateway was connecting (the only one, when the
engine then falls idle) would otherwise be missed until the next. The SUB socket's monitor
reports the handshake; by then the subscription is queued on that connection, and the replay
request, on a connection of its own, reaches the engine after it.

Trio and pyzmq: sockets are used non-blocking (``zmq.NOBLOCK``) from the Trio thread only, and a
task waits for the socket's notification descriptor with ``trio.lowlevel.wait_readable``: no
thread per replica and no second event loop. That descriptor is edge-triggered (it signals that
the socket's state *may* have changed), so every wake-up drains the socket until ``zmq.Again``,
and a wait is bounded (:data:`_RECHECK`) so a missed edge costs at most that long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from ..core.routing.kvindex import EventStream

__all__ = ["follow", "replay", "zmq_context"]

log = logging.getLogger("sieproxy.kv_events")

_RECHECK = 1.0  # seconds: the longest wait on the descriptor before the socket is asked again
REPLAY_TIMEOUT = 2.0  # seconds a replay may take before the gap is given up

_ctx: zmq.Context[zmq.Socket[bytes]] | None = None


def zmq_context() -> zmq.Context[zmq.Socket[bytes]]:
    global _ctx
    if _ctx is None:
        _ctx = zmq.Context()
    return _ctx


async def _recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        with trio.move_on_after(_RECHECK):
            await trio.lowlevel.wait_readable(sock.FD)


def _seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


async def follow(
    stream: EventStream,
    endpoint: str,
    replay_endpoint: str | None,
    topic: str = "",
    *,
    on_batch: Callable[[float], None] | None = None,
) -> None:
    """Subscribe to ``endpoint`` and feed ``stream`` until cancelled; replays on request.

    ``on_batch(lag)``: after each live batch, the seconds between the engine's timestamp of
    the last applied batch and now (the event lag).
    """
    sub = zmq_context().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    log.info("following KV events at %s", endpoint)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_joins, stream, sub, monitor, replay_endpoint)
            while True:
                frames = await _recv(sub)
                if len(frames) < 3:
                    stream.bad_batches += 1
                    continue
                start = stream.receive(_seq(frames[-2]), frames[-1], trio.current_time())
                if start is not None:
                    await replay(stream, replay_endpoint, start)
                if on_batch is not None and stream.last_ts is not None:
                    on_batch(max(0.0, time.time() - stream.last_ts))
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)


async def _joins(
    stream: EventStream,
    sub: zmq.Socket[bytes],
    monitor: zmq.Socket[bytes],
    replay_endpoint: str | None,
) -> None:
    """On each completed connection to the publisher, replay what the stream may have missed."""
    while True:
        frames = await _recv(monitor)
        if parse_monitor_message(frames)["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED:
            continue
        sub.getsockopt(zmq.EVENTS)  # the socket attaches the connection: the subscription goes
        start = stream.join()
        if start is not None:
            await replay(stream, replay_endpoint, start)


async def replay(stream: EventStream, endpoint: str | None, start: int) -> None:
    """Ask ``endpoint`` for every batch from ``start`` and feed them to ``stream``; then end
    the replay (what could not be filled is lost, :meth:`EventStream.replay_done`), saying
    whether the engine's end marker came."""
    if endpoint is None:
        stream.replay_done()
        return
    sock = zmq_context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    ended = False
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        with trio.move_on_after(REPLAY_TIMEOUT) as scope:
            while True:
                frames = await _recv(sock)
                if len(frames) < 2:
                    continue
                seq, payload = _seq(frames[-2]), frames[-1]
                if seq < 0 or not payload:
                    ended = True
                    break
                stream.replayed(seq, payload)
        if scope.cancelled_caught:
            log.warning("KV-event replay from %s timed out", endpoint)
    finally:
        sock.close(linger=0)
        stream.replay_done(ended=ended)
