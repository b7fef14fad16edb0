"""The load generator: raw trio sockets, a minimal HTTP/1.1 client and a minimal SSE scanner.

Run as its own process (``python -m bench.loadgen '<json config>'``, pinned by the orchestrator)
so that it never shares an interpreter with the system under test. It prints one JSON document
(the run's measurements) on stdout and ``PROGRESS {...}`` lines on stderr about once a second.

Per client request it records: the time to the first non-empty ``content`` (TTFT), the time until
every one of its ``n`` choices has had a non-empty ``content`` (fan-out), and every gap between two
content events of the same choice. A *chunk* is one SSE ``data:`` event other than ``[DONE]``.

Timing: ``warmup`` seconds (clients start staggered over ``ramp``), then a measurement *window* of
``duration`` seconds. Only chunks received in the window count for chunks/s; only requests that
started in the window give TTFT samples; only gaps whose both ends fall in the window count. The
CPU time and memory of the SUT's process tree (and the engine's) are read from /proc at the edges
of the window by this process itself, so the window the counters cover is exactly the window the
CPU covers.

Modes: closed loop (``concurrency`` clients, each sending its next request when the previous one
ends; ``fanout > 1`` makes each client request that many parallel sub-requests with ``n = 1``,
which is how "direct" and "nginx" serve ``n > 1``) and open loop (Poisson arrivals at ``rate``
per second, at most ``max_inflight`` at once; arrivals beyond that are counted as dropped).
``disconnect_after`` makes a client close its connection after that many content events.
``once`` makes each client send one request only (a burst of ``concurrency`` new streams, each
on a new connection: ``python -m bench burst``).
"""

from __future__ import annotations

import array
import json
import math
import random
import re
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from bench.procstat import cpu_between, sample_tree, tree_rss
from bench.serve.metrics import summary

_CONTENT = re.compile(rb'"content": ?"(?!")')
_INDEX = re.compile(rb'"index": ?(\d+)')
_ERROR = re.compile(rb'^data: ?\{"error"')


class ProtocolError(Exception):
    pass


class HTTPStatusError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


@dataclass
class Stats:
    """Everything measured; all times are ``trio.current_time()`` seconds."""

    ws: float = math.inf  # window start
    we: float = math.inf  # window end
    window_chunks: int = 0
    window_content: int = 0
    total_chunks: int = 0
    started: int = 0
    completed: int = 0
    window_completed: int = 0
    window_started: int = 0
    disconnects: int = 0
    window_disconnects: int = 0
    dropped: int = 0
    inflight: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    window_errors: int = 0
    ttft: array.array = field(default_factory=lambda: array.array("d"))
    all_first: array.array = field(default_factory=lambda: array.array("d"))
    gaps: array.array = field(default_factory=lambda: array.array("d"))
    inflight_samples: list[int] = field(default_factory=list)

    def error(self, kind: str, now: float) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if self.ws <= now <= self.we:
            self.window_errors += 1


class Request:
    """One client request: ``choices`` choices over ``fanout`` sub-requests."""

    __slots__ = ("all_at", "choices", "first_at", "firsts", "t0")

    def __init__(self, t0: float, choices: int) -> None:
        self.t0 = t0
        self.choices = choices
        self.firsts = 0
        self.first_at: float | None = None
        self.all_at: float | None = None


