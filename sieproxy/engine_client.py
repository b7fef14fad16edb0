"""The upstream HTTP client: SGLang's native API over httpx on Trio.

This is the one boundary where transport exceptions become core errors (``_map_errors``).
httpx's defaults (5 s timeouts, 100/20 pool limits) are wrong for token streams and fan-out, so
``Timeout`` and ``Limits`` come from settings: no read timeout (the gateway enforces its own
token-gap timeout per chunk), explicit connect/pool/write timeouts, large pools.

A stream that is left early is closed, never returned to the pool half-read (httpx closes the
connection of a response that is closed before it was fully read).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import trio

from .core.errors import (
    EngineHTTPError,
    EngineMalformed,
    EngineTruncated,
    EngineUnreachable,
    GatewayError,
)
from .settings import GatewaySettings

__all__ = ["EngineClient"]

_encode = msgspec.json.Encoder().encode
_JSON = {"content-type": "application/json"}


@contextlib.contextmanager
def _map_errors(url: str) -> Iterator[None]:
    """Translate httpx transport errors into gateway errors (engine text is never echoed)."""
    try:
        yield
    except GatewayError:
        raise
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise EngineUnreachable() from exc
    except httpx.RemoteProtocolError as exc:
        raise EngineTruncated() from exc
    except (httpx.ReadError, httpx.WriteError, httpx.CloseError) as exc:
        raise EngineTruncated("The connection to the engine broke mid-response.") from exc
    except httpx.TimeoutException as exc:
        raise EngineUnreachable("The engine did not answer in time; retry shortly.") from exc
    except httpx.HTTPError as exc:
        raise EngineTruncated("The engine connection failed.") from exc


class EngineClient:
    """Pooled httpx clients for every engine replica.

    httpcore's pool scans all of its connections on every request start and finish, which is
    O(connections) per request and shows up at a few hundred concurrent streams; the pool is
    therefore split into shards (independent ``AsyncClient``s, the limits divided among them),
    and each request picks a shard from its rid, so a scan sees a fraction of the connections.
    """

    def __init__(
        self,
        g: GatewaySettings,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        shards: int | None = None,
    ):
        self._g = g
        if shards is None:
            shards = 1 if transport is not None else max(1, min(16, g.max_connections // 64))
        self._clients = [
            httpx.AsyncClient(
                timeout=httpx.Timeout(
                    connect=g.connect_timeout,
                    read=None,
                    write=g.connect_timeout,
                    pool=g.pool_timeout,
                ),
                limits=httpx.Limits(
                    max_connections=max(1, g.max_connections // shards),
                    max_keepalive_connections=max(1, g.max_keepalive_connections // shards),
                    keepalive_expiry=30.0,
                ),
                transport=transport,
                follow_redirects=False,  # engines are reached only at configured URLs
                trust_env=False,  # no proxy from the environment between gateway and engines
            )
            for _ in range(shards)
        ]
        # Health checks and info requests get their own small pool, so a burst of streams or
        # aborts on the generation pools can never starve them (a starved check would mark a
        # healthy replica not ready). Aborts go to their rid's shard, spreading bursts.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=g.connect_timeout,
                read=g.health_timeout,
                write=g.connect_timeout,
                pool=g.pool_timeout,
            ),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            transport=transport,
            follow_redirects=False,
            trust_env=False,
        )

    def _shard(self, key: str) -> httpx.AsyncClient:
        return self._clients[hash(key) % len(self._clients)]

    async def aclose(self) -> None:
        for c in (*self._clients, self._client):
            await c.aclose()

    @contextlib.asynccontextmanager
    async def stream_generate(
        self, base: str, body: dict[str, Any], *, head_timeout: float | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """POST ``/generate`` with ``stream: true``; yields the raw byte iterator of a 200.

        ``head_timeout`` bounds the wait for the response head (``trio.TooSlowError``)."""
        url = base + "/generate"
        client = self._shard(str(body.get("rid", "")))
        with _map_errors(url):
            req = client.build_request("POST", url, content=_encode(body), headers=_JSON)
            with trio.fail_after(head_timeout if head_timeout is not None else math.inf):
                resp = await client.send(req, stream=True)
            try:
                if resp.status_code != 200:
                    await _drain_small(resp)
                    raise _status_error(resp.status_code)
                yield _raw(resp, url)
            finally:
                await resp.aclose()

    async def generate(self, base: str, body: dict[str, Any]) -> bytes:
        """POST ``/generate`` (not streaming); returns the 200 body."""
        url = base + "/generate"
        with _map_errors(url):
            resp = await self._shard(str(body.get("rid", ""))).post(
                url, content=_encode(body), headers=_JSON
            )
            if resp.status_code != 200:
                raise _status_error(resp.status_code)
            return resp.content

    async def abort(self, base: str, rid: str) -> None:
        """POST ``/abort_request`` for exactly ``rid`` (SGLang ignores prefixes)."""
        with _map_errors(base):
            await self._shard(rid).post(
                base + "/abort_request", content=_encode({"rid": rid}), headers=_JSON
            )

    async def health(self, base: str) -> bool:
        with _map_errors(base):
            resp = await self._client.get(base + "/health")
            return resp.status_code == 200

    async def server_info(self, base: str) -> dict[str, Any]:
        """``/server_info`` (falls back to the older ``/get_server_info``)."""
        return await self._info(base, ("/server_info", "/get_server_info"))

    async def model_info(self, base: str) -> dict[str, Any]:
        """``/model_info`` (falls back to the older ``/get_model_info``)."""
        return await self._info(base, ("/model_info", "/get_model_info"))

    async def _info(self, base: str, paths: tuple[str, ...]) -> dict[str, Any]:
        with _map_errors(base):
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


async def _raw(resp: httpx.Response, url: str) -> AsyncIterator[bytes]:
    # Raw bytes, never aiter_lines(): that splits on U+2028 inside JSON.
    with _map_errors(url):
        async for chunk in resp.aiter_raw():
            yield chunk


async def _drain_small(resp: httpx.Response) -> None:
    with contextlib.suppress(httpx.HTTPError):
        n = 0
        async for chunk in resp.aiter_raw():
            n += len(chunk)
            if n > 65536:
                break


def _status_error(status: int) -> EngineHTTPError:
    if status == 400:
        msg = "The engine refused the request (for example, the prompt is too long)."
    elif status in (429, 503):
        msg = "The engine is busy or not ready; retry shortly."
    else:
        msg = f"The engine answered with HTTP {status}."
    return EngineHTTPError(msg, engine_status=status)
