"""The native (C) benchmark harness: bench/native/harness.c, built by bench/native.py.

Engine mode is checked on the wire (SGLang's /generate stream, aborts, disconnects, HTTP
framing), load mode against the native engine, the Python fast engine and a scripted server
that fragments its chunked responses on purpose.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import native
from bench.runner import Layout
from bench.targets import ROOT, free_port, wait_http
from engine.fake import default_tokens

# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def exe() -> Path:
    if native.compiler() is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH: the native harness cannot be built")
    return native.binary()


def _start_engine(exe: Path, *extra: str) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([str(exe), "engine", "--port", "0", *extra], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("native fake engine listening on http://127.0.0.1:"), line
    return p, int(line.rsplit(":", 1)[1])


@contextlib.contextmanager
def _engine(exe: Path, *extra: str) -> Iterator[int]:
    p, port = _start_engine(exe, *extra)
    try:
        yield port
    finally:
        p.terminate()
        p.wait(5)


@pytest.fixture(scope="module")
def engine(exe: Path) -> Iterator[int]:
    with _engine(exe, "--itl-ms", "5", "--tokens", "400", "--incremental") as port:
        yield port


# ---- a minimal raw HTTP/1.1 client (the framing is what is under test) ------------------------


class Raw:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("connection closed")
        self.buf += data

    def head(self) -> tuple[int, dict[str, str]]:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        hdrs = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        return int(lines[0].split(" ")[1]), hdrs

    def body(self, hdrs: dict[str, str]) -> bytes:
        n = int(hdrs["content-length"])
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def chunk(self) -> bytes | None:
        """One chunk's payload; None for the last (zero-size) chunk."""
        while b"\r\n" not in self.buf:
            self._more()
        line, rest = self.buf.split(b"\r\n", 1)
        size = int(line.split(b";")[0], 16)
        while len(rest) < size + 2:
            self._more()
            line, rest = self.buf.split(b"\r\n", 1)
        assert rest[size : size + 2] == b"\r\n"
        self.buf = rest[size + 2 :]
        return rest[:size] if size else None

    def events(self, limit: int | None = None) -> list[bytes]:
        """SSE events up to the end of the response (or ``limit`` of them)."""
        out: list[bytes] = []
        sse = b""
        while limit is None or len(out) < limit:
            c = self.chunk()
            if c is None:  # "0\r\n\r\n" (no trailers) consumed
                assert not sse
                return out
            sse += c
            while b"\n\n" in sse:
                ev, sse = sse.split(b"\n\n", 1)
                out.append(ev)
        return out


def _post(path: str, body: dict[str, Any]) -> bytes:
    b = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(b)}\r\n\r\n").encode() + b


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def _json_get(port: int, path: str) -> tuple[int, Any]:
    c = Raw(port)
    try:
        c.send(_get(path))
        st, h = c.head()
        body = c.body(h)
        return st, json.loads(body) if body else None
    finally:
        c.close()


def _stats(port: int) -> dict[str, int]:
    return _json_get(port, "/_bench/stats")[1]  # type: ignore[no-any-return]


def _data(ev: bytes) -> Any:
    assert ev.startswith(b"data: "), ev
    return json.loads(ev[6:])


# ---- engine mode ------------------------------------------------------------------------------


def test_health_info_and_404(engine: int) -> None:
    c = Raw(engine)
    try:
        # pipelined: three requests in one write, three responses in order
        c.send(_get("/health") + _get("/server_info") + _get("/v1/models"))
        st, h = c.head()
        assert st == 200 and c.body(h) == b""
        st, h = c.head()
        info = json.loads(c.body(h))
        assert st == 200 and info["incremental_streaming_output"] is True
        assert info["served_model_name"] == "bench-model"
        st, h = c.head()
        assert json.loads(c.body(h))["data"][0]["id"] == "bench-model"
    finally:
        c.close()
    assert _json_get(engine, "/model_info") == (200, {
        "model_path": "bench-model", "tokenizer_path": "bench-model", "is_generation": True})
    assert _json_get(engine, "/health_generate")[0] == 200
    assert _json_get(engine, "/nope") == (404, {"detail": "Not Found"})


