"""The upstream protocol seam: what the shell needs to know of an engine's API.

The gateway plans every request once (:mod:`sieproxy.core.plan`: the rendered prompt and one
typed body per candidate, in SGLang's sampling vocabulary) and then speaks to each engine in
that engine's protocol. An :class:`EngineProtocol` says, for one protocol:

- **the request**: :meth:`~EngineProtocol.request` turns a candidate's planned body into the
  path and JSON body to POST (one upstream request per candidate, always a single generation);
- **the reader**: :meth:`~EngineProtocol.reader` makes a :class:`CandidateReader`, which takes
  the engine's response bytes as they arrive and gives back candidate events
  (:class:`~.events.CandidateDelta`, :class:`~.events.CandidateFinish`), says when the stream
  ended properly (:meth:`~CandidateReader.eof`), and makes the finish of a candidate the gateway
  ended itself (a stop string matched, a ``best_of`` loser: :meth:`~CandidateReader.local_finish`);
  it may offer a fast path for the common token (:meth:`~CandidateReader.express`);
- **the abort**: :meth:`~EngineProtocol.abort` is the request that stops a candidate the engine
  may still be generating, or ``None`` where closing the upstream connection is the abort;
- **the probes**: the health path, and the info paths read once a replica is healthy.

The shell (``relay``, ``fleet.client``, ``pool``) only ever goes through this interface; each
protocol is one module of the core, registered in :data:`PROTOCOLS` by its configuration name.
Nothing here does I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ..errors import GatewayError
from ..shaping.events import CandidateDelta, CandidateFinish

if TYPE_CHECKING:
    from .resume import Progress

__all__ = [
    "PROTOCOLS",
    "CandidateReader",
    "EngineProtocol",
    "ExpressLane",
    "protocol_for",
]


class ExpressLane(Protocol):
    """A reader's fast path for one streamed choice: the client's SSE frames for one engine
    read (``b""`` if it shows nothing new), or ``None`` having changed nothing, when the read is
    not the common case (then the same bytes go to :meth:`CandidateReader.feed`)."""

    def relay(self, data: bytes) -> bytes | None: ...


class CandidateReader(Protocol):
    """Reads one candidate's response body (see the module docstring)."""

    @property
    def done(self) -> bool:
        """The stream reached its proper end marker; later bytes are read and dropped."""
        ...

    @property
    def finished(self) -> bool:
        """The terminal event (a finish) was read."""
        ...

    def feed(
        self, data: bytes
    ) -> tuple[list[CandidateDelta | CandidateFinish], GatewayError | None]:
        """The events in one read of the body, and the error that ends the stream there (the
        events before it still count)."""
        ...

    def eof(self) -> None:
        """The body ended: raise a :class:`~.errors.GatewayError` unless it ended properly."""
        ...

    def local_finish(self, reason: str = "abort") -> CandidateFinish:
        """A finish for a candidate the gateway ended itself, with the counts read so far."""
        ...

    def express(self, shaper: object, index: int = 0) -> ExpressLane | None:
        """The fast path of choice ``index`` of ``shaper``, or ``None`` where it never applies."""
        ...

    def progress(self) -> Progress:
        """What the candidate produced so far (its raw text and counts), for a resume of its
        stream should it break (:mod:`~.resume`)."""
        ...


class EngineProtocol(Protocol):
    """One engine protocol (see the module docstring)."""

    #: The configuration name (``protocol = "..."``).
    name: str
    #: GET paths whose 200 means the engine is up, tried in order (the first that answers).
    health_paths: tuple[str, ...]
    #: Whether the replica's ``/server_info`` may be read (batch size, streaming mode).
    server_info: bool

    def request(
        self, body: dict[str, Any], endpoint: str, model: str
    ) -> tuple[str, dict[str, Any]]:
        """The path and JSON body to POST for one candidate's planned ``body``; ``endpoint`` is
        the client's (``"chat"``, ``"completion"``, ...), ``model`` the gateway's model name."""
        ...

    def reader(
        self, *, incremental: bool, max_line: int, body: dict[str, Any] | None = None
    ) -> CandidateReader:
        """A reader for one candidate's streamed response (``body``: its planned body)."""
        ...

    def abort(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """The request that aborts the candidate of ``body``, or ``None``: closing its
        connection is the abort."""
        ...


def _registry() -> dict[str, EngineProtocol]:
    from .openai import OPENAI
    from .sglang import SGLANG

    return {SGLANG.name: SGLANG, OPENAI.name: OPENAI}


#: The protocols by configuration name.
PROTOCOLS: dict[str, EngineProtocol] = _registry()


def protocol_for(name: str) -> EngineProtocol:
    """The registered protocol called ``name`` (``KeyError`` if there is none)."""
    return PROTOCOLS[name]
