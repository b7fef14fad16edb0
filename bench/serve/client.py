"""One streamed request to an OpenAI-compatible or Anthropic Messages endpoint, timed.

Endpoints (``--endpoint``): ``chat`` (``/v1/chat/completions``), ``completions``
(``/v1/completions``; the history is sent as one text prompt) and ``messages`` (Anthropic's
``/v1/messages``). Every request streams; OpenAI requests ask for the usage chunk
(``stream_options.include_usage``) so that token counts can come from the server.

Timing: the request's start is just before it is sent; TTFT is the arrival of the first event
with non-empty text (``content``, ``reasoning_content`` or ``reasoning`` for chat; ``text``
for completions; a ``text_delta`` for Messages); every later text event ends one inter-token
gap (a gap spans one *event*, which may carry several tokens); end-to-end is the end of the
stream (``[DONE]`` or ``message_stop``).
"""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import trio

from bench.serve.metrics import RequestRecord
from bench.serve.workloads import Tokenizer

PATHS = {"chat": "/chat/completions", "completions": "/completions", "messages": "/messages"}
ANTHROPIC_VERSION = "2023-06-01"


def endpoint_url(base_url: str, endpoint: str) -> str:
    """``http://h:p`` or ``http://h:p/v1`` (any path ending in ``/v1``) → the endpoint's URL."""
    u = urlsplit(base_url.rstrip("/"))
    path = u.path if u.path.endswith("/v1") else u.path + "/v1"
    return urlunsplit((u.scheme, u.netloc, path + PATHS[endpoint], "", ""))


def metrics_url(base_url: str) -> str:
    """The default Prometheus URL of a deployment: its origin's ``/metrics``."""
    u = urlsplit(base_url)
    return urlunsplit((u.scheme, u.netloc, "/metrics", "", ""))


def tls_verify(insecure: bool, ca_file: str | None) -> ssl.SSLContext | bool:
    """httpx's ``verify``: False with ``insecure``; a context trusting ``ca_file`` (and not the
    system's roots); else the system's default verification."""
    if insecure:
        return False
    if ca_file:
        return ssl.create_default_context(cafile=ca_file)
    return True


