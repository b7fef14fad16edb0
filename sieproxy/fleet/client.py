"""The upstream HTTP client: SGLang's native API on Trio.

This module and ``sieproxy.fleet.connection`` are the one boundary where transport exceptions
become core errors. Two clients live here:

* **The generation path** (``/generate`` streams and ``/abort_request``) uses the gateway's own
  HTTP/1.1 connection pool: its connections and exchanges are ``sieproxy.fleet.connection`` (which
  says why it exists), pooled here. It keeps what the hot path needs and nothing else:
  keep-alive reuse (LIFO, idle connections checked for a peer close before reuse and dropped
  after ``_IDLE_EXPIRY`` seconds, below uvicorn's 5 s keep-alive default), a cap on connections
  in use (``max_connections``, wait up to ``pool_timeout``), a cap on idle connections
  (``max_keepalive_connections``), connect and write timeouts (``connect_timeout``) and no read
  timeout (the relay enforces the token-gap timeout per chunk). ``https://`` engines go through
  ``trio.SSLStream`` with the system trust store. Redirects are never followed: engines are
  reached only at configured URLs.
* **Health and info checks** (cold path, their own small pool so a burst of streams can never
  starve them) use httpx with explicit timeouts.
"""

from __future__ import annotations

import contextlib
import math
import ssl
from collections import deque
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import trio

from ..core.errors import EngineMalformed, EngineTruncated, EngineUnreachable, GatewayError
from ..core.upstream.http1 import request_head
from ..settings.load import GatewaySettings
from .connection import DRAIN_LIMIT, Conn, Exchange, Origin, UpstreamResponse

__all__ = ["EngineClient", "Exchange", "UpstreamResponse", "parse_load"]

_encode = msgspec.json.Encoder().encode
#: Idle upstream connections older than this are closed instead of reused (uvicorn, which
#: SGLang's HTTP server runs on, closes idle keep-alive connections after 5 s by default).
_IDLE_EXPIRY = 4.0


