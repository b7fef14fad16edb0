"""The response body's merger (``relay.GenerationBody._next_frames``) with events injected
straight into its channel, so same-tick arrivals are deterministic.

Regression: an error that arrived in the same drain as earlier deltas used to discard the
frames of those deltas (found by the fault matrix's ``eof_clean`` case under new timings): the
client lost the last tokens before the error event.
"""

from __future__ import annotations

import trio

from sieproxy.core.errors import EngineTruncated
from sieproxy.core.events import CandidateDelta
from sieproxy.core.merger import ChatStream
from sieproxy.pool import ModelPool, RouteHints
from sieproxy.relay import GenerationBody, RequestStats
from sieproxy.settings import EngineSpec, GatewaySettings
from tests.core.test_merger import CREATED, chat, decode


def body_with_channel() -> tuple[GenerationBody, trio.MemorySendChannel]:  # type: ignore[type-arg]
    g = GatewaySettings()
    pool = ModelPool("m", [EngineSpec(url="http://127.0.0.1:9")], g)
    shaper = ChatStream(chat(), response_id="chatcmpl-x", model="m", created=CREATED)
    body = GenerationBody(
        g=g,
        client=None,  # type: ignore[arg-type]  # never used: no candidate runs
        pool=pool,
        replica=pool.replicas[0],
        hints=RouteHints(),
        bodies=[{"rid": "x-0"}],
        shaper=shaper,
        streaming=True,
        stats=RequestStats(request_id="x", model="m", endpoint="chat", n=1, stream=True),
    )
    send, recv = trio.open_memory_channel(8)  # type: ignore[var-annotated]
    body._recv = recv
    return body, send


async def test_an_error_behind_deltas_does_not_drop_them() -> None:
    body, send = body_with_channel()
    shaper = body._shaper
    head = shaper.start()
    send.send_nowait((0, CandidateDelta(" w0", 1)))
    send.send_nowait((0, CandidateDelta(" w1", 2)))
    send.send_nowait((0, EngineTruncated()))
    frames = await body.__anext__()
    events = decode(head + frames)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == " w0 w1"  # both deltas, in one write
    tail = decode(await body.__anext__())  # then the error event and [DONE]
    assert tail[0]["error"]["code"] == "upstream_truncated"
    assert tail[-1] == "[DONE]"
    assert body.stats.error is not None


async def test_deltas_drained_together_are_one_write() -> None:
    body, send = body_with_channel()
    body._shaper.start()
    for i in range(5):
        send.send_nowait((0, CandidateDelta(f" t{i}", i + 1)))
    frames = await body.__anext__()
    assert len(decode(frames)) == 5