class Dechunker:
    """HTTP/1.1 chunked transfer decoding, incremental."""

    __slots__ = ("buf", "done", "need")

    def __init__(self) -> None:
        self.buf = b""
        self.need = 0  # >0: data bytes left; 0: expect size line; -1: expect CRLF; -2: trailer
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf = self.buf + data if self.buf else data
        pos = 0
        end = len(buf)
        out: list[bytes] = []
        while pos < end:
            need = self.need
            if need > 0:
                take = min(need, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self.need = need - take
                if self.need == 0:
                    self.need = -1
            elif need == -1:
                if end - pos < 2:
                    break
                pos += 2
                self.need = 0
            elif need == 0:
                e = buf.find(b"\r\n", pos)
                if e < 0:
                    break
                try:
                    size = int(buf[pos:e].split(b";", 1)[0], 16)
                except ValueError as exc:
                    raise ProtocolError("bad chunk size") from exc
                pos = e + 2
                self.need = size if size else -2
            else:  # trailer section: lines until an empty one
                e = buf.find(b"\r\n", pos)
                if e < 0:
                    break
                if e == pos:
                    pos += 2
                    self.done = True
                    break
                pos = e + 2
        self.buf = buf[pos:]
        return b"".join(out) if len(out) != 1 else out[0]


class Runner:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.host: str = cfg.get("host", "127.0.0.1")
        self.port: int = cfg["port"]
        self.path: str = cfg["path"]
        self.n: int = cfg.get("n", 1)
        self.fanout: int = cfg.get("fanout", 1)
        self.per_req_n = self.n // self.fanout
        self.tokens: int = cfg.get("tokens", 200)
        self.model: str = cfg.get("model", "bench-model")
        self.headers: dict[str, str] = cfg.get("headers", {})
        self.disconnect_after: int | None = cfg.get("disconnect_after")
        self.disconnect_fraction: float = cfg.get("disconnect_fraction", 1.0)
        self.request_timeout: float = cfg.get("request_timeout", 60.0)
        self.stats = Stats()
        self.stop = False
        self.seq = 0
        self.rng = random.Random(cfg.get("seed", 1))

    # ---- one HTTP request on one socket ------------------------------------------------
    def _request_bytes(self, n: int) -> bytes:
        self.seq += 1
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": f"Tell me a long story #{self.seq}."}],
                "stream": True,
                "max_tokens": self.tokens,
                "n": n,
            },
            separators=(",", ":"),
        ).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def _exchange(
        self, stream: trio.SocketStream, req: Request, base: int, leave_after: int | None
    ) -> bool:
        """Send one request, scan its SSE response; True if the connection can be reused."""
        st = self.stats
        await stream.send_all(self._request_bytes(self.per_req_n))
        buf = b""
        while True:
            data = await stream.receive_some(65536)
            if not data:
                raise ProtocolError("closed before the response head")
            buf += data
            e = buf.find(b"\r\n\r\n")
            if e >= 0:
                break
            if len(buf) > 65536:
                raise ProtocolError("response head too large")
        head = buf[:e].decode("latin-1")
        rest = buf[e + 4 :]
        lines = head.split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        hdrs = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            hdrs[k.strip().lower()] = v.strip().lower()
        chunked = "chunked" in hdrs.get("transfer-encoding", "")
        clen = int(hdrs["content-length"]) if "content-length" in hdrs else None
        keep = hdrs.get("connection") != "close"
        if status != 200:
            raise HTTPStatusError(status)
        dech = Dechunker() if chunked else None
        got = 0
        sse = b""
        last = [0.0] * self.per_req_n
        seen = [False] * self.per_req_n
        content_events = 0
        done = False
        data = rest
        while True:
            now = trio.current_time()
            if data:
                if dech is not None:
                    payload = dech.feed(data)
                else:
                    payload = data
                    got += len(data)
                if payload:
                    sse = sse + payload if sse else payload
                    start = 0
                    while True:
                        e = sse.find(b"\n\n", start)
                        if e < 0:
                            break
                        ev = sse[start:e]
                        start = e + 2
                        if ev.startswith(b"data: [DONE]") or ev.startswith(b"data:[DONE]"):
                            done = True
                            continue
                        if not ev.startswith(b"data:"):
                            continue
                        st.total_chunks += 1
                        inwin = st.ws <= now <= st.we
                        if inwin:
                            st.window_chunks += 1
                        if _CONTENT.search(ev) is None:
                            if _ERROR.match(ev):
                                raise ProtocolError("error event")
                            continue
                        if inwin:
                            st.window_content += 1
                        if self.per_req_n == 1:
                            idx = 0
                        else:
                            m = _INDEX.search(ev)
                            idx = int(m.group(1)) if m else 0
                            if idx >= self.per_req_n:
                                idx = 0
                        if seen[idx]:
                            if inwin and last[idx] >= st.ws:
                                st.gaps.append(now - last[idx])
                        else:
                            seen[idx] = True
                            timed = st.ws <= req.t0 and now <= st.we
                            if req.first_at is None:
                                req.first_at = now
                                if timed:
                                    st.ttft.append(now - req.t0)
                            req.firsts += 1
                            if req.firsts == req.choices:
                                req.all_at = now
                                if timed:
                                    st.all_first.append(now - req.t0)
                        last[idx] = now
                        content_events += 1
                        if leave_after is not None and content_events >= leave_after:
                            return False
                    sse = sse[start:]
                if dech is not None and dech.done:
                    break
                if clen is not None and got >= clen:
                    break
            data = await stream.receive_some(65536)
            if not data:
                if dech is None and clen is None:
                    break  # close-delimited body
                raise ProtocolError("connection closed mid-body")
        if not done:
            raise ProtocolError("stream ended without [DONE]")
        return keep

    # ---- one client request (possibly several sub-requests) ----------------------------
    async def _one(self, socks: list[trio.SocketStream | None]) -> None:
        st = self.stats
        t0 = trio.current_time()
        req = Request(t0, self.n)
        st.started += 1
        inwin0 = st.ws <= t0 <= st.we
        if inwin0:
            st.window_started += 1
        st.inflight += 1
        leave: int | None = None
        if self.disconnect_after is not None and self.rng.random() < self.disconnect_fraction:
            leave = self.disconnect_after
        failed: list[str] = []

        async def sub(k: int) -> None:
            s = socks[k]
            try:
                if s is None:
                    s = socks[k] = await trio.open_tcp_stream(self.host, self.port)
                with trio.fail_after(self.request_timeout):
                    keep = await self._exchange(s, req, k, leave)
                if not keep:
                    socks[k] = None
                    await s.aclose()
            except trio.TooSlowError:
                failed.append("timeout")
            except HTTPStatusError as exc:
                failed.append(f"http_{exc.status}")
            except ProtocolError as exc:
                failed.append(str(exc))
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                failed.append("connection")
            finally:
                if failed and socks[k] is not None:
                    s2 = socks[k]
                    socks[k] = None
                    assert s2 is not None
                    s2.socket.close()

        try:
            if self.fanout == 1:
                await sub(0)
            else:
                async with trio.open_nursery() as nursery:
                    for k in range(self.fanout):
                        nursery.start_soon(sub, k)
        finally:
            st.inflight -= 1
        now = trio.current_time()
        if failed:
            st.error(failed[0], now)
            return
        if leave is not None:
            st.disconnects += 1
            if st.ws <= now <= st.we:
                st.window_disconnects += 1
        else:
            st.completed += 1
            if st.ws <= now <= st.we:
                st.window_completed += 1

    async def _client(self, delay: float) -> None:
        await trio.sleep(delay)
        socks: list[trio.SocketStream | None] = [None] * self.fanout
        try:
            while not self.stop:
                await self._one(socks)
                if self.cfg.get("once"):
                    return
                if self.cfg.get("think", 0):
                    await trio.sleep(self.cfg["think"])
        finally:
            for s in socks:
                if s is not None:
                    s.socket.close()

    async def _open_loop(self, rate: float, max_inflight: int) -> None:
        idle: list[list[trio.SocketStream | None]] = []

        async def fire() -> None:
            socks = idle.pop() if idle else [None] * self.fanout
            try:
                await self._one(socks)
            finally:
                if not self.stop and all(s is not None for s in socks):
                    idle.append(socks)
                else:
                    for s in socks:
                        if s is not None:
                            s.socket.close()

        async with trio.open_nursery() as nursery:
            nxt = trio.current_time()
            while not self.stop:
                nxt += self.rng.expovariate(rate)
                await trio.sleep_until(nxt)
                if self.stats.inflight >= max_inflight:
                    self.stats.dropped += 1
                    continue
                nursery.start_soon(fire)
            nursery.cancel_scope.cancel()

    # ---- the run ---------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        st = self.stats
        sut = list(cfg.get("sut_pids", []))
        eng = list(cfg.get("engine_pids", []))
        warmup = float(cfg.get("warmup", 2.0))
        duration = float(cfg["duration"])
        ramp = float(cfg.get("ramp", 0.0))
        idle = sample_tree(sut)
        t_start = trio.current_time()
        st.ws = t_start + warmup
        st.we = st.ws + duration
        out: dict[str, Any] = {}
        rss_series: list[tuple[float, int]] = []

        async def sampler(nursery: trio.Nursery) -> None:
            await trio.sleep_until(st.ws)
            s0, e0 = sample_tree(sut), sample_tree(eng)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            w0 = time.monotonic()
            pids = s0.pids
            peak = s0.rss
            while trio.current_time() < st.we:
                await trio.sleep(min(0.5, max(0.0, st.we - trio.current_time())))
                r = tree_rss(pids)
                peak = max(peak, r)
                rss_series.append((trio.current_time() - st.ws, r))
                st.inflight_samples.append(st.inflight)
                if cfg.get("progress", True):
                    el = trio.current_time() - st.ws
                    print(
                        "PROGRESS " + json.dumps({
                            "t": round(el, 1), "of": duration, "chunks": st.window_chunks,
                            "inflight": st.inflight, "errors": sum(st.errors.values()),
                        }),
                        file=sys.stderr, flush=True,
                    )
            s1, e1 = sample_tree(sut), sample_tree(eng)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            wall = time.monotonic() - w0
            out.update(
                window_fields(wall, idle, s0, s1, e0, e1, peak),
                loadgen_cpu=(r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
                rss_series=rss_series,
                inflight_at_stop=st.inflight,
            )
            self.stop = True
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler, nursery)
            if cfg.get("rate"):
                nursery.start_soon(
                    self._open_loop, float(cfg["rate"]), cfg.get("max_inflight", 4096)
                )
            else:
                c = int(cfg["concurrency"])
                for i in range(c):
                    nursery.start_soon(self._client, ramp * i / c)
        return self._summary(out, duration)

    def _summary(self, out: dict[str, Any], duration: float) -> dict[str, Any]:
        st = self.stats
        wall = out.get("wall", duration) or duration
        res: dict[str, Any] = {
            "config": public_config(self.cfg),
            "window_s": wall,
            "chunks": st.window_chunks,
            "content_chunks": st.window_content,
            "chunks_per_s": st.window_chunks / wall,
            "requests_per_s": st.window_completed / wall,
            "requests_started": st.started,
            "requests_completed": st.completed,
            "window_completed": st.window_completed,
            "disconnects": st.disconnects,
            "window_disconnects": st.window_disconnects,
            "dropped": st.dropped,
            "errors": st.errors,
            "window_errors": st.window_errors,
            "mean_inflight": (sum(st.inflight_samples) / len(st.inflight_samples))
            if st.inflight_samples else 0.0,
            "ttft_ms": pct(st.ttft),
            "all_first_ms": pct(st.all_first),
            "gap_ms": pct(st.gaps),
            "ttft_samples": sample(st.ttft, 2000, self.rng),
            "gap_samples": sample(st.gaps, 4000, self.rng),
            "all_first_samples": sample(st.all_first, 2000, self.rng),
        }
        return with_window(res, out)


