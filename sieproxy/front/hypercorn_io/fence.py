"""The fence: everything the server front relies on of Hypercorn's, h11's, Trio's and
Quart-Trio's private state, checked at start (``missing()``), and the one switch that puts the
gateway's connection in Hypercorn's worker, or leaves it stock (``install()``).

What the package relies on, of Hypercorn's ``TCPServer`` (``stream``, ``send_lock``,
``protocol``, ``idle_task``, ``_task_group``, ``_read_data``, ``_initiate_server_close``), its
task group (``_nursery``, ``spawn_app``, the module's ``_handle``), its HTTP/1.1 protocol
(``connection``, ``stream``, ``config``, ``client``, ``keep_alive_requests``,
``_send_error_response``, ``_send_h11_event``), its HTTP stream (``state``, ``response``,
``closed``), of h11's connection (``our_state``, ``their_http_version``, ``_cstate``,
``_request_method``, ``_process_event``, ``_writer``), h11's header patterns and ``_parsed``,
Trio's per-task yield counter and Quart-Trio's request body (``body_consumed``) is listed here,
in ``_RELIED_ON`` and ``_PRIVATE``, for every module of the package, and checked by
``missing()``; the wording of h11's ``RemoteProtocolError`` messages cannot be (a changed one
gets the generic sentence). The private module-level names are looked up once, here
(``_private``), and the other modules import them from here. pyproject.toml bounds Hypercorn
and h11 below their next minor versions, and tests/shell/test_hypercorn_io.py checks the
behaviour on the installed ones.

``install()``, at start, has Hypercorn's Trio worker serve its connections with ``TCPServer``
(the fixes and the fast paths), ``PortableTCPServer`` (the fixes only: the ``fast_paths``
setting off), or, where something is missing, Hypercorn's own class (one log line names it).
Nothing is patched at import.

This module imports no other module of the package at import time (they import their private
names from it); ``install()`` reads the connection classes when it runs.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import h11
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio.task_group import TaskGroup as HypercornTaskGroup
from hypercorn.trio.tcp_server import TCPServer as HypercornTCPServer
from hypercorn.trio.worker_context import WorkerContext
from quart_trio.wrappers.request import TrioBody

__all__ = ["install", "missing"]

log = logging.getLogger("sieproxy.http")


def _private(module: str, name: str) -> Any:
    """``module.name``, a private name of another library; ``None`` where the installed version
    lacks it (``missing()`` reports it, and ``install()`` then leaves Hypercorn stock)."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


#: The private module-level names the package reads, by where they live (``None``: absent).
_PRIVATE: dict[str, Any] = {
    f"{m}.{n}": _private(m, n)
    for m, n in (
        ("h11._headers", "_field_name_re"),
        ("h11._headers", "_field_value_re"),
        ("h11._writers", "ChunkedWriter"),
        ("hypercorn.trio.task_group", "_handle"),
    )
}
_FIELD_NAME: Any = _PRIVATE["h11._headers._field_name_re"]
_FIELD_VALUE: Any = _PRIVATE["h11._headers._field_value_re"]
_CHUNKED_WRITER: Any = _PRIVATE["h11._writers.ChunkedWriter"]
_HANDLE: Any = _PRIVATE["hypercorn.trio.task_group._handle"]


def _named(cls: type) -> set[str]:
    """The names the code of ``cls`` (and of its bases) uses: an attribute its instances get in
    ``__init__`` or later is among them."""
    found: set[str] = set()
    for klass in cls.__mro__:
        for value in vars(klass).values():
            code = getattr(value, "__code__", None)
            if code is not None:
                found.update(code.co_names)
    return found