@dataclass
class Endpoint:
    kind: str
    url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = False
    timeout_s: float = 600.0

    def body(self, system: str | None, history: list[dict[str, str]],
             max_tokens: int) -> dict[str, Any]:
        """The request's JSON body: ``history`` alternates user and assistant messages."""
        b: dict[str, Any]
        if self.kind == "messages":
            b = {"model": self.model, "max_tokens": max_tokens, "messages": history,
                 "stream": True}
            if system is not None:
                b["system"] = system
        elif self.kind == "chat":
            msgs = ([{"role": "system", "content": system}] if system is not None else [])
            b = {"model": self.model, "messages": msgs + history, "max_tokens": max_tokens,
                 "stream": True, "stream_options": {"include_usage": True}}
        else:
            b = {"model": self.model, "prompt": prompt_text(system, history),
                 "max_tokens": max_tokens, "stream": True,
                 "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            b["ignore_eos"] = True
        b.update(self.extra_body)
        return b


def prompt_text(system: str | None, history: list[dict[str, str]]) -> str:
    """The history as one text (the completions endpoint's prompt; what a tokenizer counts)."""
    parts = [system] if system is not None else []
    return "\n\n".join(parts + [m["content"] for m in history])


def auth_headers(kind: str, api_key: str | None) -> dict[str, str]:
    if kind == "messages":
        h = {"anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            h["x-api-key"] = api_key
        return h
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class _Stream:
    """The SSE events of one response, parsed into the record as they arrive."""

    def __init__(self, kind: str, rec: RequestRecord, t0: float) -> None:
        self.kind = kind
        self.rec = rec
        self.t0 = t0
        self.last: float | None = None
        self.text: list[str] = []
        self.done = False
        self.usage_in: int | None = None
        self.usage_out: int | None = None

    def text_event(self, now: float, piece: str) -> None:
        rec = self.rec
        if self.last is None:
            rec.ttft_ms = (now - self.t0) * 1000
        else:
            rec.itl_ms.append((now - self.last) * 1000)
        self.last = now
        rec.chunks += 1
        self.text.append(piece)

    def event(self, now: float, name: str, data: str) -> None:
        if data == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            raise _Failure("protocol", "an event's data is not JSON") from None
        if not isinstance(obj, dict):
            raise _Failure("protocol", "an event's data is not an object")
        if name == "error" or ("error" in obj and obj.get("type") in (None, "error")):
            err = obj.get("error")
            msg = err.get("message") if isinstance(err, dict) else err
            raise _Failure("stream_error", str(msg)[:200])
        if self.kind == "messages":
            self._anthropic(now, obj)
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage_in = usage.get("prompt_tokens", self.usage_in)
            self.usage_out = usage.get("completion_tokens", self.usage_out)
        for choice in obj.get("choices") or []:
            if self.kind == "chat":
                d = choice.get("delta") or {}
                piece = "".join(x for k in ("content", "reasoning_content", "reasoning")
                                if isinstance(x := d.get(k), str))
            else:
                piece = choice.get("text") or ""
            if piece:
                self.text_event(now, piece)

    def _anthropic(self, now: float, obj: dict[str, Any]) -> None:
        t = obj.get("type")
        if t == "message_start":
            usage = (obj.get("message") or {}).get("usage") or {}
            self.usage_in = usage.get("input_tokens", self.usage_in)
        elif t == "content_block_delta":
            d = obj.get("delta") or {}
            piece = d.get("text") or d.get("thinking") or ""
            if piece:
                self.text_event(now, piece)
        elif t == "message_delta":
            usage = obj.get("usage") or {}
            self.usage_out = usage.get("output_tokens", self.usage_out)
        elif t == "message_stop":
            self.done = True


class _Failure(Exception):
    def __init__(self, kind: str, detail: str, status: int | None = None) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.status = status


async def send(client: httpx.AsyncClient, ep: Endpoint, rec: RequestRecord, run_t0: float,
               system: str | None, history: list[dict[str, str]], max_tokens: int) -> str:
    """Send one request and fill ``rec`` (tokens from the server's usage, else its text
    events); returns the reply's text ("" on failure)."""
    body = ep.body(system, history, max_tokens)
    t0 = time.perf_counter()
    rec.start_s = t0 - run_t0
    st = _Stream(ep.kind, rec, t0)
    try:
        with trio.fail_after(ep.timeout_s):
            async with client.stream("POST", ep.url, json=body, headers=ep.headers) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    detail = (await resp.aread())[:300].decode("utf-8", "replace")
                    raise _Failure(f"http_{resp.status_code}", detail, resp.status_code)
                name = ""
                data: list[str] = []
                async for line in resp.aiter_lines():
                    if line == "":
                        if data:
                            st.event(time.perf_counter(), name, "\n".join(data))
                        name, data = "", []
                        if st.done:
                            break
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip(" "))
                    elif line.startswith("event:"):
                        name = line[6:].strip()
                if data and not st.done:
                    st.event(time.perf_counter(), name, "\n".join(data))
        if not st.done:
            raise _Failure("protocol", "the stream ended without its last event")
        if not st.text:
            raise _Failure("empty", "no text in the reply")
    except _Failure as f:
        rec.error, rec.error_detail = f.kind, f.detail
    except trio.TooSlowError:
        rec.error, rec.error_detail = "timeout", f"no complete reply in {ep.timeout_s:g} s"
    except (httpx.TransportError, OSError, trio.BrokenResourceError) as exc:
        tls = _ssl_error(exc)
        rec.error = "tls" if tls is not None else "connection"
        rec.error_detail = f"{type(tls or exc).__name__}: {tls or exc}"[:200]
    end = time.perf_counter()
    rec.end_s = end - run_t0
    if rec.error is not None:
        return ""
    rec.e2e_ms = (end - t0) * 1000
    text = "".join(st.text)
    if st.usage_out is not None:
        rec.input_tokens = st.usage_in
        rec.output_tokens = st.usage_out
        rec.tokens_source = "usage"
    else:
        rec.input_tokens = st.usage_in
        rec.output_tokens = rec.chunks
        rec.tokens_source = "chunks"
    return text


def count_tokens(rec: RequestRecord, tokenizer: Tokenizer, prompt: str, reply: str) -> None:
    """Count a successful request's tokens with the model's tokenizer. Done after the load
    point, never during it: tokenizing in the event loop would delay the other streams' reads
    and inflate their latencies."""
    rec.input_tokens = tokenizer.count(prompt)
    rec.output_tokens = tokenizer.count(reply)
    rec.tokens_source = "tokenizer"


def _ssl_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS failure behind a transport error, if one is in its chain of causes."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
