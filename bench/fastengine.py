"""A lean clocked fake engine for benchmarks: SGLang's wire protocol at a few µs per chunk.

Why not ``engine/fake.py``: that engine is built for fault-injection tests (h11, a cancel scope
and a dict-built, msgspec-encoded chunk per token); it costs ~120-220 µs of CPU per chunk, so
on two cores it cannot feed more than a few thousand chunks/s, far below what a relay benchmark
needs. This one keeps only what the relay benchmarks exercise, on raw non-blocking sockets:

* ``POST /generate`` (native, streaming, ``--incremental`` deltas or cumulative text) and
  ``POST /v1/chat/completions`` (OpenAI, streaming, ``n`` choices; distinct tokens per request:
  LiteLLM cuts a stream of 100 identical chunks);
* ``POST /abort_request {"rid"}`` (ends that rid with SGLang's abort chunk then ``[DONE]``);
  a client closing its connection cancels its generations;
* ``GET /health``, ``/health_generate``, ``/server_info``, ``/model_info``, ``/v1/models``;
* ``GET /_bench/stats``: counters (finished, aborted, cancelled, running, chunks_sent, ...).

The decode clock: each generation emits its first token ``ttft`` after arrival, then one token
every ``itl`` (a heap of deadlines, one timer task for the whole engine; ``itl = 0`` emits
back-to-back, one token per generation per scheduler pass, like a batch decode step). Chunks of
one connection that fall due in the same pass are written with one ``send``.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import socket
import sys
import time
import uuid
import zlib
from typing import Any

import trio

from engine.fake import default_tokens

_HEAD_SSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
_DONE = b"data: [DONE]\n\n"
_END = b"0\r\n\r\n"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _json_response(status: int, obj: Any) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "OK")
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


class Conn:
    __slots__ = ("chat", "finishes", "left", "out", "pending", "scope", "sock", "streams")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = b""
        self.out: list[bytes] = []
        self.streams: list[Gen] = []
        self.left = 0
        self.scope: trio.CancelScope | None = None
        self.chat: dict[str, Any] | None = None
        self.finishes: list[bytes] = []


class Gen:
    __slots__ = ("conn", "done", "i", "ids", "index", "limit", "rid", "texts", "total")

    def __init__(self, conn: Conn, rid: str, index: int, seed: int, tokens: int, limit: int):
        self.conn = conn
        self.rid = rid
        self.index = index
        self.texts, self.ids = default_tokens(seed, tokens)
        self.total = min(tokens, limit)
        self.limit = limit
        self.i = 0
        self.done = False


class FastEngine:
    def __init__(self, ttft: float, itl: float, tokens: int, incremental: bool) -> None:
        self.ttft = ttft
        self.itl = itl
        self.tokens = tokens
        self.incremental = incremental
        self.heap: list[tuple[float, int, Gen]] = []
        self.seq = itertools.count()
        self.kick = trio.Event()
        self.running: dict[str, Gen] = {}
        self.c = dict.fromkeys(
            ("connections", "requests", "generate", "chat", "streams_started", "finished",
             "aborted", "cancelled", "aborts_received", "chunks_sent", "late"), 0,
        )
        self.port = 0

    # ---- socket helpers --------------------------------------------------------------------
    async def _recv(self, sock: socket.socket) -> bytes:
        while True:
            try:
                return sock.recv(65536)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)

    def _write(self, conn: Conn, data: bytes) -> None:
        if conn.pending:
            conn.pending += data
            return
        try:
            n = conn.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:
            return
        if n < len(data):
            conn.pending = data[n:]
            self.nursery.start_soon(self._flush, conn)

    async def _flush(self, conn: Conn) -> None:
        try:
            while conn.pending:
                await trio.lowlevel.wait_writable(conn.sock)
                try:
                    n = conn.sock.send(conn.pending)
                except BlockingIOError:
                    continue
                conn.pending = conn.pending[n:]
        except (OSError, trio.ClosedResourceError):
            conn.pending = b""

    # ---- serving -----------------------------------------------------------------------------
    async def serve(self, port: int, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED):
        lsock = socket.socket()
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind(("127.0.0.1", port))
        lsock.listen(4096)
        lsock.setblocking(False)
        self.port = lsock.getsockname()[1]
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self._clock)
            task_status.started(self.port)
            while True:
                try:
                    sock, _ = lsock.accept()
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(lsock)
                    continue
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.c["connections"] += 1
                nursery.start_soon(self._conn, sock)

    async def _conn(self, sock: socket.socket) -> None:
        buf = b""
        conn = Conn(sock)
        try:
            while True:
                while (e := buf.find(b"\r\n\r\n")) < 0:
                    data = await self._recv(sock)
                    if not data:
                        return
                    buf += data
                head = buf[:e].decode("latin-1")
                lines = head.split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                clen = 0
                for ln in lines[1:]:
                    k, _, v = ln.partition(":")
                    if k.strip().lower() == "content-length":
                        clen = int(v)
                buf = buf[e + 4 :]
                while len(buf) < clen:
                    data = await self._recv(sock)
                    if not data:
                        return
                    buf += data
                body, buf = buf[:clen], buf[clen:]
                self.c["requests"] += 1
                if not await self._route(conn, method, path.split("?", 1)[0], body):
                    return
        except OSError:
            return
        finally:
            for g in conn.streams:
                if not g.done:
                    g.done = True
                    self.running.pop(g.rid, None)
                    self.c["cancelled"] += 1
            sock.close()

    async def _route(self, conn: Conn, method: str, path: str, body: bytes) -> bool:
        w = self._write
        if path == "/generate" and method == "POST":
            return await self._generate(conn, json.loads(body))
        if path == "/v1/chat/completions" and method == "POST":
            return await self._chat(conn, json.loads(body))
        if path == "/abort_request" and method == "POST":
            rid = json.loads(body).get("rid")
            self.c["aborts_received"] += 1
            g = self.running.get(rid)
            if g is not None:
                self._abort(g)
            w(conn, _json_response(200, {}))
        elif path in ("/health", "/health_generate", "/ready"):
            w(conn, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        elif path in ("/server_info", "/get_server_info"):
            w(conn, _json_response(200, {
                "model_path": "bench-model", "tokenizer_path": "bench-model",
                "served_model_name": "bench-model", "context_length": 8192,
                "incremental_streaming_output": self.incremental, "version": "0.5.23",
                "frontend": "bench-fast"}))
        elif path in ("/model_info", "/get_model_info"):
            w(conn, _json_response(200, {
                "model_path": "bench-model", "tokenizer_path": "bench-model",
                "is_generation": True}))
        elif path == "/v1/models":
            w(conn, _json_response(200, {"object": "list", "data": [
                {"id": "bench-model", "object": "model", "owned_by": "bench"}]}))
        elif path == "/_bench/stats":
            st = dict(self.c)
            st["running"] = len(self.running)
            w(conn, _json_response(200, st))
        else:
            w(conn, _json_response(404, {"detail": "Not Found"}))
        return True

    def _start(self, conn: Conn, gens: list[Gen]) -> None:
        conn.streams = gens
        conn.left = len(gens)
        conn.finishes = []
        due = time.monotonic() + self.ttft
        for g in gens:
            self.running[g.rid] = g
            heapq.heappush(self.heap, (due, next(self.seq), g))
        self.c["streams_started"] += len(gens)
        self.kick.set()

    async def _wait_done(self, conn: Conn) -> bool:
        """Wait until the connection's generations end; False if the client left."""
        with trio.CancelScope() as scope:
            conn.scope = scope
            while True:
                await trio.lowlevel.wait_readable(conn.sock)
                try:
                    data = conn.sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    return False
        conn.scope = None
        return True

    async def _generate(self, conn: Conn, body: dict[str, Any]) -> bool:
        self.c["generate"] += 1
        sp = body.get("sampling_params") or {}
        limit = sp.get("max_new_tokens")
        limit = 128 if "max_new_tokens" not in sp else (limit if limit is not None else 1 << 30)
        rid = body.get("rid") or uuid.uuid4().hex
        if not body.get("stream"):
            self._write(conn, _json_response(400, {"error": {"message": "bench: stream only"}}))
            return True
        conn.chat = None
        g = Gen(conn, rid, 0, zlib.crc32(rid.encode()), self.tokens, limit)
        self._write(conn, _HEAD_SSE)
        self._start(conn, [g])
        return await self._wait_done(conn)

    async def _chat(self, conn: Conn, body: dict[str, Any]) -> bool:
        self.c["chat"] += 1
        n = body.get("n") or 1
        limit = body.get("max_completion_tokens", body.get("max_tokens")) or (1 << 30)
        cid = "chatcmpl-" + uuid.uuid4().hex
        if not body.get("stream"):
            self._write(conn, _json_response(400, {"error": {"message": "bench: stream only"}}))
            return True
        conn.chat = {
            "pre": (
                '{"id":"%s","object":"chat.completion.chunk","created":%d,"model":"%s",'  # noqa: UP031
                '"choices":[{"index":' % (cid, int(time.time()), body.get("model", "bench-model"))
            ).encode()
        }
        seed = zlib.crc32(json.dumps(body.get("messages")).encode()) ^ zlib.crc32(cid.encode())
        gens = [
            Gen(conn, cid if n == 1 else f"{cid}_{i}", i, seed + 104729 * i, self.tokens, limit)
            for i in range(n)
        ]
        self._write(conn, _HEAD_SSE)
        self._start(conn, gens)
        return await self._wait_done(conn)

    # ---- chunks -----------------------------------------------------------------------------
    def _token_chunk(self, g: Gen) -> bytes:
        i = g.i
        chat = g.conn.chat
        if chat is not None:
            pre = chat["pre"]
            out = b""
            if i == 0:
                out = _sse(pre + b'%d,"delta":{"role":"assistant","content":""},'
                           b'"logprobs":null,"finish_reason":null}]}' % g.index)
            return out + _sse(pre + b'%d,"delta":{"content":"%s"},"logprobs":null,'
                              b'"finish_reason":null}]}' % (g.index, g.texts[i].encode()))
        if g.i + 1 == g.total:
            fr = (b'{"type":"length","length":%d}' % g.total if g.total == g.limit
                  else b'{"type":"stop","matched":2}')
        else:
            fr = b"null"
        if self.incremental:
            text, ids = g.texts[i], str(g.ids[i])
        else:
            text, ids = "".join(g.texts[: i + 1]), ",".join(map(str, g.ids[: i + 1]))
        return _sse(
            b'{"text":"%s","output_ids":[%s],"meta_info":{"id":"%s","finish_reason":%s,'
            b'"prompt_tokens":8,"completion_tokens":%d,"cached_tokens":0,"reasoning_tokens":0,'
            b'"weight_version":"default"}}'
            % (text.encode(), ids.encode(), g.rid.encode(), fr, i + 1)
        )

    def _end_gen(self, g: Gen, fin: bytes | None) -> None:
        """A generation ended (finished or aborted); end the response when it was the last."""
        g.done = True
        self.running.pop(g.rid, None)
        conn = g.conn
        if fin is not None:
            conn.finishes.append(fin)
        conn.left -= 1
        if conn.left == 0:
            conn.out.extend(conn.finishes)
            conn.out.append(_chunk(_DONE))
            conn.out.append(_END)
            data = b"".join(conn.out)
            conn.out = []
            self._write(conn, data)
            if conn.scope is not None:
                conn.scope.cancel()

    def _abort(self, g: Gen) -> None:
        if g.done:
            return
        self.c["aborted"] += 1
        chat = g.conn.chat
        if chat is not None:
            fin = _chunk(_sse(chat["pre"] + b'%d,"delta":{},"logprobs":null,'
                              b'"finish_reason":"abort"}]}' % g.index))
        else:
            fin = _chunk(_sse(
                b'{"text":"%s","output_ids":[%d],"meta_info":{"id":"%s","finish_reason":'
                b'{"type":"abort","message":"Aborted","status_code":null,"err_type":null},'
                b'"prompt_tokens":8,"completion_tokens":%d,"cached_tokens":0,'
                b'"reasoning_tokens":0,"weight_version":"default"}}'
                % ("".join(g.texts[: g.i]).encode(), g.ids[max(g.i - 1, 0)], g.rid.encode(), g.i)
            ))
        self.c["chunks_sent"] += 1
        self._end_gen(g, fin)

    async def _clock(self) -> None:
        heap = self.heap
        c = self.c
        while True:
            if not heap:
                self.kick = trio.Event()
                await self.kick.wait()
                continue
            now = time.monotonic()
            due = heap[0][0]
            if due > now:
                self.kick = trio.Event()
                with trio.move_on_after(due - now):
                    await self.kick.wait()
                continue
            touched: list[Conn] = []
            limit = now + 0.0002
            batch = []
            while heap and heap[0][0] <= limit:
                batch.append(heapq.heappop(heap))
            for d, _, g in batch:
                if g.done:
                    continue
                if now - d > max(self.itl, 0.001):
                    c["late"] += 1
                conn = g.conn
                if not conn.out:
                    touched.append(conn)
                conn.out.append(_chunk(self._token_chunk(g)))
                c["chunks_sent"] += 1
                g.i += 1
                if g.i >= g.total:
                    c["finished"] += 1
                    fin = None
                    if conn.chat is not None:
                        reason = b'"length"' if g.total == g.limit else b'"stop"'
                        fin = _chunk(_sse(conn.chat["pre"] + b'%d,"delta":{},"logprobs":null,'
                                          b'"finish_reason":%s}]}' % (g.index, reason)))
                        c["chunks_sent"] += 1
                    self._end_gen(g, fin)
                else:
                    heapq.heappush(heap, (max(d + self.itl, now) if self.itl else now,
                                          next(self.seq), g))
            for conn in touched:
                if conn.out:
                    data = b"".join(conn.out)
                    conn.out = []
                    self._write(conn, data)
            await trio.lowlevel.checkpoint()


def _sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.fastengine")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--incremental", action="store_true")
    a = p.parse_args(argv)
    eng = FastEngine(a.ttft_ms / 1000, a.itl_ms / 1000, a.tokens, a.incremental)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(eng.serve, a.port)
            print(f"fast fake engine listening on http://127.0.0.1:{port}", flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