def test_generate_stream_matches_fastengine_tokens(engine: int) -> None:
    rid = "req-42-0"
    body = {"text": "<|user|>hi", "stream": True, "rid": rid,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.5}}
    # a request split across writes (head cut mid-line, body cut mid-JSON), with the next
    # request pipelined behind it: it is answered once the stream has ended
    raw = _post("/generate", body) + _get("/health")
    c = Raw(engine)
    try:
        for piece in (raw[:7], raw[7:40], raw[40:-40], raw[-40:]):
            c.send(piece)
            time.sleep(0.01)
        st, h = c.head()
        assert st == 200 and h["transfer-encoding"] == "chunked"
        assert h["content-type"] == "text/event-stream"
        evs = c.events()
        st2, h2 = c.head()
        assert st2 == 200 and c.body(h2) == b""
        assert c.buf == b""
    finally:
        c.close()
    assert evs[-1] == b"data: [DONE]"
    chunks = [_data(e) for e in evs[:-1]]
    texts, ids = default_tokens(zlib.crc32(rid.encode()), 12)
    assert [x["text"] for x in chunks] == texts
    assert [x["output_ids"] for x in chunks] == [[i] for i in ids]
    assert len(set(texts)) == 12
    for k, x in enumerate(chunks):
        m = x["meta_info"]
        assert m["id"] == rid and m["completion_tokens"] == k + 1 and m["prompt_tokens"] == 8
        assert m["cached_tokens"] == 0
        assert m["finish_reason"] == (None if k < 11 else {"type": "length", "length": 12})
    # another rid, other tokens
    c = Raw(engine)
    try:
        c.send(_post("/generate", {**body, "rid": "req-43-0"}))
        c.head()
        other = [_data(e)["text"] for e in c.events()[:-1]]
    finally:
        c.close()
    assert other != texts