def public_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` without the process ids that only the orchestrator uses (as a result records it)."""
    return {k: v for k, v in cfg.items() if k not in ("sut_pids", "engine_pids")}


def with_window(res: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """A summary's counts ``res`` with the window's process figures ``out`` and the CPU per
    chunk, as both load generators report them."""
    chunks = res["chunks"]
    res.update(out)
    if out.get("sut_pids") and chunks:
        res["sut_cpu_us_per_chunk"] = out["sut_cpu"] / chunks * 1e6
        res["sut_cpu_ticks_us_per_chunk"] = out["sut_cpu_ticks"] / chunks * 1e6
    if chunks:
        res["engine_cpu_us_per_chunk"] = out.get("engine_cpu", 0.0) / chunks * 1e6
        res["loadgen_cpu_us_per_chunk"] = out.get("loadgen_cpu", 0.0) / chunks * 1e6
    return res


def window_fields(
    wall: float, idle: Any, s0: Any, s1: Any, e0: Any, e1: Any, peak: int
) -> dict[str, Any]:
    """The SUT's and engine's figures over one measurement window (``procstat`` samples at
    its edges), as both load generators report them."""
    return {
        "wall": wall,
        "sut_cpu": cpu_between(s0, s1),
        "sut_cpu_ticks": s1.cpu_ticks - s0.cpu_ticks,
        "sut_pids": list(s1.pids),
        "sut_rss_idle": idle.rss,
        "sut_rss_start": s0.rss,
        "sut_rss_end": s1.rss,
        "sut_rss_peak": max(peak, s1.rss),
        "sut_hwm": s1.hwm,
        "engine_cpu": cpu_between(e0, e1),
    }


def pct(values: array.array) -> dict[str, float | int]:
    """Percentiles in milliseconds (nearest-rank), plus count and mean (bench/serve/metrics.py's
    ``summary``, which ``bench serve`` reports with interpolated percentiles)."""
    out = summary(values, (50, 90, 99, 99.9), method="nearest", scale=1000)
    out.pop("min", None)
    return out


def sample(values: array.array, k: int, rng: random.Random) -> list[float]:
    """Up to ``k`` values (ms, rounded) for plotting distributions."""
    v = list(values)
    if len(v) > k:
        v = rng.sample(v, k)
    return [round(x * 1000, 3) for x in v]


def main() -> int:
    cfg = json.loads(sys.argv[1])
    res = trio.run(Runner(cfg).run)
    sys.stdout.write(json.dumps(res))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
