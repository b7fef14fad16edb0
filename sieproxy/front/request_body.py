"""Reading a generation request's body from ASGI ``http.request`` messages, within the size
limit (413) and the body timeout (400), with the ``Content-Type`` checked first (400). A client
that leaves before its body has arrived raises :class:`ClientGone`: nothing is answered.
"""

from __future__ import annotations

from typing import Any

import trio

from ..core.errors import BodyTooLarge, InvalidRequest

__all__ = ["ClientGone", "read_body", "too_large"]

_JSON_CT = "application/json"


class ClientGone(Exception):
    """The client left before its request body arrived: nothing is answered."""


def too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"The request body is larger than the {limit}-byte limit.")


async def read_body(headers: dict[bytes, str], receive: Any, g_max: int, timeout: float) -> bytes:
    """The whole body (``headers`` are the request's, by lower-case name), or a refusal."""
    length = headers.get(b"content-length")
    if length is not None and int(length) > g_max:  # h11 has checked it is a number
        raise too_large(g_max)
    ctype = headers.get(b"content-type")
    if ctype is not None and ctype.split(";")[0].strip().lower() != _JSON_CT:
        raise InvalidRequest(
            "The request body must be JSON: send `Content-Type: application/json`."
        )
    body = _Body(g_max)
    # What is already queued needs no timer: on the gateway's own connections the whole body
    # of a small request usually is (hypercorn_io.Receive.nowait).
    nowait = getattr(receive, "nowait", None)
    if nowait is not None:
        while (msg := nowait()) is not None:
            if body.take(msg):
                return body.data()
    with trio.move_on_after(timeout) as scope:
        while not body.take(await receive()):
            pass
    if scope.cancelled_caught:
        raise InvalidRequest("The request body was not received in time.")
    return body.data()


class _Body:
    """A request body gathered from ASGI ``http.request`` messages, within ``limit`` bytes."""

    __slots__ = ("_limit", "_parts", "_size")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0

    def take(self, msg: dict[str, Any]) -> bool:
        """Add one message; True once the body is complete."""
        if msg["type"] != "http.request":  # http.disconnect
            raise ClientGone
        data = msg.get("body", b"")
        if data:
            self._size += len(data)
            if self._size > self._limit:
                raise too_large(self._limit)
            self._parts.append(data)
        return not msg.get("more_body", False)

    def data(self) -> bytes:
        parts = self._parts
        return parts[0] if len(parts) == 1 else b"".join(parts)