def test_generate_defaults_and_stop(exe: Path) -> None:
    # --tokens below max_new_tokens: the generation stops early ("stop"); no max_new_tokens: 128
    with _engine(exe, "--tokens", "3", "--incremental") as port:
        c = Raw(port)
        try:
            c.send(_post("/generate", {"text": "x", "stream": True, "rid": "a",
                                       "sampling_params": {"max_new_tokens": 10}}))
            c.head()
            evs = c.events()
            c.send(_post("/generate", {"text": "x", "rid": "b"}))
            st, h = c.head()
            err = json.loads(c.body(h))
        finally:
            c.close()
        assert _data(evs[-2])["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
        assert st == 400 and "stream only" in err["error"]["message"]


def test_cumulative_text(exe: Path) -> None:
    with _engine(exe, "--tokens", "50") as port:
        assert _json_get(port, "/server_info")[1]["incremental_streaming_output"] is False
        c = Raw(port)
        try:
            c.send(_post("/generate", {"text": "x", "stream": True, "rid": "cum",
                                       "sampling_params": {"max_new_tokens": 4}}))
            c.head()
            chunks = [_data(e) for e in c.events()[:-1]]
        finally:
            c.close()
    texts, ids = default_tokens(zlib.crc32(b"cum"), 4)
    assert [x["text"] for x in chunks] == ["".join(texts[: k + 1]) for k in range(4)]
    assert chunks[-1]["output_ids"] == ids


def test_abort_ends_the_stream(engine: int) -> None:
    before = _stats(engine)
    c = Raw(engine)
    try:
        c.send(_post("/generate", {"text": "x", "stream": True, "rid": "to-abort",
                                   "sampling_params": {"max_new_tokens": 400}}))
        c.head()
        first = c.events(limit=3)
        assert _stats(engine)["running"] == before["running"] + 1
        assert _json_get(engine, "/abort_request")[0] == 404  # GET: not the abort route
        a = Raw(engine)
        try:
            a.send(_post("/abort_request", {"rid": "to-abort"}))
            st, h = a.head()
            assert st == 200 and json.loads(a.body(h)) == {}
        finally:
            a.close()
        rest = c.events()
    finally:
        c.close()
    assert rest[-1] == b"data: [DONE]"
    fin = _data(rest[-2])
    assert fin["meta_info"]["finish_reason"]["type"] == "abort"
    n = fin["meta_info"]["completion_tokens"]
    assert 3 <= n < 400 and len(first) + len(rest) - 2 == n
    texts, _ = default_tokens(zlib.crc32(b"to-abort"), n)
    assert fin["text"] == "".join(texts)
    after = _stats(engine)
    assert after["aborted"] == before["aborted"] + 1
    assert after["aborts_received"] == before["aborts_received"] + 1
    assert after["running"] == before["running"]
    assert after["chunks_sent"] - before["chunks_sent"] == n + 1


def test_closed_connection_cancels(engine: int) -> None:
    before = _stats(engine)
    c = Raw(engine)
    c.send(_post("/generate", {"text": "x", "stream": True, "rid": "leaver"}))
    c.head()
    c.events(limit=2)
    c.close()
    deadline = time.monotonic() + 5
    while (st := _stats(engine))["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert st["cancelled"] == before["cancelled"] + 1
    assert st["running"] == before["running"]
    assert st["streams_started"] == before["streams_started"] + 1
    assert st["connections"] >= before["connections"] + 2


def test_chat_path_n2(engine: int) -> None:
    c = Raw(engine)
    try:
        c.send(_post("/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "n": 2, "max_tokens": 3}))
        c.head()
        evs = c.events()
    finally:
        c.close()
    assert evs[-1] == b"data: [DONE]"
    chunks = [_data(e) for e in evs[:-1]]
    assert all(x["object"] == "chat.completion.chunk" and x["model"] == "m" for x in chunks)
    for i in (0, 1):
        mine = [x["choices"][0] for x in chunks if x["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert len({m["delta"]["content"] for m in mine[1:-1]}) == 3
        assert mine[-1]["finish_reason"] == "length"


def test_bad_requests(engine: int) -> None:
    c = Raw(engine)
    try:
        bad = b'{"stream": tru'
        c.send(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
               % (len(bad), bad))
        st, h = c.head()
        assert st == 400 and "error" in json.loads(c.body(h))
        c.send(_get("/health"))  # still usable after a 400 for a bad body
        st, h = c.head()
        assert st == 200
    finally:
        c.close()


# ---- load mode --------------------------------------------------------------------------------


def _cfg(port: int, path: str = "/v1/chat/completions", **kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"port": port, "path": path, "headers": {"X-Bench": "1"}, "n": 1,
                           "fanout": 1, "tokens": 20, "concurrency": 4, "duration": 1.2,
                           "warmup": 0.4, "ramp": 0.1, "sut_pids": [], "engine_pids": [],
                           "request_timeout": 10.0}
    cfg.update(kw)
    return cfg


def test_loadgen_against_native_engine(engine: int) -> None:
    r = native.run_native_loadgen(_cfg(engine, concurrency=8), Layout(None, None), "test")
    assert "error" not in r, r.get("error")
    assert r["errors"] == {} and r["window_errors"] == 0
    # 8 streams at 5 ms ITL: 1,600 content chunks/s, plus a role and a finish chunk per 20
    assert 1000 < r["chunks_per_s"] < 2400, r["chunks_per_s"]
    assert r["requests_completed"] > 0 and r["ttft_ms"]["count"] > 0
    assert 3.0 < r["gap_ms"]["p50"] < 8.0
    assert r["gap_ms"]["count"] <= r["content_chunks"]
    assert len(r["gap_samples"]) == min(4000, r["gap_ms"]["count"])
    assert r["loadgen_cpu_us_per_chunk"] > 0 and r["engine_cpu_us_per_chunk"] == 0
    assert r["mean_inflight"] == pytest.approx(8, abs=0.5)
    assert r["loadgen"] == "native"


def test_loadgen_against_python_fastengine(exe: Path) -> None:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "bench.fastengine", "--port", str(port),
                          "--itl-ms", "5", "--incremental"], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(port, "/health", 20, p, what="fastengine")
        r = native.run_native_loadgen(_cfg(port, n=2, engine_pids=[p.pid]),
                                      Layout(None, None), "test")
    finally:
        p.terminate()
        p.wait(5)
    assert "error" not in r, r.get("error")
    assert r["errors"] == {} and r["chunks"] > 500
    # n = 2 in one response: all-n-first waits for both choices
    assert r["all_first_ms"]["count"] == r["ttft_ms"]["count"] > 0
    assert r["all_first_ms"]["p50"] >= r["ttft_ms"]["p50"]
    assert r["engine_cpu_us_per_chunk"] > 0


def test_loadgen_refuses_what_it_does_not_implement() -> None:
    r = native.run_native_loadgen(_cfg(1, rate=10.0), Layout(None, None), "t")
    assert "not implemented: rate" in r["error"]
    r = native.run_native_loadgen(_cfg(1, fanout=4, n=4), Layout(None, None), "t")
    assert "fanout" in r["error"]


# A scripted server: answers the first `serve` requests of each connection with `respond`,
# written in random fragments, then holds the next request open without answering.

EVENTS = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}']
EVENTS += [b'data: {"choices":[{"index":0,"delta":{"content":"w%d"}}]}' % i for i in range(7)]
EVENTS += [b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}',
           b"data: [DONE]"]


def _chunked(events: list[bytes], rng: random.Random) -> bytes:
    """Events as an SSE stream cut into chunks at random places (several events per chunk,
    events split across chunks), with a chunk extension and upper-case hex now and then."""
    sse = b"".join(e + b"\n\n" for e in events)
    out = b""
    pos = 0
    while pos < len(sse):
        n = rng.randint(1, 300)
        part = sse[pos : pos + n]
        pos += n
        size = (b"%X" if rng.random() < 0.5 else b"%x") % len(part)
        ext = b";ext=1" if rng.random() < 0.2 else b""
        out += size + ext + b"\r\n" + part + b"\r\n"
    return out + b"0\r\n\r\n"


MAX_CONNECTIONS = 32


def _scripted_server(respond: Callable[[random.Random], bytes], serve: int) -> tuple[int, Any]:
    """A server answering ``serve`` requests per connection with ``respond``, on at most
    :data:`MAX_CONNECTIONS` connections: a client whose every request fails reconnects at once,
    about a thousand times a second, and a thread per connection at that rate on a busy machine
    is how a test server drops connections. Later connections wait in the backlog until the
    load generator stops (in flight, not errors)."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    stop = threading.Event()

    def conn(s: socket.socket, seed: int) -> None:
        rng = random.Random(seed)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        served = 0
        with s, contextlib.suppress(OSError):  # the client resets connections it gives up on
            while not stop.is_set():
                while b"\r\n\r\n" not in buf:
                    data = s.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
                assert b"\r\nX-Bench: 1\r\n" in head
                n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buf) < n:
                    buf += s.recv(65536)
                req, buf = json.loads(buf[:n]), buf[n:]
                assert req["stream"] is True and req["n"] == 1
                if served == serve:
                    stop.wait(10)  # hold the request open until the test ends
                    return
                served += 1
                data = respond(rng)
                pos = 0
                while pos < len(data):  # random fragments, often mid-line
                    k = rng.randint(1, 80)
                    s.sendall(data[pos : pos + k])
                    pos += k
                    if rng.random() < 0.3:
                        time.sleep(0.0005)

    def accept() -> None:
        for k in range(1, MAX_CONNECTIONS + 1):
            try:
                s, _ = lsock.accept()
            except OSError:
                return
            threading.Thread(target=conn, args=(s, k), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()

    def close() -> None:
        stop.set()
        lsock.close()

    return lsock.getsockname()[1], close


OK_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"transfer-encoding: chunked\r\n\r\n")


def _run_scripted(respond: Callable[[random.Random], bytes], serve: int,
                  concurrency: int = 3) -> dict[str, Any]:
    port, close = _scripted_server(respond, serve)
    try:
        return native.run_native_loadgen(
            _cfg(port, concurrency=concurrency, warmup=0.0, ramp=0.0, duration=1.0),
            Layout(None, None), "t")
    finally:
        close()


def test_loadgen_chunked_framing_fragmented() -> None:
    r = _run_scripted(lambda rng: OK_HEAD + _chunked(EVENTS, rng), serve=5)
    assert "error" not in r, r.get("error")
    assert r["errors"] == {}
    assert r["requests_completed"] == 15
    # every data event but [DONE] is a chunk; 7 of the 9 carry content
    assert r["chunks"] == 15 * 9 and r["content_chunks"] == 15 * 7
    assert r["gap_ms"]["count"] == 15 * 6
    assert r["ttft_ms"]["count"] == 15
    assert r["inflight_at_stop"] == 3


def test_loadgen_content_length_body() -> None:
    body = b"".join(e + b"\n\n" for e in EVENTS)
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
            % len(body))
    r = _run_scripted(lambda rng: head + body, serve=2, concurrency=2)
    assert r["errors"] == {} and r["requests_completed"] == 4 and r["chunks"] == 4 * 9


@pytest.mark.parametrize(("respond", "kind"), [
    (lambda rng: b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\n{}",
     "http_503"),
    (lambda rng: OK_HEAD + _chunked(EVENTS[:-1], rng), "stream ended without [DONE]"),
    (lambda rng: OK_HEAD + _chunked([*EVENTS[:3], b'data: {"error": {"message": "boom"}}'],
                                    rng), "error event"),
    (lambda rng: OK_HEAD + b"zz\r\n", "bad chunk size"),
])
def test_loadgen_errors(respond: Callable[[random.Random], bytes], kind: str) -> None:
    r = _run_scripted(respond, serve=1, concurrency=2)
    assert "error" not in r, r.get("error")
    # each client's first request fails; its retry opens a new connection, served again
    assert set(r["errors"]) == {kind}
    assert r["errors"][kind] >= 2
    assert r["requests_completed"] == 0
