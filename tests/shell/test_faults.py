"""The fault matrix: every engine fault and every client misbehaviour, end to end, through
each upstream protocol and rendering (``protocol``: ``sglang``, the native ``/generate``;
``openai``, an OpenAI-compatible engine's ``/v1/completions`` with the prompt the gateway
rendered, ``core.upstream.openai``; ``openai-chat``, its ``/v1/chat/completions`` with the
messages, the engine rendering, ``core.openai_chat``).

Each case asserts what the client got (a proper status before any chunk, or a 200 whose SSE
ends with ``data: {"error": ...}`` then ``data: [DONE]`` after the first chunk), what the engine
saw (the rids it was asked for, that nothing is still running, and at most / exactly one
abort per rid), and that the gateway then still serves a normal request. The client sees the
same in both protocols; the abort differs: SGLang's is one ``/abort_request`` per rid, the
OpenAI protocol's is the candidate's upstream connection closed (the fake engine records it as
``cancelled``) and never an ``/abort_request`` (:func:`ended`).

Rids are ``<X-Request-Id>-<index>``: a test picks the request id, so the fake engine's script
can fault exactly the candidates it means to. An OpenAI request carries no rid: through that
protocol a test's request names itself in its message and asks for ``seed`` 0, so that
candidate ``i`` reaches the engine with seed ``i`` (the gateway sends ``seed + index``), and the
fake engine names it ``<name>-<i>`` (:func:`openai_name`, ``FakeEngine.name_request``).
A fault one protocol cannot express is skipped for it with the reason (``ONLY_SGLANG``).
"""

from __future__ import annotations

import json
import re
import socket
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from engine.fake import Call, DefaultScript, FakeEngine, Fault, FaultKind, Plan, abort_finish
from sieproxy.settings.load import EngineSpec, Settings

from .harness import (
    MODEL,
    PROTOCOL_MODES,
    Gateway,
    host_port,
    no_resumes,
    running_gateway,
    sse_events,
)

CHAT = "/v1/chat/completions"
SECRET = "SECRET-ENGINE-TEXT"
TOKENS = [f" w{k}" for k in range(6)]

# ---- helpers -------------------------------------------------------------------------------


PROTOCOLS = ("sglang", "openai", "openai-chat")


