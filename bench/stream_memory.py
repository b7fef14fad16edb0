"""Marginal memory per open stream: the gateway's RSS at N/2 and at N open streams.

    python -m bench.stream_memory [--streams 1000] [--settle 20]

Starts the native fake engine (bench/native/harness.c; `--engine fast` for the Python one;
400 ms between tokens, streams that outlast the run) and the
gateway, warms the gateway up with 200 short streams, then holds N/2 streams open (one every
50 ms), waits until all are streaming, reads the gateway's
RSS once it has settled, opens N/2 more, reads it again, and reports the difference divided by
N/2: what one more open stream costs. The soak's "memory per open stream" divides the whole RSS
growth over a freshly started process by the open streams instead, which also charges the
process's warm-up and the churn of requests that start and end during the soak (garbage
waiting for its collection, allocator fragmentation) to the streams; both figures are
recorded in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import trio

from bench.procstat import tree_rss
from bench.targets import start_engine, start_sieproxy

REQ = json.dumps(
    {
        "model": "bench-model",
        "stream": True,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 1000,
    }
).encode()
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % len(REQ)
) + REQ


#: Seconds between two new streams: the fast engine (one thread) falls behind when hundreds of
#: connections arrive within a second, and the gateway would then wait on it.
_RAMP = 0.05


async def _drain(s: trio.SocketStream) -> None:
    while await s.receive_some(65536):
        pass


async def _hold(port: int, opened: list[int], stop: trio.Event) -> None:
    s = await trio.open_tcp_stream("127.0.0.1", port)
    async with s:
        await s.send_all(HEAD)
        first = await s.receive_some(65536)
        if not first.startswith(b"HTTP/1.1 200"):
            with trio.move_on_after(1):
                first += await s.receive_some(65536)
            raise RuntimeError(f"stream refused: {first[:400]!r}")
        opened[0] += 1
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_drain, s)
            await stop.wait()
            nursery.cancel_scope.cancel()


async def _short(port: int) -> None:
    s = await trio.open_tcp_stream("127.0.0.1", port)
    async with s:
        await s.send_all(HEAD)
        await s.receive_some(65536)
        await trio.sleep(0.5)


async def _run(port: int, pid: int, n: int, settle: float) -> dict[str, float]:
    out: dict[str, float] = {"idle_kib": tree_rss([pid]) / 1024}
    async with trio.open_nursery() as nursery:
        for _ in range(200):
            nursery.start_soon(_short, port)
            await trio.sleep(0.002)
    await trio.sleep(settle / 2)
    out["warm_kib"] = tree_rss([pid]) / 1024
    stop = trio.Event()
    opened = [0]
    async with trio.open_nursery() as nursery:
        for k, half in enumerate(("half", "full"), 1):
            for _ in range(n // 2):
                nursery.start_soon(_hold, port, opened, stop)
                await trio.sleep(_RAMP)
            with trio.move_on_after(120):
                while opened[0] < k * (n // 2):
                    await trio.sleep(0.2)
            await trio.sleep(settle)
            out[f"{half}_open"] = opened[0]
            out[f"{half}_kib"] = tree_rss([pid]) / 1024
        stop.set()
    added = out["full_open"] - out["half_open"]
    out["marginal_kib_per_stream"] = (out["full_kib"] - out["half_kib"]) / added if added else 0.0
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--settle", type=float, default=20.0, help="s to wait before each reading")
    p.add_argument("--engine", choices=("native", "fast"), default="native",
                   help="native (C, default): bench/fastengine.py stalls for seconds (its own "
                   "/health too) once hundreds of long streams are open, and the gateway then "
                   "marks it not ready")
    a = p.parse_args()
    eng = start_engine(0.0, 400.0, 100_000, None, kind=a.engine)
    gw = start_sieproxy(eng.port, None)
    try:
        assert gw.proc is not None
        res = trio.run(_run, gw.port, gw.proc.pid, a.streams, a.settle)
    finally:
        gw.stop()
        eng.stop()
    res["streams"] = a.streams
    res["when"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
