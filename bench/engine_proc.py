"""The scripted fake engine in its own process, plus a counters endpoint for the bench.

``python -m bench.engine_proc --port P --ttft-ms X --itl-ms Y --tokens N [--incremental]`` runs
:class:`engine.fake.FakeEngine` with its default script (distinct tokens per request) and adds
``GET /_bench/stats``: :meth:`FakeEngine.statistics` as JSON. The disconnect and soak scenarios
read it before and after a run to count the generations the engine saw end early (aborted via
``/abort_request`` or cancelled by a closed connection) and those still running (leaks).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys

import trio

from engine._http import HTTPConnection, HTTPRequest
from engine.fake import DefaultScript, FakeEngine


class BenchEngine(FakeEngine):
    async def _handle(self, conn: HTTPConnection, req: HTTPRequest) -> None:
        if req.path == "/_bench/stats":
            body = dataclasses.asdict(self.statistics())
            await conn.send_response(200, json.dumps(body).encode())
            return
        await super()._handle(conn, req)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.engine_proc")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--incremental", action="store_true")
    a = p.parse_args(argv)
    eng = BenchEngine(
        DefaultScript(ttft=a.ttft_ms / 1000, itl=a.itl_ms / 1000, tokens=a.tokens),
        incremental=a.incremental,
        model_path="bench-model",
        served_model_name="bench-model",
    )

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(eng.serve, "127.0.0.1", a.port)
            print(f"fake engine listening on http://127.0.0.1:{port}", flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