@pytest.fixture(params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    """The upstream protocol of the test's engines."""
    name: str = request.param
    return name


#: Faults only SGLang's protocol can express, and why the OpenAI combination is skipped.
ONLY_SGLANG = {
    "abort_503": "no abort finish with a status code in the OpenAI protocol",
    "abort_400": "no abort finish with a status code in the OpenAI protocol",
}


def by_protocol(cases: list[tuple[Any, ...]]) -> list[Any]:
    """``cases`` (id first) times :data:`PROTOCOLS`, with ``protocol`` as the first value; a
    combination that cannot exist (:data:`ONLY_SGLANG`) is skipped with its reason."""
    out = []
    for case in cases:
        for protocol in PROTOCOLS:
            why = ONLY_SGLANG.get(case[0]) if protocol != "sglang" else None
            marks = [pytest.mark.skip(reason=f"{protocol}: {why}")] if why else []
            values = case[1:]
            if case[0] == "malformed" and protocol == "sglang":
                # SGLang's cumulative stream skips a chunk that does not decode: the [DONE]
                # right after it then ends a stream without its finish.
                swap = {"malformed_upstream": "upstream_truncated", 500: 502}
                values = tuple(swap.get(v, v) if isinstance(v, str | int) else v for v in values)
            out.append(pytest.param(protocol, *values, id=f"{case[0]}-{protocol}", marks=marks))
    return out


_NAMED = re.compile(r"\[rid:([^\]]+)\]")


def openai_name(body: dict[str, Any]) -> str:
    """The rid of an OpenAI-protocol candidate: ``<name>-<seed>`` from its prompt's
    ``[rid:<name>]`` (:func:`chat_body`) and its seed; an unnamed one gets a fresh
    ``<hex>-0``, as the gateway names a request without ``X-Request-Id``."""
    m = _NAMED.search(str(body.get("prompt") or body.get("messages")))
    seed = body.get("seed")
    if m is not None and isinstance(seed, int):
        return f"{m[1]}-{seed}"
    return f"{uuid.uuid4().hex}-0"


def fake(protocol: str, script: Any = None, **kw: Any) -> FakeEngine:
    """A fake engine whose OpenAI-mode records and scripts name candidates as ``/generate``
    rids are named (module docstring)."""
    engine = FakeEngine(script=script, **kw)
    if protocol != "sglang":
        engine.name_request = openai_name
    return engine


def chat_body(protocol: str = "sglang", rid: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
    }
    if protocol != "sglang" and rid is not None:  # the request's name, for the engine
        body["messages"] = [{"role": "user", "content": f"hi [rid:{rid}]"}]
        body["seed"] = 0
    body.update(extra)
    return body


def faulty(plan: Plan | Callable[[Call], Plan | None], prefix: str = "fault") -> Any:
    """A script that plays ``plan`` for rids starting with ``prefix``, the default otherwise."""
    default = DefaultScript()

    def script(call: Call) -> Plan:
        if call.rid.startswith(prefix):
            p = plan(call) if callable(plan) else plan
            if p is not None:
                return p
        return default(call)

    return script


def check_envelope(obj: Any) -> dict[str, Any]:
    assert isinstance(obj, dict) and list(obj) == ["error"], obj
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert SECRET not in err["message"]
    return err


def check_status_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert SECRET not in r.text
    err = check_envelope(r.json())
    if status == 503:
        assert int(r.headers["retry-after"]) >= 1
    return err


def check_sse_error_tail(text: str) -> tuple[dict[str, Any], list[Any]]:
    """The stream ends with exactly one error event then one ``[DONE]``."""
    assert SECRET not in text
    events = sse_events(text)
    assert events[-1] == "[DONE]", events[-3:]
    assert events.count("[DONE]") == 1
    errors = [e for e in events[:-1] if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, events
    assert events[-2] is errors[0], "the error event is the last event before [DONE]"
    return check_envelope(events[-2]), events


def generate_rids(engine: FakeEngine, protocol: str = "sglang") -> list[str]:
    if protocol != "sglang":
        path = "/v1/completions" if protocol == "openai" else "/v1/chat/completions"
        return [openai_name(b) for p, b in engine.requests if p == path]
    return [b["rid"] for p, b in engine.requests if p == "/generate" and isinstance(b, dict)]


def ended(engine: FakeEngine, protocol: str = "sglang") -> list[str]:
    """The rids the gateway ended upstream, once per abort: SGLang's ``/abort_request``s; the
    OpenAI protocol's closed connections (recorded as ``cancelled``), never an abort request."""
    if protocol != "sglang":
        assert engine.aborts == [], "an /abort_request through the OpenAI protocol"
        return engine.cancelled
    return engine.aborts


async def settled(engine: FakeEngine, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        await engine.wait_for(lambda: not engine.running)


async def aborted_once(
    engine: FakeEngine, rids: list[str], timeout: float = 10.0, protocol: str = "sglang"
) -> None:
    """Wait until every rid in ``rids`` got its abort; then each got exactly one."""
    with trio.fail_after(timeout):
        await engine.wait_for(lambda: all(r in ended(engine, protocol) for r in rids))
    await trio.sleep(0.1)  # a duplicate would have arrived by now
    counts = Counter(ended(engine, protocol))
    assert {r: counts[r] for r in rids} == dict.fromkeys(rids, 1), counts


def at_most_one_abort(engine: FakeEngine, protocol: str = "sglang") -> None:
    counts = Counter(ended(engine, protocol))
    assert all(v == 1 for v in counts.values()), counts


async def still_serves(gw: Gateway) -> None:
    with trio.fail_after(20):
        # A replica whose breaker opened (retries count as failed requests too) is back at its
        # next passing health check.
        while (await gw.client.get("/readyz")).status_code != 200:
            await trio.sleep(0.02)
        r = await gw.client.post(CHAT, json=chat_body(max_tokens=3))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = await gw.client.post(CHAT, json=chat_body(max_tokens=3, n=2, stream=True))
        assert r.status_code == 200, r.text
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert not any("error" in e for e in events[:-1])


def protocol_of(gw: Gateway) -> str:
    """The protocol of the gateway's engines (``running_gateway(protocol=...)``)."""
    model = gw.state.settings.models[MODEL]
    (name,) = {"sglang" if isinstance(e, str) else e.protocol for e in model.engines}
    return "openai-chat" if model.render_mode() == "engine" else name


async def post(gw: Gateway, rid: str, **extra: Any) -> httpx.Response:
    body = chat_body(protocol_of(gw), rid, **extra)
    with trio.fail_after(20):
        return await gw.client.post(CHAT, json=body, headers={"X-Request-Id": rid})


async def timed_post(gw: Gateway, rid: str, **extra: Any) -> tuple[httpx.Response, float]:
    """``post``, and how long the answer took (within 8 s)."""
    body = chat_body(protocol_of(gw), rid, **extra)
    t0 = trio.current_time()
    with trio.fail_after(8):
        r = await gw.client.post(CHAT, json=body, headers={"X-Request-Id": rid})
    return r, trio.current_time() - t0


async def small_window_client(gw: Gateway) -> trio.SocketStream:
    """A raw connection to the gateway with a 4 KiB receive buffer (it fills at once when the
    client stops reading)."""
    host, port = host_port(gw)
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, port))
    return trio.SocketStream(sock)


def big_tokens(count: int, itl: float = 0.0) -> Callable[[Call], Plan]:
    """``count`` tokens of 2 kB each, ``itl`` apart."""
    big = "x" * 2000
    return lambda c: Plan([big + str(k) for k in range(count)], itl=itl)


def raw_request(body: dict[str, Any], rid: str) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"X-Request-Id: {rid}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )


# ---- engine refuses connections ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_refusing_connections_is_503_then_recovers(
    stream: bool, protocol: str
) -> None:
    engine = fake(protocol)
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def run_engine(port: int = 0, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await engine.serve(port=port, task_status=task_status)

        port = await nursery.start(run_engine)

        def hook(settings: Settings) -> None:
            settings.models[MODEL].engines = [
                EngineSpec(url=f"http://127.0.0.1:{port}", protocol=PROTOCOL_MODES[protocol][0])
            ]

        async with running_gateway(settings_hook=hook, protocol=protocol) as gw:
            r = await post(gw, "warm", max_tokens=2)
            assert r.status_code == 200, r.text
            engine.close_listener()  # connecting is refused
            scope.cancel()  # and the open (pooled) connections are dropped
            await trio.sleep(0.05)
            before = len(engine.requests)
            for i in range(3):
                r = await post(gw, f"refused{i}", max_tokens=2, stream=stream)
                check_status_error(r, 503)
            assert len(engine.requests) == before, "nothing reached the engine"
            # The engine comes back on the same port; the gateway serves again.
            scope = trio.CancelScope()
            await nursery.start(run_engine, port)
            with trio.fail_after(15):
                while (await gw.client.get("/readyz")).status_code != 200:
                    await trio.sleep(0.05)
            await still_serves(gw)
            assert engine.aborts == []
        scope.cancel()


# ---- faults before any chunk: a proper status ------------------------------------------------

# (id, plan, status, error code)
PRE_CHUNK: list[tuple[str, Plan, int, str]] = [
    ("http500", Plan(TOKENS, fault=Fault.http_error(500, SECRET)), 502, "upstream_error"),
    ("http503", Plan(TOKENS, fault=Fault.http_error(503, SECRET)), 503, "engine_unavailable"),
    ("http400", Plan(TOKENS, fault=Fault.http_error(400, SECRET)), 400, "invalid_request"),
    ("reset_after_head", Plan(TOKENS, fault=Fault.reset(0)), 502, "upstream_truncated"),
    ("eof_clean", Plan(TOKENS, fault=Fault.eof(0)), 502, "upstream_truncated"),
    ("eof_abrupt", Plan(TOKENS, fault=Fault.eof(0, clean=False)), 502, "upstream_truncated"),
    ("malformed", Plan(TOKENS, fault=Fault.malformed(0)), 500, "malformed_upstream"),
    ("event_500", Plan(TOKENS, fault=Fault.error_event(0, SECRET, 500)), 500, "upstream_error"),
    ("event_400", Plan(TOKENS, fault=Fault.error_event(0, SECRET, 400)), 400, "invalid_request"),
    ("abort_503", Plan([], finish=abort_finish(SECRET, 503, "X")), 503, "upstream_aborted"),
    ("abort_400", Plan([], finish=abort_finish(SECRET, 400, "X")), 400, "invalid_request"),
]  # fmt: skip


@pytest.mark.parametrize(("protocol", "plan", "status", "code"), by_protocol(PRE_CHUNK))
async def test_fault_before_any_chunk_is_a_status(
    protocol: str, plan: Plan, status: int, code: str
) -> None:
    engine = fake(protocol, faulty(plan))
    async with running_gateway(engine, protocol=protocol) as gw:
        for stream in (False, True):
            rid = f"fault1s{int(stream)}"
            r = await post(gw, rid, stream=stream)
            err = check_status_error(r, status)
            assert err["code"] == code, (stream, err)
            assert f"{rid}-0" in generate_rids(engine, protocol)
            await settled(engine)
            at_most_one_abort(engine, protocol)
            await still_serves(gw)


async def test_reset_before_headers_is_a_status(protocol: str) -> None:
    """The engine resets the connection before its response head: not a 200."""
    engine = fake(protocol, faulty(Plan(TOKENS, fault=Fault.reset(before_headers=True))))
    async with running_gateway(engine, protocol=protocol) as gw:
        for stream in (False, True):
            rid = f"fault-rst-{int(stream)}"
            r = await post(gw, rid, stream=stream)
            assert r.status_code in (502, 503), r.text
            check_status_error(r, r.status_code)
            assert f"{rid}-0" in generate_rids(engine, protocol)
        await settled(engine)
        at_most_one_abort(engine, protocol)
        await still_serves(gw)


async def test_eof_before_headers_is_a_status(protocol: str) -> None:
    engine = fake(protocol, faulty(Plan(TOKENS, fault=Fault(FaultKind.EOF, before_headers=True))))
    async with running_gateway(engine, protocol=protocol) as gw:
        for stream in (False, True):
            r = await post(gw, f"fault-eof-{int(stream)}", stream=stream)
            assert r.status_code in (502, 503), r.text
            check_status_error(r, r.status_code)
        await settled(engine)
        at_most_one_abort(engine, protocol)
        await still_serves(gw)


# ---- faults after the first chunk: 200, SSE error, [DONE] ----------------------------------

# (id, plan, error code); the fault fires after two tokens went out
MID_STREAM: list[tuple[str, Plan, str]] = [
    ("reset", Plan(TOKENS, fault=Fault.reset(2)), "upstream_truncated"),
    ("eof_clean", Plan(TOKENS, fault=Fault.eof(2)), "upstream_truncated"),
    ("eof_abrupt", Plan(TOKENS, fault=Fault.eof(2, clean=False)), "upstream_truncated"),
    ("malformed", Plan(TOKENS, fault=Fault.malformed(2)), "malformed_upstream"),
    ("error_event_500", Plan(TOKENS, fault=Fault.error_event(2, SECRET, 500)), "upstream_error"),
    ("error_event_400", Plan(TOKENS, fault=Fault.error_event(2, SECRET, 400)), "invalid_request"),
    ("abort_503", Plan(TOKENS, finish=abort_finish(SECRET, 503, "X")), "upstream_aborted"),
    ("abort_400", Plan(TOKENS, finish=abort_finish(SECRET, 400, "X")), "invalid_request"),
]
MID_STREAM_CASES = pytest.mark.parametrize(("protocol", "plan", "code"), by_protocol(MID_STREAM))


@MID_STREAM_CASES
async def test_fault_after_first_chunk_streaming(protocol: str, plan: Plan, code: str) -> None:
    engine = fake(protocol, faulty(plan))
    async with running_gateway(engine, protocol=protocol, settings_hook=no_resumes) as gw:
        r = await post(gw, "fault2", stream=True)
        assert r.status_code == 200, r.text
        err, events = check_sse_error_tail(r.text)
        assert err["code"] == code, err
        text = "".join(
            e["choices"][0]["delta"].get("content") or ""
            for e in events
            if isinstance(e, dict) and e.get("choices")
        )
        assert text.startswith(" w0 w1"), events
        assert not any(
            e["choices"][0]["finish_reason"]
            for e in events
            if isinstance(e, dict) and e.get("choices")
        ), "no closure chunk for a choice that failed"
        assert generate_rids(engine, protocol) == ["fault2-0"]
        await settled(engine)
        at_most_one_abort(engine, protocol)
        await still_serves(gw)


MID_STATUS = {
    "upstream_truncated": 502,
    "malformed_upstream": 500,
    "upstream_error": 500,
    "invalid_request": 400,
    "upstream_aborted": 503,
}


@MID_STREAM_CASES
async def test_fault_after_first_chunk_non_streaming(protocol: str, plan: Plan, code: str) -> None:
    """Not streaming: the whole answer is collected first, so any fault is a status."""
    engine = fake(protocol, faulty(plan))
    async with running_gateway(engine, protocol=protocol, settings_hook=no_resumes) as gw:
        r = await post(gw, "fault3", stream=False)
        err = check_status_error(r, MID_STATUS[code])
        assert err["code"] == code
        await settled(engine)
        at_most_one_abort(engine, protocol)
        await still_serves(gw)


# ---- engine hangs ----------------------------------------------------------------------------

HANGS: list[tuple[str, Fault, bool]] = [
    # (id, fault, a chunk went out before it)
    ("before_headers", Fault.hang(before_headers=True), False),
    ("before_first_token", Fault.hang(0), False),
    ("between_tokens", Fault.hang(2), True),
]


@pytest.mark.parametrize("n", [1, 2], ids=["inline", "channel"])
@pytest.mark.parametrize(
    ("fault", "after_chunk"), [c[1:] for c in HANGS], ids=[c[0] for c in HANGS]
)
async def test_engine_hang_times_out_and_aborts(
    fault: Fault, after_chunk: bool, n: int, protocol: str
) -> None:
    """token_gap_timeout covers the time to the first token too (settings/schema.py), so a hang
    anywhere ends the request within a bounded time and aborts the hung rid upstream (n = 1:
    the response task's own reads; n = 2: each candidate task's)."""
    engine = fake(protocol, faulty(Plan(TOKENS, fault=fault)))
    hook = no_resumes
    async with running_gateway(
        engine, protocol=protocol, token_gap_timeout=0.5, settings_hook=hook
    ) as gw:
        for stream in (False, True):
            rid = f"fault-hang{int(stream)}"
            r, elapsed = await timed_post(gw, rid, stream=stream, n=n)
            assert elapsed < 5, f"answered after {elapsed:.1f}s with a 0.5s token gap"
            if stream and after_chunk:
                assert r.status_code == 200
                err, _ = check_sse_error_tail(r.text)
            else:
                err = check_status_error(r, 504)
            assert err["code"] == "upstream_timeout", err
            # The hung generation was aborted upstream, once, and nothing runs any more.
            await aborted_once(engine, [f"{rid}-{i}" for i in range(n)], protocol=protocol)
            await settled(engine)
            await still_serves(gw)


@pytest.mark.parametrize("n", [1, 2], ids=["inline", "channel"])
@pytest.mark.parametrize(
    "fault", [Fault.hang(before_headers=True), Fault.hang(0)], ids=["no_head", "head_only"]
)
async def test_a_hung_engine_is_not_retried_on_another_replica(
    fault: Fault, n: int, protocol: str
) -> None:
    """Regression: with two replicas, a request whose engine hung (before its head, or after
    it with no token) was retried on the other replica once the gap passed and waited on
    again: 504 after twice the timeout. A timed-out attempt reached a model: it is aborted and
    the client gets 504 after one gap; the other replica never sees the request."""
    engines = [fake(protocol, faulty(Plan(TOKENS, fault=fault))) for _ in range(2)]
    gap = 0.6
    async with running_gateway(engines, protocol=protocol, token_gap_timeout=gap) as gw:
        for stream in (False, True):
            rid = f"fault-hung{int(stream)}"
            r, elapsed = await timed_post(gw, rid, stream=stream, n=n)
            err = check_status_error(r, 504)
            assert err["code"] == "upstream_timeout", err
            # one gap and some (a retry would take two: 2.04 x before the change)
            assert elapsed < 1.7 * gap, f"504 after {elapsed:.2f}s with a {gap}s token gap"
            asked = [
                e for e in engines if any(x.startswith(rid) for x in generate_rids(e, protocol))
            ]
            assert len(asked) == 1, "the hung request was retried on the other replica"
            await aborted_once(asked[0], [f"{rid}-{i}" for i in range(n)], protocol=protocol)
            await settled(asked[0])
        for e in engines:
            e.script = DefaultScript()
        await still_serves(gw)


# ---- the client goes away --------------------------------------------------------------------


def long_plan(call: Call) -> Plan:
    return Plan([f" t{k}" for k in range(400)], itl=0.02)


BEFORE_HEADERS = {
    # the engine sent its head but no token yet (the gateway is priming)
    "engine_slow": Plan(TOKENS, ttft=30.0),
    # the engine has not even sent its response head
    "engine_no_head": Plan(TOKENS, fault=Fault.hang(before_headers=True)),
}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("engine_state", list(BEFORE_HEADERS))
async def test_client_disconnect_before_headers(n: int, engine_state: str, protocol: str) -> None:
    engine = fake(protocol, faulty(BEFORE_HEADERS[engine_state]))
    async with running_gateway(engine, protocol=protocol) as gw:
        rids = [f"fault-gone-{i}" for i in range(n)]
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def client() -> None:
                with scope:
                    await gw.client.post(
                        CHAT,
                        json=chat_body(protocol, "fault-gone", stream=True, n=n),
                        headers={"X-Request-Id": "fault-gone"},
                    )

            nursery.start_soon(client)
            with trio.fail_after(10):
                await engine.wait_for(lambda: engine.running >= set(rids))
            await trio.sleep(0.1)
            scope.cancel()
        await aborted_once(engine, rids, protocol=protocol)
        await settled(engine)
        assert set(engine.finished).isdisjoint(rids)
        await still_serves(gw)


@pytest.mark.parametrize("n", [1, 3])
async def test_client_disconnect_mid_stream(n: int, protocol: str) -> None:
    engine = fake(protocol, faulty(long_plan))
    async with running_gateway(engine, protocol=protocol) as gw:
        rids = [f"fault-mid-{i}" for i in range(n)]
        with trio.fail_after(20):
            async with gw.client.stream(
                "POST",
                CHAT,
                json=chat_body(protocol, "fault-mid", stream=True, n=n, max_tokens=400),
                headers={"X-Request-Id": "fault-mid"},
            ) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen >= n + 5:  # role chunks plus a few content chunks
                        break
        await aborted_once(engine, rids, protocol=protocol)
        await settled(engine)
        assert set(engine.finished).isdisjoint(rids)
        await still_serves(gw)


async def test_client_cancels_non_streaming_request(protocol: str) -> None:
    engine = fake(protocol, faulty(long_plan))
    async with running_gateway(engine, protocol=protocol) as gw:
        rids = [f"fault-ns-{i}" for i in range(2)]
        with trio.move_on_after(0.5) as scope:
            await gw.client.post(
                CHAT,
                json=chat_body(protocol, "fault-ns", n=2, max_tokens=400),
                headers={"X-Request-Id": "fault-ns"},
            )
        assert scope.cancelled_caught, "the 8-second generation cannot have finished"
        await aborted_once(engine, rids, protocol=protocol)
        await settled(engine)
        assert set(engine.finished).isdisjoint(rids)
        await still_serves(gw)


async def test_client_that_reads_nothing_gets_upstream_aborted(protocol: str) -> None:
    """A client that stops reading: after client_stall_timeout the candidates are aborted,
    even though the gateway's write to the socket is still parked."""
    engine = fake(protocol, faulty(big_tokens(20_000, itl=0.0005)))
    async with running_gateway(engine, protocol=protocol, client_stall_timeout=0.5) as gw:
        stream = await small_window_client(gw)
        try:
            body = chat_body(protocol, "fault-stall", stream=True, max_tokens=20_000)
            await stream.send_all(raw_request(body, "fault-stall"))
            t0 = trio.current_time()
            with trio.fail_after(20):
                await engine.wait_for(lambda: "fault-stall-0" in ended(engine, protocol))
            took = trio.current_time() - t0
            await settled(engine)
            assert "fault-stall-0" not in engine.finished
            assert Counter(ended(engine, protocol))["fault-stall-0"] == 1
            assert took < 15, took
        finally:
            await stream.aclose()
        await still_serves(gw)


@pytest.mark.parametrize("n", [1, 2], ids=["inline", "channel"])
async def test_a_stalled_client_is_not_an_engine_timeout(n: int, protocol: str) -> None:
    """Regression: with token_gap_timeout at or below client_stall_timeout, a client that
    stops reading was reported as an engine timeout (abort cause ``timeout``, an
    ``upstream_timeout`` error): the gap clock ran while the gateway was blocked writing to
    the client. The gap measures the engine's silence only; the client is reported as
    stalled, after client_stall_timeout, whatever the two settings are."""
    engine = fake(protocol, faulty(big_tokens(20_000, itl=0.0005)))
    gap, stall = 0.4, 1.2
    async with running_gateway(
        engine, protocol=protocol, token_gap_timeout=gap, client_stall_timeout=stall
    ) as gw:
        stream = await small_window_client(gw)
        rids = [f"fault-slow-{i}" for i in range(n)]
        try:
            body = chat_body(protocol, "fault-slow", stream=True, n=n, max_tokens=20_000)
            await stream.send_all(raw_request(body, "fault-slow"))
            t0 = trio.current_time()
            with trio.fail_after(20):
                await engine.wait_for(lambda: all(r in ended(engine, protocol) for r in rids))
            took = trio.current_time() - t0
            assert took >= stall * 0.9, f"aborted after {took:.2f}s, before the stall limit"
            got = bytearray()
            with trio.fail_after(20):  # the client reads again: the rest, then the end
                while b"data: [DONE]" not in got:
                    data = await stream.receive_some(65536)
                    assert data, "the gateway closed the stream without [DONE]"
                    got += data
            assert b'"code":"client_stalled"' in got
            assert b"upstream_timeout" not in got
            await settled(engine)
            assert Counter(ended(engine, protocol)) == Counter(rids)
        finally:
            await stream.aclose()
        await still_serves(gw)


@pytest.mark.parametrize("n", [1, 2], ids=["inline", "channel"])
async def test_a_slow_client_does_not_use_up_the_engines_gap(n: int, protocol: str) -> None:
    """Regression: a client that paused reading for longer than token_gap_timeout (and less
    than client_stall_timeout) got an ``upstream_timeout`` error from an engine that was never
    silent: the gateway's blocked write counted in the gap. The stream now ends normally."""
    tokens = 400
    engine = fake(protocol, faulty(big_tokens(tokens)))
    gap, stall = 0.6, 5.0
    async with running_gateway(
        engine, protocol=protocol, token_gap_timeout=gap, client_stall_timeout=stall
    ) as gw:
        stream = await small_window_client(gw)
        try:
            body = chat_body(protocol, "fault-pause", stream=True, n=n, max_tokens=tokens)
            await stream.send_all(raw_request(body, "fault-pause"))
            got = bytearray(await stream.receive_some(4096))
            await trio.sleep(2.5 * gap)  # the gateway's writes block meanwhile
            with trio.fail_after(20):
                while not got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                    data = await stream.receive_some(65536)
                    assert data, "the gateway closed the stream without [DONE]"
                    got += data
            assert b'"error"' not in got, bytes(got[-400:])
            assert got.count(b'"finish_reason":"length"') == n
            await settled(engine)
            assert ended(engine, protocol) == []
        finally:
            await stream.aclose()
        await still_serves(gw)


# ---- fan-out -------------------------------------------------------------------------------


async def test_n128_one_candidate_fails(protocol: str) -> None:
    """n=128 with candidate 77 failing after a few tokens: error event then [DONE], every
    other (unfinished) candidate aborted exactly once, nothing left running."""

    def script(call: Call) -> Plan:
        if call.rid.endswith("-77"):
            # Late enough that every sibling has its response head by then (fanning 128 new
            # upstream connections out takes seconds on a loaded 2-CPU box).
            return Plan(TOKENS, ttft=4.0, itl=0.05, fault=Fault.error_event(3, SECRET, 500))
        return Plan([f" c{k}" for k in range(500)], itl=0.02)

    engine = fake(protocol, script)
    async with running_gateway(engine, protocol=protocol, settings_hook=no_resumes) as gw:
        r = await post(gw, "fan", stream=True, n=128, max_tokens=500)
        assert r.status_code == 200, r.text
        err, events = check_sse_error_tail(r.text)
        assert err["code"] == "upstream_error"
        assert [e["choices"][0]["index"] for e in events[:128]] == list(range(128))
        rids = [f"fan-{i}" for i in range(128)]
        assert sorted(generate_rids(engine, protocol)) == sorted(rids)
        others = [r for r in rids if r != "fan-77"]
        await aborted_once(engine, others, protocol=protocol)
        await settled(engine)
        assert engine.finished == [], "a 10-second generation cannot have finished"
        counts = Counter(ended(engine, protocol))
        assert counts["fan-77"] <= 1
        assert set(counts) <= set(rids)
        await still_serves(gw)


def _ranked_script(call: Call) -> Plan:
    """Four tokens per candidate, named after it, each with the candidate's own logprob: the
    scores are distinct, so the top ``n`` are known (``_score``)."""
    k = int(call.rid.rsplit("-", 1)[1])
    return Plan([f" c{k}t{j}" for j in range(4)], logprobs=[_score(k)] * 4)


def _score(k: int) -> float:
    return -((k * 37) % 128) / 64  # a permutation of 0..127 over the candidates


async def test_best_of_128_all_finishing_together_returns_the_top_n(protocol: str) -> None:
    """Regression: best_of = 128 with 4-token candidates answered 500 ("result requested
    before every choice finished"): a loser cancelled while its task waited for room in the
    full channel to queue the engine's finish lost that finish."""
    engine = fake(protocol, _ranked_script)
    async with running_gateway(engine, protocol=protocol) as gw:
        for rid, n in (("bo128a", None), ("bo128b", 3)):
            extra: dict[str, Any] = {"best_of": 128, "max_tokens": 4, "logprobs": True}
            if n is not None:
                extra["n"] = n
            r = await post(gw, rid, **extra)
            assert r.status_code == 200, r.text
            choices = r.json()["choices"]
            top = sorted(range(128), key=lambda k: -_score(k))[: n or 1]
            assert [c["index"] for c in choices] == list(range(n or 1))
            got = [c["message"]["content"] for c in choices]
            assert got == ["".join(f" c{k}t{j}" for j in range(4)) for k in top]
            assert all(c["finish_reason"] == "length" for c in choices)
        await settled(engine)
        at_most_one_abort(engine, protocol)
        await still_serves(gw)


async def test_n128_streamed_all_finishing_together(protocol: str) -> None:
    """n = 128 streamed, 4-token candidates finishing in the same steps: every choice gets its
    tokens and its closure chunk, then [DONE]."""
    engine = fake(protocol, _ranked_script)
    async with running_gateway(engine, protocol=protocol) as gw:
        r = await post(gw, "st128", stream=True, n=128, max_tokens=4)
        assert r.status_code == 200, r.text
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if isinstance(e, dict)]
        assert not any("error" in e for e in chunks)
        text: dict[int, str] = {}
        reasons: dict[int, str] = {}
        for e in chunks:
            c = e["choices"][0]
            text[c["index"]] = text.get(c["index"], "") + (c["delta"].get("content") or "")
            if c["finish_reason"] is not None:
                assert c["index"] not in reasons
                reasons[c["index"]] = c["finish_reason"]
        assert reasons == dict.fromkeys(range(128), "length")
        assert text == {k: "".join(f" c{k}t{j}" for j in range(4)) for k in range(128)}
        await settled(engine)
        assert ended(engine, protocol) == []


async def test_n4_all_finish_no_aborts(protocol: str) -> None:
    engine = fake(protocol)
    async with running_gateway(engine, protocol=protocol) as gw:
        for stream in (True, False):
            r = await post(gw, f"ok{int(stream)}", stream=stream, n=4, max_tokens=8)
            assert r.status_code == 200, r.text
        await settled(engine)
        await trio.sleep(0.2)
        assert ended(engine, protocol) == []
        assert sorted(engine.finished) == sorted(f"ok{s}-{i}" for s in (0, 1) for i in range(4))
