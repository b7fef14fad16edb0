"""The relay pump (``sieproxy.pump``): one task carries the tokens of every waiting ``n`` = 1
stream, and hands a stream back to its own task for everything else.

The pump alone, on socket pairs: a parked stream is carried until its rider hands it back; a
cancelled task leaves the pump at once and is never touched again; ``unpark`` and a stopping
pump hand streams back; a failing rider is handed back while the others are still carried; the
pump yields between batches. Through the gateway: the tokens of a stream that waits for the
engine are written by the pump, byte for byte what the response task writes; every fault,
timeout, stop string and departure that happens while a stream is carried ends it exactly as
it ends a stream read by its task; a client that reads slower than the tokens come gets every
byte; a bug in the shaper while carried still ends the stream with an error event and
``[DONE]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import h11
import pytest
import trio
import trio.testing

from engine.fake import FakeEngine, Fault, Plan
from sieproxy.core.upstream.sglang import Express
from sieproxy.front import hypercorn_io
from sieproxy.relay.merge import Merger
from sieproxy.relay.pump import Pump

from .harness import MODEL, Gateway, host_port, running_gateway, sse_events
from .test_faults import (
    CHAT,
    MID_STREAM,
    aborted_once,
    at_most_one_abort,
    chat_body,
    check_sse_error_tail,
    faulty,
    generate_rids,
    no_resumes,
    post,
    settled,
    still_serves,
)
from .test_openai_sdk import NoStopEngine

# ---- the pump alone ----------------------------------------------------------------------------


class _Rider:
    """Reads one byte per ride from its socket; hands back at the byte ``b"!"``, raises at
    ``b"?"``."""

    def __init__(self, sock: socket.socket, log: list[str] | None = None, name: str = "") -> None:
        self.sock = sock
        self.got = b""
        self.log = log
        self.name = name

    def ride(self) -> bool:
        data = os.read(self.sock.fileno(), 1)
        self.got += data
        if self.log is not None:
            self.log.append(self.name)
        if data == b"?":
            raise RuntimeError("rider bug")
        return data != b"!"


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for a, b in made:
        a.close()
        b.close()


def _pair(made: list[tuple[socket.socket, socket.socket]]) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    made.append((a, b))
    return a, b


async def _started(nursery: trio.Nursery, pump: Pump) -> None:
    nursery.start_soon(pump.run)
    await trio.testing.wait_all_tasks_blocked()
    assert pump.running


@contextlib.asynccontextmanager
async def _running(pump: Pump) -> AsyncIterator[trio.Nursery]:
    """A nursery with ``pump`` running in it; everything in it is cancelled at the end."""
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await _started(nursery, pump)
            yield nursery
            nursery.cancel_scope.cancel()


async def _park_then_set(pump: Pump, sock: socket.socket, rider: _Rider, back: trio.Event) -> None:
    await pump.park(sock.fileno(), rider)
    back.set()


async def test_a_parked_stream_is_carried_until_its_rider_hands_it_back(
    pairs: list[Any],
) -> None:
    pump = Pump()
    mine, engine = _pair(pairs)
    rider = _Rider(mine)
    resumed = trio.Event()
    async with _running(pump) as nursery:
        nursery.start_soon(_park_then_set, pump, mine, rider, resumed)
        await trio.testing.wait_all_tasks_blocked()
        assert len(pump) == 1
        for byte in b"abc":
            engine.send(bytes([byte]))
            while rider.got[-1:] != bytes([byte]):
                await trio.sleep(0.001)
        await trio.testing.wait_all_tasks_blocked()
        assert not resumed.is_set(), "the pump carried the bytes; the task stayed parked"
        engine.send(b"!")
        await resumed.wait()
        assert rider.got == b"abc!"
        assert len(pump) == 0
    assert not pump.running


async def test_a_cancelled_task_leaves_the_pump_and_is_never_ridden_again(
    pairs: list[Any],
) -> None:
    pump = Pump()
    mine, engine = _pair(pairs)
    rider = _Rider(mine)
    async with _running(pump) as nursery:
        scope = trio.CancelScope()

        async def stream() -> None:
            with scope:
                await pump.park(mine.fileno(), rider)
                raise AssertionError("not handed back")

        nursery.start_soon(stream)
        await trio.testing.wait_all_tasks_blocked()
        assert len(pump) == 1
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert len(pump) == 0
        engine.send(b"x")
        await trio.sleep(0.05)
        assert rider.got == b"", "a stream whose task moved on was ridden"


async def test_unpark_and_a_stopping_pump_hand_streams_back(pairs: list[Any]) -> None:
    pump = Pump()
    (a, _), (b, _) = _pair(pairs), _pair(pairs)
    back: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as nursery:
                await _started(nursery, pump)

                async def stream(sock: socket.socket, name: str) -> None:
                    await pump.park(sock.fileno(), _Rider(sock))
                    back.append(name)

                outer.start_soon(stream, a, "a")
                outer.start_soon(stream, b, "b")
                await trio.testing.wait_all_tasks_blocked()
                assert len(pump) == 2
                pump.unpark(a.fileno())
                pump.unpark(a.fileno())  # a second hand-back of the same stream does nothing
                await trio.testing.wait_all_tasks_blocked()
                assert back == ["a"]
                nursery.cancel_scope.cancel()  # the pump stops: b is handed back
            await trio.testing.wait_all_tasks_blocked()
            assert back == ["a", "b"]
    assert not pump.running and len(pump) == 0


async def test_a_failing_rider_is_handed_back_and_the_others_are_still_carried(
    pairs: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    pump = Pump()
    (bad, bad_engine), (good, good_engine) = _pair(pairs), _pair(pairs)
    good_rider = _Rider(good)
    resumed = trio.Event()
    async with _running(pump) as nursery:
        nursery.start_soon(_park_then_set, pump, bad, _Rider(bad), resumed)
        nursery.start_soon(pump.park, good.fileno(), good_rider)
        await trio.testing.wait_all_tasks_blocked()
        bad_engine.send(b"?")
        await resumed.wait()
        good_engine.send(b"ok")
        while good_rider.got != b"ok":
            await trio.sleep(0.001)
        assert len(pump) == 1
    assert "a stream failed" in caplog.text


async def test_the_pump_yields_to_other_tasks_between_batches(pairs: list[Any]) -> None:
    """At most ``batch`` rides run in one step of the pump's task; another task runs between."""
    pump = Pump(batch=2)
    log: list[str] = []
    socks = [_pair(pairs) for _ in range(8)]
    async with _running(pump) as nursery:
        for k, (mine, _) in enumerate(socks):
            nursery.start_soon(pump.park, mine.fileno(), _Rider(mine, log, f"r{k}"))
        await trio.testing.wait_all_tasks_blocked()

        async def other() -> None:
            while True:
                log.append("other")
                await trio.lowlevel.checkpoint()

        for _, engine in socks:
            engine.send(b"x")
        nursery.start_soon(other)
        while sum(1 for e in log if e != "other") < 8:
            await trio.sleep(0.001)
    rides = [e for e in log if e != "other"]
    assert sorted(rides) == [f"r{k}" for k in range(8)]
    run = longest = 0
    for e in log:
        run = 0 if e == "other" else run + 1
        longest = max(longest, run)
    # Trio may run the pump last in one scheduling round and first in the next: two batches.
    assert longest <= 4, log


