"""The server front: the one package that touches Hypercorn's, h11's, Trio's and Quart's
private state (docs/DESIGN.md, "The server front").

``install()``, at start, checks every private name and attribute relied on (``missing()``) and
has Hypercorn's Trio worker serve its connections with ``TCPServer`` (the fixes and the fast
paths), ``PortableTCPServer`` (the fixes only: the ``fast_paths`` setting off), or, where
something is missing, Hypercorn's own class (one log line names it). Nothing is patched at
import.

Its modules, each with the part of the theory of operation about its code:

* ``fence`` — every private name and attribute the others rely on (``_PRIVATE``,
  ``_RELIED_ON``), looked up once and checked at start (``missing()``), and ``install()``;
* ``connection`` — ``TCPServer`` and ``PortableTCPServer``: the direct read and write, the held
  bytes of ``send_together``, the shielded close, the keep-alive watch (``_KeepAlive``);
* ``refusal`` — the error envelope for a request h11 cannot read (``_refuse``, ``refusal()``);
* ``body`` — the response body's writers: the gateway's own chunk framing (``chunk_writer()``,
  ``ChunkWriter``), the head made ahead (``prepare_head``), one write for a head and its first
  piece (``send_together``), and ``body_writer()``;
* ``asgi_side`` — what runs in or for the app's task: how it finds its connection, the queue
  between the connection and the app (``Receive``), ``watch_disconnect()``, ``ClientWatch``,
  ``body_consumed()``.

Every name the gateway, the tests and the bench import is importable from here.
"""

from __future__ import annotations

from .asgi_side import ClientWatch, Receive, body_consumed, watch_disconnect
from .body import (
    BodyWrite,
    ChunkWriter,
    Head,
    body_writer,
    chunk_writer,
    prepare_head,
    send_together,
)
from .connection import PortableTCPServer, TCPServer
from .fence import install, missing
from .refusal import refusal

__all__ = [
    "BodyWrite",
    "ChunkWriter",
    "ClientWatch",
    "Head",
    "PortableTCPServer",
    "Receive",
    "TCPServer",
    "body_consumed",
    "body_writer",
    "chunk_writer",
    "install",
    "missing",
    "prepare_head",
    "refusal",
    "send_together",
    "watch_disconnect",
]
