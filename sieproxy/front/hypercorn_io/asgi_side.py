"""The app's side of a connection: how the app's task finds its connection, the queue between
the connection and the app, and the two ASGI-side helpers the gateway's route uses.

The connection is found through a context variable (``_SERVING``) set when it starts serving:
Hypercorn spawns the app's task from the connection's own task, and a Trio task inherits its
spawner's context.

``_spawn_app`` replaces the ``spawn_app`` of the task group Hypercorn gives each connection
(on that task group only), for the queue between the connection and the app's task: a request's
first two ASGI messages (a body in one piece and its end) go in without a scheduler round trip,
and the app's ``receive`` returns a queued message at once (``Receive``; ``Receive.nowait``
tells a reader what is queued without waiting). Hypercorn's queue yields on every message in
and out: three scheduler passes on the way from a small request's bytes to the app reading its
body. Later messages still yield, so an app that answers without reading a large upload runs
before the queue fills (once it has answered, Hypercorn drops the rest; a full queue would
block its ``http.disconnect`` for ever).

``watch_disconnect()`` is the other ASGI-side piece the gateway shares with the bench's
``hypercorn-relay`` floor (``bench/hyperrelay.py``): one task per request that drops what is
left of the request and cancels the response when the client leaves. ``ClientWatch`` is the
gateway's: on these connections, a scope that the connection's ``http.disconnect`` cancels
directly (``Receive.on_disconnect``), with no task, nursery or queued message per request;
elsewhere, that task in a nursery. ``body_consumed()`` reads Quart-Trio's request body: whether
a refusal left part of it unread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import trio
from hypercorn.trio.task_group import TaskGroup as HypercornTaskGroup
from quart import Request

from ...relay.channels import put, take
from .fence import _HANDLE

if TYPE_CHECKING:
    from .connection import TCPServer

__all__ = ["ClientWatch", "Receive", "body_consumed", "watch_disconnect"]

_SERVING: ContextVar[TCPServer | None] = ContextVar("sieproxy_connection", default=None)


async def watch_disconnect(receive: Callable[[], Awaitable[Any]], scope: trio.CancelScope) -> None:
    """Read what is left of an ASGI request (dropped) until the client leaves, then cancel
    ``scope`` (the response), as Quart-Trio's message task does for Quart's routes."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _spawn_app(
    group: HypercornTaskGroup,
    app: Any,
    config: Any,
    scope: Any,
    send: Callable[[Any], Awaitable[None]],
) -> Callable[[Any], Awaitable[None]]:
    """Hypercorn's ``TaskGroup.spawn_app`` for one connection's task group, with a queue that
    hands a message over without a scheduler round trip when it can (the module docstring)."""
    to_app, from_server = trio.open_memory_channel[Any](config.max_app_queue_size)
    assert group._nursery is not None
    receive = Receive(from_server)
    group._nursery.start_soon(
        _HANDLE,
        app,
        config,
        scope,
        receive,
        send,
        trio.to_thread.run_sync,
        trio.from_thread.run,
    )
    return _putter(to_app, receive)


#: How many of a request's first ASGI messages go into the app's queue without a scheduler
#: round trip (a body in one piece and its end); later ones yield, as Hypercorn's do.
_PUT_AT_ONCE = 2


def _putter(
    channel: trio.MemorySendChannel[Any], receive: Receive
) -> Callable[[Any], Awaitable[None]]:
    """Hypercorn's ``app_put``. The first ``_PUT_AT_ONCE`` messages go into the queue without
    yielding where it has room (Hypercorn's ``max_app_queue_size``, ten by default): the
    app's task then starts with the whole of a small request's body queued. Every later
    message yields as Hypercorn's does, so an app that answers without reading a large upload
    (a 401) runs before the queue fills: once it has answered, Hypercorn drops the rest, where
    a full queue would block its ``http.disconnect`` for ever. An ``http.disconnect`` goes to
    the app's ``Receive.on_disconnect`` instead, when it has one (``ClientWatch``)."""
    sent = 0

    async def app_put(message: Any) -> None:
        nonlocal sent
        left = receive.on_disconnect
        if left is not None and message["type"] == "http.disconnect":
            receive.on_disconnect = None
            left()
            return
        sent += 1
        if sent > _PUT_AT_ONCE:
            await channel.send(message)
        else:
            await put(channel, message)

    return app_put


class Receive:
    """The app's ASGI ``receive`` on these connections: a message already queued is returned
    at once, otherwise it waits, as Hypercorn's does. ``nowait()`` is the queued message, or
    ``None`` (for a reader that needs a timer only when it must wait)."""

    __slots__ = ("_channel", "on_disconnect")

    def __init__(self, channel: trio.MemoryReceiveChannel[Any]) -> None:
        self._channel = channel
        #: Called (once) instead of queueing ``http.disconnect``, when set (``ClientWatch``).
        self.on_disconnect: Callable[[], None] | None = None

    async def __call__(self) -> Any:
        return await take(self._channel)

    def nowait(self) -> Any:
        try:
            return self._channel.receive_nowait()
        except trio.WouldBlock:
            return None


class ClientWatch:
    """``async with ClientWatch(receive) as w``: ``w.scope`` is cancelled when the client
    leaves, once ``w.watch(on_leave)`` was called (after the request's body was read), and
    ``on_leave`` is called just before (nothing yields between the two). On a ``Receive`` of
    these connections the connection's ``http.disconnect`` does it directly; on any other
    ``receive``, a task (``watch_disconnect``) in a nursery."""

    __slots__ = ("_cm", "_nursery", "_receive", "scope")

    def __init__(self, receive: Callable[[], Awaitable[Any]]) -> None:
        self._receive = receive
        self._nursery: trio.Nursery | None = None
        self._cm: Any = None
        self.scope: trio.CancelScope

    async def __aenter__(self) -> ClientWatch:
        if type(self._receive) is Receive:
            self.scope = self._cm = trio.CancelScope()
            self._cm.__enter__()
        else:
            self._cm = trio.open_nursery()
            self._nursery = await self._cm.__aenter__()
            self.scope = self._nursery.cancel_scope
        return self

    async def __aexit__(self, *exc: Any) -> bool:
        if self._nursery is None:
            self._receive.on_disconnect = None  # type: ignore[attr-defined]  # a Receive
            return bool(self._cm.__exit__(*exc))
        return bool(await self._cm.__aexit__(*exc))

    def watch(self, on_leave: Callable[[], None]) -> None:
        scope = self.scope
        if self._nursery is None:

            def left() -> None:
                on_leave()
                scope.cancel()

            self._receive.on_disconnect = left  # type: ignore[attr-defined]  # a Receive
        else:
            self._nursery.start_soon(self._watch, on_leave)

    async def _watch(self, on_leave: Callable[[], None]) -> None:
        await watch_disconnect(self._receive, self.scope)
        on_leave()  # nothing has yielded since the cancel


def body_consumed(req: Request) -> bool:
    """Whether Quart has read the whole of ``req``'s body (a refusal that leaves part of it
    unread must close the connection). Read from Quart-Trio's private ``_complete`` and
    ``_data``; where a version lacks them, ``True`` (Quart's own behaviour: no close)."""
    body = req.body
    complete = getattr(body, "_complete", None)
    return complete is None or bool(complete.is_set() and not getattr(body, "_data", b""))
