"""The response body's merger (``relay.GenerationBody._next_frames``) with events injected
straight into its channel, so same-tick arrivals are deterministic.

Regression: an error that arrived in the same drain as earlier deltas used to discard the
frames of those deltas (found by the fault matrix's ``eof_clean`` case under new timings): the
client lost the last tokens before the error event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from sieproxy.core.errors import EngineTruncated
from sieproxy.core.events import CandidateDelta, CandidateFinish
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


class _OneFinishThenCancelled:
    """An upstream body: the engine's last chunk and ``[DONE]`` in one read; during the next
    read (the body is read to its end for connection reuse) the merger cancels the candidate."""

    def __init__(self, body: GenerationBody, cause: str) -> None:
        self._body = body
        self._cause = cause
        self._reads = 0

    async def receive(self) -> bytes:
        self._reads += 1
        if self._reads == 1:
            last = json.dumps(
                {
                    "text": " done",
                    "output_ids": [7],
                    "meta_info": {
                        "id": "x-0",
                        "finish_reason": {"type": "length", "length": 1},
                        "prompt_tokens": 3,
                        "completion_tokens": 1,
                        "cached_tokens": 0,
                    },
                }
            )
            return f"data: {last}\n\ndata: [DONE]\n\n".encode()
        self._body._cancel(0, self._cause)
        await trio.lowlevel.checkpoint()  # raises Cancelled
        return b""


class _Client:
    def __init__(self, resp: _OneFinishThenCancelled) -> None:
        self.resp = resp
        self.aborts: list[str] = []

    @asynccontextmanager
    async def stream_generate(
        self, url: str, body: dict[str, Any], *, head_timeout: float
    ) -> AsyncIterator[_OneFinishThenCancelled]:
        yield self.resp

    async def abort(self, url: str, rid: str) -> None:
        self.aborts.append(rid)


@pytest.mark.parametrize("cause", ["best_of", "stop"])
async def test_a_cancel_after_the_engine_finished_sends_one_finish(cause: str) -> None:
    """Regression (CI, best_of through the openai SDK): a best_of loser or stop-matched
    candidate cancelled after its task had already queued the engine's finish used to queue a
    second, local finish; the choice then failed with "got finish while finished" (a 500)."""
    body, _ = body_with_channel()
    client = _Client(_OneFinishThenCancelled(body, cause))
    body._client = client  # type: ignore[assignment]
    body._scopes = [trio.CancelScope()]
    body._terminal = [False]
    body._causes = [None]
    send, recv = trio.open_memory_channel(8)  # type: ignore[var-annotated]
    await body._candidate(0, {"rid": "x-0"}, send)
    events = []
    async with recv:
        async for ev in recv:
            events.append(ev[1])
    finishes = [e for e in events if isinstance(e, CandidateFinish)]
    assert len(finishes) == 1
    assert finishes[0].reason == "length"  # the engine's, not a local abort
    assert client.aborts == []  # the engine had finished: nothing to abort