class EngineClient:
    """Connections to every engine replica (see the module docstring)."""

    def __init__(
        self,
        g: GatewaySettings,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ):
        self._g = g
        self._origins: dict[str, Origin] = {}
        self._idle: dict[str, deque[Conn]] = {}
        self._idle_count = 0
        self._max_idle = max(0, g.max_keepalive_connections)
        self._in_use = trio.Semaphore(max(1, g.max_connections))
        # One trust store for both clients: the system's (OpenSSL's default paths, so
        # SSL_CERT_FILE / SSL_CERT_DIR point it at a private CA).
        self._ssl = ssl_context if ssl_context is not None else ssl.create_default_context()
        # Health checks and info requests get their own small pool, so a burst of streams or
        # aborts can never starve them (a starved check would mark a healthy replica not ready).
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=g.connect_timeout,
                read=g.health_timeout,
                write=g.connect_timeout,
                pool=g.pool_timeout,
            ),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            transport=transport,
            follow_redirects=False,  # engines are reached only at configured URLs
            trust_env=False,  # no proxy from the environment between gateway and engines
            verify=self._ssl,
        )

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
        self._idle_count = 0
        await self._client.aclose()

    # ------------------------------------------------------------------ connections
    def _origin(self, base: str) -> Origin:
        o = self._origins.get(base)
        if o is None:
            u = urlsplit(base)
            tls = u.scheme == "https"
            host = u.hostname or ""
            port = u.port or (443 if tls else 80)
            o = Origin(
                key=f"{u.scheme}://{host}:{port}",
                host=host,
                port=port,
                authority=u.netloc.rpartition("@")[2],  # as configured: [v6] brackets, port
                prefix=u.path.rstrip("/"),
                tls=tls,
            )
            self._origins[base] = o
        return o

    @property
    def connect_timeout(self) -> float:
        """Seconds to open a connection, and to write a request on one (``Exchange.send``)."""
        return self._g.connect_timeout

    @property
    def spare_connections(self) -> int:
        """How many connections can be checked out now without waiting for a slot."""
        return self._in_use.value

    async def checkout(self, o: Origin, fresh: bool = False) -> Conn:
        """A connection to ``o`` counted against ``max_connections`` (an idle one if a live one
        is there and not ``fresh``, else a new one)."""
        try:
            self._in_use.acquire_nowait()
        except trio.WouldBlock:
            with trio.move_on_after(self._g.pool_timeout) as scope:
                await self._in_use.acquire()
            if scope.cancelled_caught:
                raise EngineUnreachable(
                    "Too many engine connections are in use; retry shortly."
                ) from None
        try:
            idle = None if fresh else self._idle.get(o.key)
            now = trio.current_time()
            while idle:
                c = idle.pop()
                self._idle_count -= 1
                if now - c.idle_since < _IDLE_EXPIRY and not c.dead():
                    c.reused = True
                    return c
                c.close()
            return await self._connect(o)
        except BaseException:
            self._in_use.release()
            raise

    async def _connect(self, o: Origin) -> Conn:
        with trio.move_on_after(self._g.connect_timeout) as scope:
            try:
                tcp = await trio.open_tcp_stream(o.host, o.port)
            except OSError as exc:
                raise EngineUnreachable() from exc
            stream: trio.abc.Stream = tcp
            if o.tls:
                tls = trio.SSLStream(tcp, self._ssl, server_hostname=o.host)
                try:
                    await tls.do_handshake()
                except (trio.BrokenResourceError, OSError) as exc:
                    tcp.socket.close()
                    raise EngineUnreachable() from exc
                stream = tls
            return Conn(stream, tcp.socket, plain=not o.tls)
        assert scope.cancelled_caught
        raise EngineUnreachable("The engine did not accept a connection in time; retry shortly.")

    def checkin(self, o: Origin, c: Conn, reusable: bool) -> None:
        self._in_use.release()
        idle = self._idle.get(o.key)
        if idle is None:
            idle = self._idle[o.key] = deque()
        now = trio.current_time()
        # Reuse is LIFO (the freshest connection first), so expired ones collect at the left
        # end: close them here rather than keep their sockets open until a lull empties the list.
        while idle and now - idle[0].idle_since >= _IDLE_EXPIRY:
            idle.popleft().close()
            self._idle_count -= 1
        if reusable and self._idle_count < self._max_idle:
            c.idle_since = now
            idle.append(c)
            self._idle_count += 1
        else:
            c.close()

    def _post(
        self,
        base: str,
        path: str,
        payload: dict[str, Any],
        head_timeout: float = math.inf,
        ok_only: bool = False,
    ) -> Exchange:
        """POST JSON: an async context manager that yields the response once its head arrived
        (within ``head_timeout``, else ``trio.TooSlowError``); with ``ok_only`` a non-200 is
        drained and raised as ``EngineHTTPError`` instead. The connection goes back to the pool
        only if the response was read to its end. ``Exchange.send`` writes the request before
        the context is entered (see there)."""
        o = self._origin(base)
        body = _encode(payload)
        data = request_head("POST", o.prefix + path, o.authority, len(body)) + body
        # The checkout, the request and the head together end at this deadline.
        return Exchange(self, o, data, trio.current_time() + head_timeout, ok_only)

    # ------------------------------------------------------------------ generation path
    def stream(
        self, base: str, path: str, body: dict[str, Any], *, head_timeout: float | None = None
    ) -> Exchange:
        """POST a candidate's streamed generation request (its protocol's path and body,
        ``core.protocol``); yields the response of a 200 (raw body bytes from ``receive()``). A
        non-200 raises ``EngineHTTPError`` (its text is not echoed); ``head_timeout`` bounds the
        wait for the response head (``trio.TooSlowError``). ``send()`` on the returned exchange
        writes the request before the wait for the head."""
        timeout = head_timeout if head_timeout is not None else math.inf
        return self._post(base, path, body, timeout, ok_only=True)

    def stream_generate(
        self, base: str, body: dict[str, Any], *, head_timeout: float | None = None
    ) -> Exchange:
        """:meth:`stream` to SGLang's ``/generate``."""
        return self.stream(base, "/generate", body, head_timeout=head_timeout)

    async def post(self, base: str, path: str, body: dict[str, Any]) -> None:
        """POST a small request whose answer is drained and dropped (an abort)."""
        async with self._post(base, path, body) as resp:
            await resp.read_all(DRAIN_LIMIT)

    async def abort(self, base: str, rid: str) -> None:
        """POST ``/abort_request`` for exactly ``rid`` (SGLang ignores prefixes)."""
        await self.post(base, "/abort_request", {"rid": rid})

    # ------------------------------------------------------------------ health and info
    async def health(self, base: str, paths: tuple[str, ...] = ("/health",)) -> bool:
        """Whether the first of ``paths`` that the engine serves answers 200 (a 404 tries the
        next: the protocol's probes, ``core.protocol``)."""
        with _map_errors():
            status = 404
            for path in paths:
                status = (await self._client.get(base + path)).status_code
                if status != 404:
                    break
            return status == 200

    async def server_info(self, base: str) -> dict[str, Any]:
        """``/server_info`` (falls back to the older ``/get_server_info``)."""
        return await self._info(base, ("/server_info", "/get_server_info"))

    async def model_info(self, base: str) -> dict[str, Any]:
        """``/model_info`` (falls back to the older ``/get_model_info``)."""
        return await self._info(base, ("/model_info", "/get_model_info"))

    async def load(self, base: str) -> tuple[int, int] | None:
        """The engine's (running, waiting) requests, summed over its data-parallel ranks:
        SGLang's ``/v1/loads`` (``{"loads": [{"num_running_reqs", "num_waiting_reqs"}]}``), else
        the older ``/get_load`` (``[{"num_reqs", "num_waiting_reqs"}]``, where ``num_reqs``
        counts both). None when the engine reports neither."""
        with _map_errors():
            for path in ("/v1/loads", "/get_load"):
                resp = await self._client.get(base + path)
                if resp.status_code == 200:
                    try:
                        return parse_load(msgspec.json.decode(resp.content))
                    except (msgspec.DecodeError, TypeError, ValueError):
                        return None
        return None

    async def _info(self, base: str, paths: tuple[str, ...]) -> dict[str, Any]:
        with _map_errors():
            for path in paths:
                resp = await self._client.get(base + path)
                if resp.status_code == 200:
                    try:
                        info = msgspec.json.decode(resp.content)
                    except msgspec.DecodeError as exc:
                        raise EngineMalformed() from exc
                    if isinstance(info, dict):
                        return info
                    raise EngineMalformed()
        return {}


def parse_load(obj: Any) -> tuple[int, int] | None:
    """(running, waiting) from a ``/v1/loads`` or ``/get_load`` body (None: neither shape)."""
    ranks = obj.get("loads") if isinstance(obj, dict) else obj
    if not isinstance(ranks, list) or not all(isinstance(x, dict) for x in ranks):
        return None
    running = waiting = 0
    for x in ranks:
        w = int(x.get("num_waiting_reqs", 0))
        if "num_running_reqs" in x:
            running += int(x["num_running_reqs"])
        elif "num_reqs" in x:
            running += int(x["num_reqs"]) - w
        else:
            return None
        waiting += w
    return max(0, running), max(0, waiting)


@contextlib.contextmanager
def _map_errors() -> Iterator[None]:
    """Translate httpx errors of the health/info client (engine text is never echoed)."""
    try:
        yield
    except GatewayError:
        raise
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise EngineUnreachable() from exc
    except httpx.TimeoutException as exc:
        raise EngineUnreachable("The engine did not answer in time; retry shortly.") from exc
    except httpx.HTTPError as exc:
        raise EngineTruncated("The engine connection failed.") from exc