# ---- through the gateway -----------------------------------------------------------------------

TOKENS = [f" t{k}" for k in range(30)]


@dataclasses.dataclass
class _Counts:
    parks: int = 0
    carried: int = 0  # chunks the pump wrote to a client
    handed: int = 0  # a write the pump left for the response task
    express: int = 0  # reads the express lane took (core.upstream.sglang)


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> _Counts:
    c = _Counts()
    park, write_nowait, express = Pump.park, hypercorn_io.ChunkWriter.write_nowait, Express.relay

    async def counting_park(self: Pump, fd: int, rider: Any) -> None:
        c.parks += 1
        await park(self, fd, rider)

    def counting_write(self: hypercorn_io.ChunkWriter, data: bytes) -> bool:
        ok = write_nowait(self, data)
        if ok:
            c.carried += 1
        else:
            c.handed += 1
        return ok

    def counting_express(self: Express, data: bytes) -> bytes | None:
        frame = express(self, data)
        c.express += frame is not None
        return frame

    monkeypatch.setattr(Pump, "park", counting_park)
    monkeypatch.setattr(Express, "relay", counting_express)
    monkeypatch.setattr(hypercorn_io.ChunkWriter, "write_nowait", counting_write)
    return c


def _content(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


async def _idle_pump(gw: Gateway) -> None:
    """Nothing is left parked once every response ended."""
    with trio.fail_after(5):
        while len(gw.state.pump):
            await trio.sleep(0.01)


async def test_the_tokens_of_a_waiting_stream_are_written_by_the_pump(counts: _Counts) -> None:
    engine = FakeEngine(script=faulty(Plan(TOKENS, itl=0.01)))
    async with running_gateway(engine) as gw:
        assert gw.state.pump.running
        r = await post(gw, "fault-carried", stream=True)
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and _content(events) == "".join(TOKENS)
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        # The task parked a few times (first token, end of body); the pump wrote the rest.
        assert counts.carried >= 20, counts
        assert counts.parks <= 5, counts
        assert counts.handed == 0
        assert counts.express >= 20, counts  # the pump's tokens took the express lane
        by_task = sse_events((await _without_pump(gw)).text)
        assert _anonymous(by_task) == _anonymous(events), "the pump wrote what the task writes"
        await _idle_pump(gw)


async def _without_pump(gw: Gateway) -> Any:
    """The same request, read by the response task alone (no relay pump)."""
    pump = gw.state.pump
    running, pump.running = pump.running, False
    try:
        return await post(gw, "fault-task", stream=True)
    finally:
        pump.running = running


def _anonymous(events: list[Any]) -> list[Any]:
    """The events without what differs between two requests (their id and creation time)."""
    return [{**e, "id": None, "created": None} if isinstance(e, dict) else e for e in events]


@pytest.mark.parametrize(
    ("plan", "code"),
    # (SGLang's cumulative stream skips the malformed chunk: the [DONE] after it then comes
    # before the candidate's finish)
    [
        (dataclasses.replace(c[1], itl=0.03), "upstream_truncated" if c[0] == "malformed" else c[2])
        for c in MID_STREAM
    ],
    ids=[c[0] for c in MID_STREAM],
)
async def test_a_fault_while_carried_ends_the_stream_as_the_task_would(
    plan: Plan, code: str, counts: _Counts
) -> None:
    engine = FakeEngine(script=faulty(plan))
    async with running_gateway(engine, settings_hook=no_resumes) as gw:  # (resumes: test_resume)
        r = await post(gw, "fault-carried", stream=True)
        err, events = check_sse_error_tail(r.text)
        assert err["code"] == code, err
        assert _content(events).startswith(" w0 w1"), events
        assert counts.carried >= 1, "a token was written by the pump before the fault"
        assert generate_rids(engine) == ["fault-carried-0"]
        await settled(engine)
        at_most_one_abort(engine)
        await _idle_pump(gw)
        await still_serves(gw)


async def test_a_hang_while_parked_times_out_and_aborts(counts: _Counts) -> None:
    """The wait timer takes a parked stream out of the pump before it closes its connection."""
    engine = FakeEngine(script=faulty(Plan(TOKENS, itl=0.02, fault=Fault.hang(5))))
    async with running_gateway(engine, token_gap_timeout=0.5, settings_hook=no_resumes) as gw:
        t0 = trio.current_time()
        r = await post(gw, "fault-hang", stream=True)
        assert trio.current_time() - t0 < 5
        err, events = check_sse_error_tail(r.text)
        assert err["code"] == "upstream_timeout", err
        assert _content(events) == "".join(TOKENS[:5])
        assert counts.carried >= 3
        await aborted_once(engine, ["fault-hang-0"])
        await settled(engine)
        await _idle_pump(gw)
        await still_serves(gw)


async def test_the_deadline_passing_while_carried_ends_the_stream(counts: _Counts) -> None:
    engine = FakeEngine(script=faulty(Plan(TOKENS * 10, itl=0.02)))
    async with running_gateway(engine, request_deadline=0.5) as gw:
        r = await post(gw, "fault-deadline", stream=True, max_tokens=300)
        err, events = check_sse_error_tail(r.text)
        assert err["code"] == "upstream_timeout", err
        assert "deadline" in err["message"]
        assert 5 <= len(_content(events).split()) < 300
        assert counts.carried >= 5
        await aborted_once(engine, ["fault-deadline-0"])
        await _idle_pump(gw)


async def test_a_stop_string_matched_while_carried_ends_the_choice(counts: _Counts) -> None:
    """The gateway's own stop-string match (an engine that ignores ``stop``) ends the choice
    and aborts the generation."""
    engine = NoStopEngine(script=faulty(Plan(TOKENS, itl=0.02)))
    async with running_gateway(engine) as gw:
        r = await post(gw, "fault-stop", stream=True, stop=["t7"])
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert _content(events) == "".join(TOKENS[:7]) + " "
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert counts.carried >= 3
        await aborted_once(engine, ["fault-stop-0"])
        await _idle_pump(gw)


async def test_a_client_leaving_while_parked_aborts_the_generation(counts: _Counts) -> None:
    engine = FakeEngine(script=faulty(Plan([f" t{k}" for k in range(400)], itl=0.02)))
    async with running_gateway(engine) as gw:
        with trio.fail_after(20):
            async with gw.client.stream(
                "POST",
                CHAT,
                json=chat_body(stream=True, max_tokens=400),
                headers={"X-Request-Id": "fault-gone"},
            ) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 8:
                        break
        assert counts.carried >= 3
        await aborted_once(engine, ["fault-gone-0"])
        await settled(engine)
        assert "fault-gone-0" not in engine.finished
        await _idle_pump(gw)
        await still_serves(gw)


async def test_a_client_slower_than_the_tokens_gets_every_byte(counts: _Counts) -> None:
    """Writes the socket cannot take at once are handed back: the response task sends the rest
    of the frame and relays on; nothing is lost, doubled or cut inside a frame."""
    big = [f" {k:04d}" + "x" * 4000 for k in range(120)]
    engine = FakeEngine(script=faulty(Plan(big, itl=0.002)))
    async with running_gateway(engine) as gw:
        host, port = host_port(gw)
        with trio.socket.socket() as sock:  # closed even if the test fails (no stuck write)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect((host, port))
            body = (
                b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"stream":true,'
                b'"max_tokens":200}' % MODEL.encode()
            )
            conn = h11.Connection(h11.CLIENT)
            await sock.send(
                conn.send(
                    h11.Request(
                        method="POST",
                        target=CHAT,
                        headers=[
                            ("Host", f"{host}:{port}"),
                            ("Content-Type", "application/json"),
                            ("Content-Length", str(len(body))),
                            ("X-Request-Id", "fault-slow"),
                        ],
                    )
                )
                + conn.send(h11.Data(data=body))
                + conn.send(h11.EndOfMessage())
            )
            text = b""
            with trio.fail_after(30):
                while True:
                    ev = conn.next_event()
                    if ev is h11.NEED_DATA:
                        await trio.sleep(0.003)  # a slow reader
                        conn.receive_data(await sock.recv(2048))
                    elif isinstance(ev, h11.Data):
                        text += ev.data
                    elif isinstance(ev, h11.EndOfMessage):
                        break
                    else:
                        assert isinstance(ev, h11.Response) and ev.status_code == 200
        events = sse_events(text.decode())
        assert events[-1] == "[DONE]"
        assert _content(events) == "".join(big)
        assert counts.handed >= 1, counts  # the slow client did make the pump hand back
        assert counts.carried >= 1, counts
        await _idle_pump(gw)


async def test_a_shaper_bug_while_carried_ends_with_an_error_event(
    counts: _Counts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the step that shapes a token (the general merge or the express lane, whichever
    takes it) ends the stream with an error event, after what went before it."""
    merge, express = Merger.merge, Express.relay
    calls = 0

    def step() -> None:
        nonlocal calls
        calls += 1
        if calls == 6:
            raise RuntimeError("shaper bug")

    def failing_merge(self: Merger, events: Any) -> bytes:
        step()
        return merge(self, events)

    def failing_express(self: Express, data: bytes) -> bytes | None:
        step()
        return express(self, data)

    monkeypatch.setattr(Merger, "merge", failing_merge)
    monkeypatch.setattr(Express, "relay", failing_express)
    engine = FakeEngine(script=faulty(Plan(TOKENS, itl=0.03)))
    async with running_gateway(engine) as gw:
        r = await post(gw, "fault-bug", stream=True)
        err, events = check_sse_error_tail(r.text)
        assert err["code"] == "internal_error", err
        assert _content(events) == "".join(TOKENS[:5]), "what went before the bug was relayed"
        assert counts.carried >= 2
        await aborted_once(engine, ["fault-bug-0"])
        await _idle_pump(gw)
