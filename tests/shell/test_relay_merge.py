"""The response body's merger (``relay.GenerationBody._next_frames``) with events injected
straight into its channel (two candidates: the channel mode), or upstream reads scripted for
an inline candidate (``n`` = 1), so same-tick arrivals are deterministic.

Regression: an error that arrived in the same drain as earlier deltas used to discard the
frames of those deltas (found by the fault matrix's ``eof_clean`` case under new timings): the
client lost the last tokens before the error event.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from sieproxy.core.errors import EngineTimeout, EngineTruncated
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish
from sieproxy.core.shaping.merger import ChatStream
from sieproxy.fleet.pool import ModelPool, RouteHints
from sieproxy.relay.attempt import Attempt
from sieproxy.relay.body import GenerationBody, RequestStats, WaitTimer
from sieproxy.relay.candidate import Candidate
from sieproxy.settings.load import EngineSpec, GatewaySettings
from tests.core.test_merger import CREATED, chat, decode


def make_body(k: int, client: Any = None, *, incremental: bool = False) -> GenerationBody:
    """A body of ``k`` candidates on one replica; ``incremental``: the engine sends text
    deltas (what its reader expects)."""
    g = GatewaySettings()
    pool = ModelPool("m", [EngineSpec(url="http://127.0.0.1:9")], g)
    pool.replicas[0].incremental = incremental
    shaper = ChatStream(chat(), response_id="chatcmpl-x", model="m", created=CREATED)
    body = GenerationBody(
        g=g,
        client=client,
        pool=pool,
        replica=pool.replicas[0],
        hints=RouteHints(),
        bodies=[{"rid": f"x-{i}"} for i in range(k)],
        shaper=shaper,
        streaming=True,
        stats=RequestStats(request_id="x", model="m", endpoint="chat", n=1, stream=True),
    )
    assert (body._il is not None) == (k == 1)
    return body


def body_with_channel() -> tuple[GenerationBody, trio.MemorySendChannel]:  # type: ignore[type-arg]
    """Channel mode (two candidates; the events below all belong to candidate 0)."""
    body = make_body(2)
    send, recv = trio.open_memory_channel(8)  # type: ignore[var-annotated]
    body._fan.recv = recv
    return body, send


async def test_an_error_behind_deltas_does_not_drop_them() -> None:
    body, send = body_with_channel()
    shaper = body._m.shaper
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


async def test_a_stream_that_ends_with_a_choice_unfinished_ends_with_an_error_event() -> None:
    """Regression (found through llama.cpp's server): the channel closed while a choice had no
    finish, and the shaper's end raised outside the body's error handling: the response was
    cut without an error event. It now ends with ``internal_error`` and ``[DONE]``."""
    body, send = body_with_channel()
    body._m.reshape(ChatStream(chat(2), response_id="chatcmpl-x", model="m", created=CREATED))
    head = body._m.shaper.start()
    send.send_nowait((0, CandidateDelta(" w0", 1)))
    send.send_nowait((0, CandidateFinish("stop", None, 3, 1)))
    send.close()  # candidate 1 never finished
    frames = head + await body.__anext__()
    tail = decode(await body.__anext__())
    assert tail[0]["error"]["code"] == "internal_error" and tail[-1] == "[DONE]"
    assert body.done and decode(frames)


async def test_deltas_drained_together_are_one_write() -> None:
    body, send = body_with_channel()
    body._m.shaper.start()
    for i in range(5):
        send.send_nowait((0, CandidateDelta(f" t{i}", i + 1)))
    frames = await body.__anext__()
    assert len(decode(frames)) == 5


def _last_chunk() -> bytes:
    """The engine's last chunk (finish ``length``) and ``[DONE]``, as one read."""
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
            return _last_chunk()
        self._body._up.cands[0].end(self._cause)
        await trio.lowlevel.checkpoint()  # raises Cancelled
        return b""


def one_candidate(body: GenerationBody, client: Any) -> Attempt:
    """The body's attempt, reading through ``client``, with one candidate task to run."""
    up = body._up
    up.client = client
    c = Candidate(0, up.reader())
    c.scope = trio.CancelScope()
    up.reset([c])
    return up


class _Client:
    def __init__(self, resp: Any) -> None:
        self.resp = resp
        self.aborts: list[str] = []

    @asynccontextmanager
    async def stream(
        self, url: str, path: str, body: dict[str, Any], *, head_timeout: float
    ) -> AsyncIterator[Any]:
        yield self.resp

    async def post(self, url: str, path: str, body: dict[str, Any]) -> None:
        assert path == "/abort_request"
        self.aborts.append(body["rid"])


@pytest.mark.parametrize("cause", ["best_of", "stop"])
async def test_a_cancel_after_the_engine_finished_sends_one_finish(cause: str) -> None:
    """Regression (CI, best_of through the openai SDK): a best_of loser or stop-matched
    candidate cancelled after its task had already queued the engine's finish used to queue a
    second, local finish; the choice then failed with "got finish while finished" (a 500)."""
    body, _ = body_with_channel()
    client = _Client(_OneFinishThenCancelled(body, cause))
    up = one_candidate(body, client)
    send, recv = trio.open_memory_channel(8)  # type: ignore[var-annotated]
    await up.run(0, send)
    events = []
    async with recv:
        async for ev in recv:
            events.append(ev[1])
    finishes = [e for e in events if isinstance(e, CandidateFinish)]
    assert len(finishes) == 1
    assert finishes[0].reason == "length"  # the engine's, not a local abort
    assert client.aborts == []  # the engine had finished: nothing to abort


class _FinishThenSilence:
    """An upstream body: the engine's last chunk and ``[DONE]`` in one read, then nothing."""

    def __init__(self) -> None:
        self._reads = 0

    async def receive(self) -> bytes:
        self._reads += 1
        if self._reads == 1:
            return _last_chunk()
        await trio.sleep_forever()
        raise AssertionError("unreachable")


@pytest.mark.parametrize("cause", ["best_of", "stop"])
async def test_a_cancel_while_queueing_the_engines_finish_still_delivers_it(cause: str) -> None:
    """Regression (best_of = 128 answered 500): a candidate cancelled as a best_of loser (or
    for a stop string) while its task waited for room in the full channel to queue the
    engine's finish dropped that finish; the choice never finished."""
    body, _ = body_with_channel()
    client = _Client(_FinishThenSilence())
    up = one_candidate(body, client)
    send, recv = trio.open_memory_channel(0)  # type: ignore[var-annotated]
    events: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(up.run, 0, send)
        await trio.testing.wait_all_tasks_blocked()  # parked queueing the delta: nobody reads
        events.append((await recv.receive())[1])  # the delta; then parked on the finish
        await trio.testing.wait_all_tasks_blocked()
        up.cands[0].end(cause)  # the merger names it a loser, in that very step
        async with recv:
            async for ev in recv:
                events.append(ev[1])
    finishes = [e for e in events if isinstance(e, CandidateFinish)]
    assert len(finishes) == 1, events
    assert finishes[0].reason == "length"  # the engine's, not a local abort
    assert client.aborts == []  # the engine had finished: nothing to abort


# ---- n = 1: the response task reads its candidate itself ----------------------------------


def sse(text: str, tokens: int, finish: dict[str, Any] | None = None) -> bytes:
    meta = {
        "id": "x-0",
        "finish_reason": finish,
        "prompt_tokens": 3,
        "completion_tokens": tokens,
        "cached_tokens": 0,
    }
    payload = json.dumps({"text": text, "output_ids": [], "meta_info": meta}).encode()
    return b"data: " + payload + b"\n\n"


class _Scripted:
    """An upstream body: one scripted read per call, then the end of the body."""

    def __init__(self, reads: list[bytes]) -> None:
        self.reads = list(reads)
        self.closed = False
        self.ready = False  # each read needs a wait first (the inline reader's slow path)

    def receive_nowait(self) -> bytes | None:
        if not self.ready:
            return None
        self.ready = False
        return self.reads.pop(0) if self.reads else b""

    async def wait_readable(self) -> None:
        await trio.lowlevel.checkpoint()
        self.ready = True

    async def receive(self) -> bytes:
        await self.wait_readable()
        out = self.receive_nowait()
        assert out is not None
        return out

    def close(self) -> None:
        self.closed = True


def inline_body(reads: list[bytes], **shaper_kw: Any) -> tuple[GenerationBody, _Client]:
    client = _Client(_Scripted(reads))  # type: ignore[arg-type]
    body = make_body(1, client, incremental=True)  # the scripted texts are deltas
    if shaper_kw:
        body._m.reshape(
            ChatStream(chat(**shaper_kw), response_id="chatcmpl-x", model="m", created=CREATED)
        )
    return body, client


def contents(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


async def test_inline_payloads_of_one_read_are_one_write() -> None:
    body, client = inline_body([sse(" a", 1) + sse(" b", 2) + sse(" c", 3), sse(" d", 4)])
    async with body:
        head = await body.prime()
        assert contents(decode(head)) == " a b c"
        assert contents(decode(await body.__anext__())) == " d"
        tail = decode(await body.__anext__())  # the body ended without a finish
    assert tail[0]["error"]["code"] == "upstream_truncated" and tail[-1] == "[DONE]"
    assert client.aborts == ["x-0"]  # the engine never said it finished
    assert body.stats.abort_causes == {"error": 1}


class _AlwaysReady(_Scripted):
    """An engine so fast its bytes are always there: the inline reader never waits."""

    def __init__(self, body: GenerationBody) -> None:
        super().__init__([])
        self.body = body
        self.n = 0

    def receive_nowait(self) -> bytes | None:
        self.n += 1
        if self.n == 3:  # the request deadline passes while tokens keep coming
            assert self.body._il is not None
            self.body._il.deadline = trio.current_time() - 1
        assert self.n < 50, "the deadline was never checked"
        return sse(f" t{self.n}", self.n)


async def test_inline_reads_that_never_wait_still_end_at_the_deadline() -> None:
    """Bytes already there are read without a cancel scope; the request deadline is checked
    on that path too (it would otherwise never fire on a stream that never waits)."""
    body, client = inline_body([])
    client.resp = _AlwaysReady(body)
    async with body:
        out = await body.prime()
        with trio.fail_after(5):
            async for frames in body:
                out += frames
    events = decode(out)
    assert contents(events) == " t1 t2"
    assert events[-2]["error"]["code"] == "upstream_timeout" and events[-1] == "[DONE]"
    assert client.aborts == ["x-0"] and body.stats.abort_causes == {"deadline": 1}


async def test_inline_error_behind_deltas_in_one_read() -> None:
    bad = b'data: {"error": {"message": "secret", "code": 500}}\n\n'
    body, client = inline_body([sse(" w0", 1) + sse(" w1", 2) + bad])
    async with body:
        head = await body.prime()
        assert contents(decode(head)) == " w0 w1"  # both deltas, in one write
        tail = decode(await body.__anext__())  # then the error event and [DONE]
    assert tail[0]["error"]["code"] == "upstream_error" and "secret" not in str(tail)
    assert tail[-1] == "[DONE]"
    assert client.aborts == ["x-0"]


async def test_inline_finish_then_done_reuses_nothing_and_aborts_nothing() -> None:
    fin = {"type": "length", "length": 2}
    body, client = inline_body([sse(" a", 1), sse(" b", 2, fin) + b"data: [DONE]\n\n"])
    async with body:
        out = await body.prime()
        async for frames in body:
            out += frames
    events = decode(out)
    assert contents(events) == " a b" and events[-1] == "[DONE]"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "length"
    assert client.aborts == [] and body.stats.abort_causes == {}


async def test_inline_stop_string_ends_the_candidate_in_the_same_write() -> None:
    body, client = inline_body([sse(" one", 1) + sse(" two STOP three", 2)], stop=["STOP"])
    async with body:
        head = await body.prime()
        events = decode(head)
        assert contents(events) == " one two "
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        rest = b"".join([frames async for frames in body])
    assert decode(rest)[-1] == "[DONE]"
    assert client.aborts == ["x-0"] and body.stats.abort_causes == {"stop": 1}


async def test_inline_stalled_client_aborts_then_gets_an_error_event() -> None:
    body, client = inline_body([sse(" a", 1), sse(" b", 2)])
    async with body:
        await body.prime()
        body.writing_since = trio.current_time() - body._g.client_stall_timeout - 1
        assert body.check_stall(trio.current_time())  # the sweeper must abort this one
        assert not body.check_stall(trio.current_time())  # once
        await body.abort_stalled()
        assert client.resp.closed and client.aborts == ["x-0"]
        body.writing_since = None  # the parked write returned after all
        tail = decode(await body.__anext__())
    assert tail[0]["error"]["code"] == "client_stalled" and tail[-1] == "[DONE]"
    assert client.aborts == ["x-0"] and body.stats.abort_causes == {"stall": 1}


class _HeadNeverComes(_Client):
    """An engine that takes the request and never sends its response head: the client raises
    ``trio.TooSlowError`` once ``head_timeout`` has passed, as ``EngineClient`` does."""

    def __init__(self) -> None:
        super().__init__(None)
        self.head_timeouts: list[float] = []

    @asynccontextmanager
    async def stream(
        self, url: str, path: str, body: dict[str, Any], *, head_timeout: float
    ) -> AsyncIterator[Any]:
        self.head_timeouts.append(head_timeout)
        await trio.sleep(head_timeout)
        raise trio.TooSlowError
        yield  # an async generator  # pragma: no cover


@pytest.mark.parametrize(
    "deadline,gap,cause",
    [(5.0, 60.0, "deadline"), (60.0, 5.0, "timeout")],
    ids=["the-deadline-first", "the-gap-first"],
)
async def test_an_inline_head_that_never_comes_ends_at_the_deadline_or_the_gap(
    autojump_clock: Any, deadline: float, gap: float, cause: str
) -> None:
    """The response head's wait is bounded by the token gap and by the request's deadline,
    whichever comes first, through the upstream client's own timeout (no cancel scope of the
    relay's around it); the error names which one it was, and the rid is aborted."""
    client = _HeadNeverComes()
    body = make_body(1, client)
    body._g.request_deadline = deadline
    body._g.token_gap_timeout = gap
    start = trio.current_time()
    async with body:
        with pytest.raises(EngineTimeout) as err:  # before any output: the response's status
            await body.prime()
    want = "exceeded its deadline" if cause == "deadline" else "no token within"
    assert want in str(err.value)
    assert client.head_timeouts == [pytest.approx(min(deadline, gap))]
    assert trio.current_time() - start == pytest.approx(min(deadline, gap))
    assert client.aborts == ["x-0"] and body.stats.abort_causes == {cause: 1}


async def _blocked_write(seconds: float) -> None:
    """A client write that the socket does not take for ``seconds``."""
    await trio.sleep(seconds)


class _Timed:
    """An upstream body whose reads become readable at scripted times; closing it (the wait
    timer firing) wakes a waiting reader, whose next read then fails, as a socket's would."""

    def __init__(self, reads: list[tuple[float, bytes]]) -> None:
        self.reads = list(reads)
        self.closed = trio.Event()

    def receive_nowait(self) -> bytes | None:
        if self.closed.is_set():
            raise EngineTruncated()
        if not self.reads:
            return b""
        at, data = self.reads[0]
        if trio.current_time() < at:
            return None
        self.reads.pop(0)
        return data

    async def wait_readable(self) -> None:
        with trio.move_on_at(self.reads[0][0] if self.reads else -math.inf):
            await self.closed.wait()

    def close(self) -> None:
        self.closed.set()


@pytest.mark.parametrize("with_timer", [False, True], ids=["cancel-scope", "wait-timer"])
async def test_inline_gap_does_not_count_a_blocked_client_write(
    autojump_clock: Any, with_timer: bool
) -> None:
    """Regression: the inline reader's token gap counted the time the response spent blocked
    writing to a slow client, so an engine silent for less than the gap after a long write was
    timed out at once. The write's time now pauses the gap clock: with a gap of 10 s, a write
    blocked for 15 s and a token 3 s after it, the stream goes on; the gap still fires after
    10 s of the engine's real silence."""
    gap = 10.0
    t0 = trio.current_time()
    resp = _Timed([(t0, sse(" a", 1)), (t0 + 18, sse(" b", 2)), (t0 + 40, sse(" c", 3))])
    body = make_body(1, _Client(resp), incremental=True)
    body._g.token_gap_timeout = gap
    async with trio.open_nursery() as nursery:
        if with_timer:
            timer = WaitTimer()
            nursery.start_soon(timer.run)
            await trio.testing.wait_all_tasks_blocked()
            assert body._il is not None
            body._il.timer = timer
        async with body:
            assert contents(decode(await body.prime())) == " a"
            await body.client_write(_blocked_write(15))  # the client does not read meanwhile
            assert contents(decode(await body.__anext__())) == " b"  # at 18 s: 3 s of silence
            assert trio.current_time() - t0 == pytest.approx(18)
            tail = decode(await body.__anext__())  # then 22 s of silence: the gap fires
        assert tail[0]["error"]["code"] == "upstream_timeout"
        assert trio.current_time() - t0 == pytest.approx(18 + gap, abs=0.5)
        nursery.cancel_scope.cancel()
