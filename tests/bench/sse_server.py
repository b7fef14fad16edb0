"""A tiny HTTP/1.1 server for ``bench serve``'s client tests: it records each request and
answers with what a script returns (status, SSE events with their delays), plain or over TLS.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Reply:
    status: int = 200
    events: list[tuple[float, bytes]] = field(default_factory=list)  # (delay before, bytes)
    body: bytes = b""


def sse(obj: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return head + b"data: " + data.encode() + b"\n\n"


def messages_stream(pieces: list[str], input_tokens: int = 12, itl: float = 0.01) -> Reply:
    """Anthropic's Messages stream of ``pieces`` (one text_delta each)."""
    ev: list[tuple[float, bytes]] = [
        (0.0, sse({"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [],
            "model": "m", "usage": {"input_tokens": input_tokens, "output_tokens": 1}}},
            "message_start")),
        (0.0, sse({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}, "content_block_start")),
        (0.0, sse({"type": "ping"}, "ping"))]
    for p in pieces:
        ev.append((itl, sse({"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": p}},
                            "content_block_delta")))
    ev += [(0.0, sse({"type": "content_block_stop", "index": 0}, "content_block_stop")),
           (0.0, sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                      "usage": {"output_tokens": len(pieces)}}, "message_delta")),
           (0.0, sse({"type": "message_stop"}, "message_stop"))]
    return Reply(events=ev)


def chat_stream(pieces: list[str], itl: float = 0.01, done: bool = True) -> Reply:
    ev = [(itl, sse({"choices": [{"index": 0, "delta": {"content": p}}]})) for p in pieces]
    ev.append((0.0, sse({"choices": [], "usage": {"prompt_tokens": 9,
                                                  "completion_tokens": len(pieces)}})))
    if done:
        ev.append((0.0, b"data: [DONE]\n\n"))
    return Reply(events=ev)


class Server:
    def __init__(self, script: Callable[[Seen], Reply],
                 tls: ssl.SSLContext | None = None) -> None:
        self.script = script
        self.tls = tls
        self.seen: list[Seen] = []
        self.port = 0

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        if self.tls is not None:
            listeners = [trio.SSLListener(ln, self.tls, https_compatible=True)
                         for ln in listeners]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: Any) -> None:
        try:
            buf = b""
            while b"\r\n\r\n" not in buf:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buf += data
            head, _, body = buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (ln.partition(":") for ln in lines[1:])}
            need = int(headers.get("content-length", "0"))
            while len(body) < need:
                body += await stream.receive_some(65536)
            seen = Seen(method, path, headers, json.loads(body) if body else None)
            self.seen.append(seen)
            reply = self.script(seen)
            ctype = "text/event-stream" if reply.status == 200 else "application/json"
            await stream.send_all(f"HTTP/1.1 {reply.status} X\r\nContent-Type: {ctype}\r\n"
                                  "Connection: close\r\n\r\n".encode() + reply.body)
            for delay, chunk in reply.events:
                if delay:
                    await trio.sleep(delay)
                await stream.send_all(chunk)
            await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
