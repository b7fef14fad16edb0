"""The floor of the gateway's stack: Hypercorn on trio relaying bytes, nothing else.

``python -m bench.hyperrelay PORT ENGINE_PORT`` serves a raw ASGI app (no Quart) with
Hypercorn's Trio worker, configured as ``sieproxy serve`` configures it: its client-write path
(``sieproxy.front.hypercorn_io``), its framing of streamed bodies (``body_writer``, as the gateway
sends them) and the serving process's garbage-collector tuning. Each ``POST`` is forwarded to
the same path on the engine through the gateway's own upstream client
(``sieproxy.fleet.client``), and the engine's response body — already OpenAI chunks — is
relayed verbatim, one write per upstream read; while a response waits for the engine, the
gateway's relay pump (``sieproxy.pump``) writes what arrives, as it does for the gateway's
``n`` = 1 streams. No validation, planning, SSE decoding or shaping: what remains is the cost
of the server, the event loop and the upstream client, which the gateway cannot go below
without replacing them.
The bench runs it as the ``hypercorn-relay`` target; ``GET`` requests (``/health``) are
answered locally.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from sieproxy.core.errors import GatewayError
from sieproxy.fleet.client import EngineClient, UpstreamResponse
from sieproxy.front.hypercorn_io import ChunkWriter, ClientWatch, body_writer, chunk_writer
from sieproxy.front.hypercorn_io import install as install_hypercorn_io
from sieproxy.operations.serve import tune_gc
from sieproxy.relay.pump import Pump
from sieproxy.settings.load import GatewaySettings

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class _Carry:
    """The engine's bytes written to the client by the relay pump (``ride``), as the gateway's
    inline reader has them written (``relay.GenerationBody.ride``)."""

    def __init__(self, resp: UpstreamResponse, out: ChunkWriter) -> None:
        self.resp, self.out = resp, out
        self.stash: bytes | GatewayError | None = None  # what the response task must handle

    def ride(self) -> bool:
        try:
            data = self.resp.receive_nowait()
        except GatewayError as exc:
            self.stash = exc
            return False
        if data is None:
            return True
        if data and not self.out.write_nowait(data):
            return False  # the rest of the frame: the response task flushes it
        if not data or self.resp.finished:
            self.stash = b""
            return False
        return True


async def _relay_body(resp: UpstreamResponse, send: Any, pump: Pump) -> None:
    direct = chunk_writer()
    write = body_writer(send, direct)
    carry = _Carry(resp, direct) if direct is not None else None
    while True:
        if carry is not None and carry.stash is not None:
            data, carry.stash = carry.stash, None
            if isinstance(data, GatewayError):
                raise data
        else:
            data = resp.receive_nowait()
        if data is None:
            fd = resp.fileno()
            if carry is None or fd < 0 or not pump.running:
                await resp.wait_readable()
                continue
            await pump.park(fd, carry)
            await carry.out.flush()  # nothing unless the pump left part of a frame
            continue
        if not data:
            return
        await write(data)


async def _relay(
    engine: str, client: EngineClient, path: str, body: bytes, send: Any, pump: Pump
) -> None:
    started = False
    try:
        async with client._post(engine, path, msgspec.json.decode(body), ok_only=True) as resp:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE})
            started = True
            await _relay_body(resp, send, pump)
    except GatewayError as exc:
        if started:  # the engine broke mid-stream: end the body (the client sees no [DONE])
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 502, "headers": _JSON})
        await send({"type": "http.response.body", "body": str(exc).encode()})
        return
    await send({"type": "http.response.body", "body": b""})


def make_app(engine: str, client: EngineClient, pump: Pump) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # nothing to set up or tear down
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": _JSON})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        async with ClientWatch(receive) as watch:
            watch.watch(lambda: None)  # as the gateway
            await _relay(engine, client, scope["path"], body, send, pump)
            watch.scope.cancel()

    return app


async def main(port: int, engine_port: int) -> None:
    client = EngineClient(GatewaySettings(max_keepalive_connections=4096))
    cfg = Config()
    cfg.bind = [f"127.0.0.1:{port}"]
    cfg.keep_alive_timeout = 75
    cfg.backlog = 2048
    cfg.accesslog = None
    pump = Pump()
    app = make_app(f"http://127.0.0.1:{engine_port}", client, pump)
    tune_gc()
    install_hypercorn_io()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump.run)
        await serve(app, cfg, mode="asgi")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), int(sys.argv[2]))