#: What the package's modules rely on of other libraries' classes, checked by ``missing()``: the
#: class attributes (methods, properties, constants: ``hasattr``) and the instance attributes
#: (named by the class's own code), read, written, replaced or called in any of them.
_RELIED_ON: tuple[tuple[type, tuple[str, ...], tuple[str, ...]], ...] = (
    (
        HypercornTCPServer,
        ("_initiate_server_close", "_read_data", "protocol_send", "run"),
        ("_task_group", "config", "context", "idle_task", "protocol", "send_lock", "stream"),
    ),
    (HypercornTaskGroup, ("spawn_app",), ("_nursery",)),
    (
        H11Protocol,
        ("_send_error_response", "_send_h11_event"),
        ("client", "config", "connection", "keep_alive_requests", "stream"),
    ),
    (HTTPStream, (), ("closed", "response", "state")),
    (ASGIHTTPState, ("REQUEST", "RESPONSE"), ()),
    (WorkerContext, (), ("terminated",)),
    (
        HypercornConfig,
        (
            "h11_max_incomplete_size",
            "keep_alive_max_requests",
            "keep_alive_timeout",
            "max_app_queue_size",
            "read_timeout",
            "response_headers",
        ),
        (),
    ),
    (
        h11.Connection,
        ("_process_event", "our_state"),
        ("_cstate", "_request_method", "_writer", "their_http_version"),
    ),
    (trio.lowlevel.Task, ("_schedule_points",), ()),
    (TrioBody, (), ("_complete", "_data")),
)


def missing() -> list[str]:
    """What the package relies on that the installed Hypercorn, h11, Trio or Quart lacks: the
    private module-level names, the attributes of their classes (``_RELIED_ON``), h11's
    ``_parsed`` shortcut and its connection state's ``keep_alive``, and the module global
    ``install()`` sets. Empty when everything is there."""
    gaps = [name for name in _PRIVATE if _private(*name.rsplit(".", 1)) is None]
    for cls, on_class, on_instances in _RELIED_ON:
        where = f"{cls.__module__}.{cls.__qualname__}"
        gaps += [f"{where}.{n}" for n in on_class if not hasattr(cls, n)]
        named = _named(cls) if on_instances else set()
        gaps += [f"{where}.{n}" for n in on_instances if n not in named]
    try:
        h11.Response(status_code=200, headers=[], _parsed=True)
    except TypeError:
        gaps.append("h11.Response(_parsed=...)")
    state = getattr(h11.Connection(h11.SERVER), "_cstate", None)
    if state is not None and not hasattr(state, "keep_alive"):
        gaps.append("h11._state.ConnectionState.keep_alive")
    if not hasattr(hypercorn_run, "TCPServer"):
        gaps.append("hypercorn.trio.run.TCPServer")
    return gaps


def install(fast: bool = True) -> Callable[[], None]:
    """At start, before Hypercorn's Trio worker in this process accepts a connection: check
    ``missing()`` and have the worker serve its connections with ``TCPServer`` (``fast``),
    ``PortableTCPServer`` (not ``fast``), or Hypercorn's own class where something is missing.
    The two last are logged in one line. Returns what puts back the class that was there (if
    it is still this one's choice); the worker reads it once, when it starts serving."""
    # Read here, not at import: the connection's modules import their private names from this
    # one, so this one cannot import them first.
    from .connection import PortableTCPServer, TCPServer

    gaps = missing()
    chosen: type[HypercornTCPServer]
    if gaps:
        chosen = HypercornTCPServer
        log.warning(
            "server front: stock Hypercorn and Quart (no fast paths, none of the gateway's "
            "connection fixes): the installed versions lack %s",
            ", ".join(gaps),
        )
    elif not fast:
        chosen = PortableTCPServer
        log.info(
            "server front: fast paths off (fast_paths = false or SIEPROXY_FAST_PATHS=0): "
            "Hypercorn reads, writes and frames every byte; no relay pump"
        )
    else:
        chosen = TCPServer
    before = getattr(hypercorn_run, "TCPServer", None)
    hypercorn_run.TCPServer = chosen  # type: ignore[attr-defined]

    def undo() -> None:
        if getattr(hypercorn_run, "TCPServer", None) is chosen:
            hypercorn_run.TCPServer = before  # type: ignore[attr-defined,assignment]

    return undo
