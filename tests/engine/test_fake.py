"""The scripted fake engine, over a real loopback socket with httpx on trio."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from engine.fake import (
    DEFAULT_MAX_NEW_TOKENS,
    EOS_TOKEN_ID,
    Call,
    DefaultScript,
    FakeEngine,
    Fault,
    FaultKind,
    Plan,
    SequenceScript,
    abort_finish,
    default_tokens,
)

ROOT = Path(__file__).resolve().parents[2]
GUARD = 10.0


@asynccontextmanager
async def serving(
    nursery: trio.Nursery, engine: FakeEngine
) -> AsyncIterator[tuple[httpx.AsyncClient, int]]:
    port = await nursery.start(engine.serve)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as client:
        yield client, port


def parse_sse(raw: bytes) -> list[Any]:
    """Events of an SSE body, checking SGLang's exact framing; "[DONE]" stays a string."""
    assert raw.endswith(b"\n\n")
    out: list[Any] = []
    for frame in raw[:-2].split(b"\n\n"):
        assert frame.startswith(b"data: "), frame
        payload = frame[6:]
        if payload == b"[DONE]":
            out.append("[DONE]")
            continue
        obj = json.loads(payload)
        # Compact, keys in order, non-ASCII unescaped. Floats are compared as msgspec writes
        # them (0.000092, where json.dumps writes 9.2e-05): a latency under 0.1 ms is one.
        assert payload == msgspec.json.encode(obj)
        out.append(obj)
    return out


async def stream_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream"
        raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    return parse_sse(raw)


# ---- /generate, normal operation ---------------------------------------------------------------


async def test_non_stream_default_script(nursery: trio.Nursery) -> None:
    engine = FakeEngine()
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            body = {"text": "hello there", "rid": "r1", "sampling_params": {"max_new_tokens": 5}}
            resp = await client.post("/generate", json=body)
            assert resp.status_code == 200
            assert resp.headers["content-type"] == "application/json"
            out = resp.json()
            assert out["meta_info"]["id"] == "r1"
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
            assert out["meta_info"]["completion_tokens"] == 5
            assert out["meta_info"]["prompt_tokens"] == 2
            assert out["meta_info"]["cached_tokens"] == 0
            assert out["meta_info"]["weight_version"] == "default"
            assert isinstance(out["meta_info"]["e2e_latency"], float)
            assert len(out["output_ids"]) == 5
            toks = out["text"].split(" ")[1:]
            assert all(a != b for a, b in itertools.pairwise(toks))
            # Deterministic: the same prompt and rid give the same text.
            again = (await client.post("/generate", json=body)).json()
            assert again["text"] == out["text"]
            # max_new_tokens absent means 128.
            resp = await client.post("/generate", json={"input_ids": [1, 2, 3]})
            meta = resp.json()["meta_info"]
            assert meta["completion_tokens"] == DEFAULT_MAX_NEW_TOKENS
            assert meta["prompt_tokens"] == 3
        # The client may see the whole response before the engine's bookkeeping ran.
        await engine.wait_for(lambda: len(engine.finished) == 3)
    assert engine.finished[:2] == ["r1", "r1"]
    assert engine.statistics().connections_accepted == 1  # keep-alive


async def test_stream_cumulative(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["Hel", "lo", " wor", "ld"]))
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            events = await stream_events(client, {"text": "x", "rid": "s1"})
        await engine.wait_for(lambda: engine.finished == ["s1"])
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["text"] for c in chunks] == ["Hel", "Hello", "Hello wor", "Hello world"]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 3
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS_TOKEN_ID}
    assert "e2e_latency" in chunks[-1]["meta_info"]
    assert "e2e_latency" not in chunks[0]["meta_info"]
    assert all("index" not in c for c in chunks)
    assert engine.running == set()


async def test_stream_incremental(nursery: trio.Nursery) -> None:
    engine = FakeEngine(incremental=True)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            info = (await client.get("/server_info")).json()
            assert info["incremental_streaming_output"] is True
            body = {"text": "abc", "rid": "i1", "sampling_params": {"max_new_tokens": 4}}
            events = await stream_events(client, {**body, "return_logprob": True})
            full = (await client.post("/generate", json=body)).json()
    chunks = events[:-1]
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [x for c in chunks for x in c["output_ids"]] == full["output_ids"]
    assert all(len(c["output_ids"]) == 1 for c in chunks)
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in chunks] == [1, 1, 1, 1]
    assert [c["meta_info"]["output_token_logprobs_length"] for c in chunks] == [1, 2, 3, 4]


async def test_stop_strings_trim_and_hold_back(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["a", "b", "<", "/s", ">", "c"]))
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            events = await stream_events(client, {"text": "x", "sampling_params": {"stop": "</s>"}})
            kept = await client.post(
                "/generate",
                json={
                    "text": "x",
                    "sampling_params": {"stop": ["zz", "</s>"], "no_stop_trim": True},
                },
            )
    chunks = events[:-1]
    # "<" and "</s" could still become the stop string: they are held back, never streamed.
    assert [c["text"] for c in chunks] == ["a", "ab", "ab"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "</s>"}
    assert chunks[-1]["meta_info"]["completion_tokens"] == 5
    assert kept.json()["text"] == "ab</s>"


async def test_max_new_tokens_cuts_plan_and_null_is_unlimited(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["x", "y", "z"]))
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            cut = await client.post(
                "/generate", json={"text": "p", "sampling_params": {"max_new_tokens": 2}}
            )
            unl = await client.post(
                "/generate", json={"text": "p", "sampling_params": {"max_new_tokens": None}}
            )
            zero = await stream_events(
                client, {"text": "p", "sampling_params": {"max_new_tokens": 0}}
            )
    assert cut.json()["text"] == "xy"
    assert cut.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert unl.json()["text"] == "xyz"
    assert unl.json()["meta_info"]["finish_reason"]["type"] == "stop"
    assert zero[0]["text"] == "" and zero[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert zero[1] == "[DONE]"


async def test_logprobs(nursery: trio.Nursery) -> None:
    plan = Plan(
        tokens=["A", "B"],
        token_ids=[11, 12],
        logprobs=[-0.5, -0.25],
        top_logprobs=[[(-0.5, 11, "A"), (-1.0, 99, "Z")], [(-0.25, 12, "B"), (-2.0, 98, "Y")]],
    )
    engine = FakeEngine(lambda call: plan)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            body = {"text": "p", "return_logprob": True, "top_logprobs_num": 2}
            plain = (await client.post("/generate", json=body)).json()["meta_info"]
            texts = (
                await client.post("/generate", json={**body, "return_text_in_logprobs": True})
            ).json()["meta_info"]
            default = FakeEngine()
            port = await nursery.start(default.serve)
            dflt = (
                await client.post(
                    f"http://127.0.0.1:{port}/generate",
                    json={
                        "text": "p",
                        "return_logprob": True,
                        "top_logprobs_num": 3,
                        "sampling_params": {"max_new_tokens": 3},
                    },
                )
            ).json()["meta_info"]
    assert plain["output_token_logprobs"] == [[-0.5, 11, None], [-0.25, 12, None]]
    assert plain["output_token_logprobs_length"] == 2
    assert plain["output_top_logprobs"] == [
        [[-0.5, 11, None], [-1.0, 99, None]],
        [[-0.25, 12, None], [-2.0, 98, None]],
    ]
    assert texts["output_token_logprobs"] == [[-0.5, 11, "A"], [-0.25, 12, "B"]]
    assert [len(row) for row in dflt["output_top_logprobs"]] == [3, 3, 3]
    for entry, row in zip(dflt["output_token_logprobs"], dflt["output_top_logprobs"], strict=True):
        assert row[0] == entry


async def test_an_engine_that_returns_no_logprobs(nursery: trio.Nursery) -> None:
    """``returns_logprobs = False``: a request for logprobs is accepted and answered without
    them, in either mode; the text is the same."""
    engine = FakeEngine(lambda call: Plan(tokens=["A", "B"], logprobs=[-0.5, -0.25]))
    engine.returns_logprobs = False
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            native = (await client.post("/generate", json={"text": "p", "return_logprob": True}))
            body = {"model": "m", "prompt": "p", "stream": True, "logprobs": 0}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    meta = native.json()["meta_info"]
    assert native.json()["text"] == "AB" and "output_token_logprobs" not in meta
    chunks = [e for e in parse_sse(raw) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in chunks) == "AB"
    assert all(e["choices"][0]["logprobs"] is None for e in chunks)


async def test_openai_mode_names_a_request_by_name_request(nursery: trio.Nursery) -> None:
    """The OpenAI mode has no rid: ``name_request`` names a request from its body (records and
    script), else it gets a generated ``cmpl-`` id."""
    seen: list[str] = []

    def script(call: Call) -> Plan:
        seen.append(call.rid)
        return Plan(tokens=["A"])

    engine = FakeEngine(script)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            for name in ("first", None):
                engine.name_request = (lambda b, n=name: n and f"{n}-{b['seed']}")
                body = {"model": "m", "prompt": "p", "stream": True, "seed": 3}
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    await resp.aread()
            # The engine records a request finished after its last write: the client can read
            # the whole body first.
            await engine.wait_for(lambda: len(engine.finished) == 2)
    assert seen[0] == "first-3" and seen[1].startswith("cmpl-")
    assert engine.finished == seen


async def test_script_sees_the_call(nursery: trio.Nursery) -> None:
    seen: list[Call] = []

    def script(call: Call) -> Plan:
        seen.append(call)
        return Plan(tokens=["ok"])

    engine = FakeEngine(script)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            body = {
                "text": "a b c",
                "rid": "q",
                "stream": True,
                "sampling_params": {"max_new_tokens": 7, "stop": ["x"]},
            }
            await stream_events(client, body)
    (call,) = seen
    assert (call.rid, call.prompt, call.prompt_tokens, call.max_new_tokens, call.stop) == (
        "q",
        "a b c",
        3,
        7,
        ("x",),
    )
    assert call.stream and call.path == "/generate" and call.body["rid"] == "q"
    assert engine.requests == [("/generate", body)]


async def test_sequence_script_and_timing(nursery: trio.Nursery) -> None:
    script = SequenceScript(
        [Plan(tokens=["a", "b", "c"], ttft=0.2, itl=[0.05, 0.05])], then=DefaultScript(tokens=1)
    )
    engine = FakeEngine(script)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            t0 = trio.current_time()
            first = (await client.post("/generate", json={"text": "p"})).json()
            elapsed = trio.current_time() - t0
            second = (await client.post("/generate", json={"text": "p"})).json()
    assert first["text"] == "abc" and elapsed >= 0.29
    assert second["meta_info"]["completion_tokens"] == 1


def test_default_tokens_distinct() -> None:
    texts, ids = default_tokens(12345, 5000)
    assert all(a != b for a, b in itertools.pairwise(texts))
    assert len(set(texts)) == 5000 and len(set(ids)) == 5000
    assert default_tokens(12345, 3) == (texts[:3], ids[:3])


# ---- abort and disconnect ----------------------------------------------------------------


async def test_abort_request_ends_exactly_that_rid(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["t"] * 1000, itl=0.02))
    results: dict[str, list[Any]] = {}

    async def consume(client: httpx.AsyncClient, rid: str) -> None:
        results[rid] = await stream_events(client, {"text": "p", "rid": rid})

    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _), trio.open_nursery() as inner:
            inner.start_soon(consume, client, "keep")
            inner.start_soon(consume, client, "kill")
            await engine.wait_for(lambda: engine.running == {"keep", "kill"})
            await trio.sleep(0.05)
            resp = await client.post("/abort_request", json={"rid": "kill"})
            assert resp.status_code == 200 and resp.content == b""
            resp = await client.post("/abort_request", json={"rid": "unknown"})
            assert resp.status_code == 200
            await engine.wait_for(lambda: "kill" in engine.aborted)
            assert engine.running == {"keep"}
            await client.post("/abort_request", json={"rid": "keep"})
        await engine.wait_for(lambda: len(engine.aborted) == 2)
    killed = results["kill"]
    assert killed[-1] == "[DONE]"
    assert killed[-2]["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert killed[-2]["text"] == killed[-3]["text"]  # cumulative: the whole text again
    assert engine.aborts == ["kill", "unknown", "keep"]
    assert sorted(engine.aborted) == ["keep", "kill"]
    assert engine.statistics().aborts_received == 3


async def test_abort_incremental_quirk(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["a", "b", "c"], itl=[0.01, 60]), incremental=True)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _), trio.open_nursery() as inner:
            out: list[Any] = []

            async def consume() -> None:
                out.extend(await stream_events(client, {"text": "p", "rid": "q"}))

            inner.start_soon(consume)
            await engine.wait_for(lambda: engine.statistics().chunks_sent >= 2)
            await client.post("/abort_request", json={"rid": "q"})
    assert [c["text"] for c in out[:-1]] == ["a", "b", "ab"]
    assert out[-2]["output_ids"] == out[1]["output_ids"]  # [last id], SGLang's quirk
    assert out[-2]["meta_info"]["finish_reason"]["type"] == "abort"


async def test_abort_while_hanging_before_first_token(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["a"], fault=Fault.hang(at=0)))
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _), trio.open_nursery() as inner:
            out: list[Any] = []

            async def consume() -> None:
                out.extend(await stream_events(client, {"text": "p", "rid": "h"}))

            inner.start_soon(consume)
            await engine.wait_for(lambda: "h" in engine.running)
            await client.post("/abort_request", json={"rid": "h"})
    assert [c["text"] for c in out[:-1]] == [""]
    assert out[0]["meta_info"]["finish_reason"]["message"] == "Aborted"


async def test_abort_all(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["a"], ttft=60))
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _), trio.open_nursery() as inner:
            for rid in ("x", "y"):
                inner.start_soon(partial(client.post, "/generate", json={"text": "p", "rid": rid}))
            await engine.wait_for(lambda: engine.running == {"x", "y"})
            await client.post("/abort_request", json={"rid": "", "abort_all": True})
            await engine.wait_for(lambda: not engine.running)
    assert sorted(engine.aborted) == ["x", "y"]


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_stops_generation(nursery: trio.Nursery, stream: bool) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["t"] * 10_000, itl=0.01))
    with trio.fail_after(GUARD):
        port = await nursery.start(engine.serve)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            if stream:
                async with client.stream(
                    "POST", "/generate", json={"text": "p", "rid": "gone", "stream": True}
                ) as r:
                    async for _ in r.aiter_raw():
                        break
            else:
                with trio.move_on_after(0.1):
                    await client.post("/generate", json={"text": "p", "rid": "gone"})
        await engine.wait_for(lambda: engine.cancelled == ["gone"])
    assert engine.running == set()
    assert engine.outcomes["gone"] == "cancelled"
    assert engine.statistics().tokens_generated < 1000


# ---- faults -------------------------------------------------------------------------------


async def test_fault_error_event(nursery: trio.Nursery) -> None:
    engine = FakeEngine(
        lambda call: Plan(tokens=["a", "b"], fault=Fault.error_event(at=1, message="bad", code=400))
    )
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            events = await stream_events(client, {"text": "p", "rid": "e"})
            resp = await client.post("/generate", json={"text": "p"})
        await engine.wait_for(lambda: len(engine.faulted) == 2)
    assert events[0]["text"] == "a"
    assert events[1] == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }
    assert events[2] == "[DONE]" and len(events) == 3
    assert resp.status_code == 400 and resp.json() == {"error": {"message": "bad"}}
    assert engine.faulted[0] == ("e", FaultKind.ERROR_EVENT)


async def test_fault_eof_clean_and_truncated(nursery: trio.Nursery) -> None:
    script = SequenceScript(
        [
            Plan(tokens=["a", "b"], fault=Fault.eof(at=1)),
            Plan(tokens=["a", "b"], fault=Fault.eof(at=1, clean=False)),
            Plan(tokens=["a"], fault=Fault.eof(at=5)),
        ]
    )
    engine = FakeEngine(script)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            clean = await stream_events(client, {"text": "p"})
            with pytest.raises(httpx.RemoteProtocolError):
                await stream_events(client, {"text": "p"})
            after_finish = await stream_events(client, {"text": "p"})
    assert [e["text"] for e in clean] == ["a"]  # no [DONE]
    assert after_finish[-1]["meta_info"]["finish_reason"] is not None  # but no [DONE]
    assert "[DONE]" not in after_finish


async def test_fault_reset(nursery: trio.Nursery) -> None:
    script = SequenceScript(
        [
            Plan(tokens=["a", "b"], fault=Fault.reset(at=1)),
            Plan(tokens=["a"], fault=Fault.reset(before_headers=True)),
        ]
    )
    engine = FakeEngine(script)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
                await stream_events(client, {"text": "p"})
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
                await client.post("/generate", json={"text": "p", "stream": True})
        await engine.wait_for(lambda: len(engine.faulted) == 2)
    assert [k for _, k in engine.faulted] == [FaultKind.RESET, FaultKind.RESET]


async def test_fault_hang_between_tokens_then_client_gives_up(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["a", "b"], fault=Fault.hang(at=1)))
    with trio.fail_after(GUARD):
        port = await nursery.start(engine.serve)
        got: list[bytes] = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            with trio.move_on_after(0.3) as scope:
                async with client.stream(
                    "POST", "/generate", json={"text": "p", "rid": "hg", "stream": True}
                ) as r:
                    async for chunk in r.aiter_raw():
                        got.append(chunk)
        assert scope.cancelled_caught
        await engine.wait_for(lambda: engine.cancelled == ["hg"])
    assert parse_sse(b"".join(got))[0]["text"] == "a"


async def test_fault_hang_before_headers_and_timed_hang(nursery: trio.Nursery) -> None:
    script = SequenceScript(
        [
            Plan(tokens=["a"], fault=Fault.hang(before_headers=True)),
            Plan(tokens=["a", "b"], fault=Fault.hang(at=1, duration=0.2)),
        ]
    )
    engine = FakeEngine(script)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/generate", json={"text": "p", "stream": True}, timeout=0.2)
            t0 = trio.current_time()
            events = await stream_events(client, {"text": "p"})
            assert trio.current_time() - t0 >= 0.2
    assert [e["text"] for e in events[:-1]] == ["a", "ab"]


async def test_fault_malformed_chunk(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["a"], fault=Fault.malformed(at=0)))
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            async with client.stream("POST", "/generate", json={"text": "p", "stream": True}) as r:
                raw = b"".join([c async for c in r.aiter_raw()])
            unary = await client.post("/generate", json={"text": "p"})
    first, done = raw.split(b"\n\n")[:2]
    with pytest.raises(json.JSONDecodeError):
        json.loads(first[6:])
    assert done == b"data: [DONE]"
    with pytest.raises(json.JSONDecodeError):
        unary.json()


async def test_fault_http_errors(nursery: trio.Nursery) -> None:
    script = SequenceScript(
        [
            Plan(tokens=[], fault=Fault.http_error(503, "overloaded")),
            Plan(tokens=[], fault=Fault.http_error(400, "too long")),
            Plan(tokens=[], fault=Fault.http_error(502, body=b"bad gateway")),
        ]
    )
    engine = FakeEngine(script)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            r1 = await client.post("/generate", json={"text": "p", "stream": True})
            r2 = await client.post("/generate", json={"text": "p", "stream": True})
            r3 = await client.post("/generate", json={"text": "p"})
    assert r1.status_code == 503
    assert r1.json() == {
        "object": "error",
        "message": "overloaded",
        "type": "503",
        "param": None,
        "code": 503,
    }
    assert r2.status_code == 400 and r2.json() == {"error": {"message": "too long"}}
    assert r3.status_code == 502 and r3.content == b"bad gateway"


async def test_abort_finish_with_status_code(nursery: trio.Nursery) -> None:
    finish = abort_finish("out of memory", 503, "ServiceUnavailable")
    engine = FakeEngine(lambda call: Plan(tokens=["a", "b"], finish=finish))
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            events = await stream_events(client, {"text": "p", "rid": "o"})
            unary = await client.post("/generate", json={"text": "p"})
        await engine.wait_for(lambda: len(engine.aborted) == 2)
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None, None, finish]
    assert events[-2]["text"] == "ab" and events[-1] == "[DONE]"
    assert unary.status_code == 503
    assert unary.json()["code"] == 503 and unary.json()["message"] == "out of memory"
    assert "o" in engine.aborted and engine.finished == []


async def test_refused_connections_and_restart(nursery: trio.Nursery) -> None:
    engine = FakeEngine()
    with trio.fail_after(GUARD):
        port = await nursery.start(engine.serve)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/health")).status_code == 200
        engine.close_listener()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            with pytest.raises(httpx.ConnectError):
                await client.get("/health")
        assert await nursery.start(engine.serve, "127.0.0.1", port) == port
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/health")).status_code == 200


# ---- request validation and other endpoints -------------------------------------------------


async def test_contract_errors(nursery: trio.Nursery) -> None:
    engine = FakeEngine()
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            unknown = await client.post(
                "/generate", json={"text": "p", "sampling_params": {"foo": 1}}
            )
            n2 = await client.post("/generate", json={"text": "p", "sampling_params": {"n": 2}})
            batch = await client.post("/generate", json={"text": ["a", "b"]})
            empty = await client.post("/generate", json={"sampling_params": {}})
            bad = await client.post(
                "/generate", content=b"{nope", headers={"content-type": "application/json"}
            )
            extra = await client.post("/generate", json={"text": "p", "whatever": 1})
    assert unknown.status_code == 400
    assert unknown.json()["error"].startswith(
        "unknown field `foo`, expected one of `max_new_tokens`"
    )
    assert n2.status_code == 400 and "n > 1" in n2.json()["error"]["message"]
    assert batch.status_code == 400 and "batch" in batch.json()["error"]["message"]
    assert empty.status_code == 400
    assert bad.status_code == 400 and bad.json()["type"] == "Bad Request"
    assert extra.status_code == 200  # unknown top-level keys are ignored


async def test_info_endpoints_and_health(nursery: trio.Nursery) -> None:
    engine = FakeEngine(model_path="org/model", served_model_name="m", context_length=4096)
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, port):
            for path in ("/health", "/health_generate"):
                resp = await client.get(path)
                assert resp.status_code == 200 and resp.content == b""
            engine.healthy = False
            assert (await client.get("/health")).status_code == 503
            for path in ("/server_info", "/get_server_info"):
                info = (await client.get(path)).json()
                assert info["model_path"] == "org/model"
                assert info["served_model_name"] == "m"
                assert info["context_length"] == 4096
                assert info["incremental_streaming_output"] is False
                assert info["port"] == port and info["version"]
            for path in ("/model_info", "/get_model_info"):
                minfo = (await client.get(path)).json()
                assert minfo["model_path"] == "org/model" and minfo["is_generation"] is True
            models = (await client.get("/v1/models")).json()
            assert models["data"][0]["id"] == "m" and models["data"][0]["max_model_len"] == 4096
            assert (await client.get("/nope")).status_code == 404
            assert (await client.get("/generate")).status_code == 405
    assert engine.statistics().health_checks == 3


async def test_http10_close_delimited_stream(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["a", "b"]))
    with trio.fail_after(GUARD):
        port = await nursery.start(engine.serve)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        body = b'{"text":"p","stream":true}'
        await stream.send_all(
            b"POST /generate HTTP/1.0\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        raw = b""
        while chunk := await stream.receive_some(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b"chunked" not in head.lower()
    assert parse_sse(payload)[-1] == "[DONE]"


# ---- OpenAI-compatible chat (for third-party benchmarks) ---------------------------------


async def test_chat_completions_stream_n2(nursery: trio.Nursery) -> None:
    engine = FakeEngine()
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "n": 2,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                events = parse_sse(b"".join([c async for c in resp.aiter_raw()]))
            unary = (
                await client.post("/v1/chat/completions", json={**body, "stream": False})
            ).json()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content: dict[int, list[str]] = {0: [], 1: []}
    for c in chunks:
        for ch in c["choices"]:
            if ch["delta"].get("content"):
                content[ch["index"]].append(ch["delta"]["content"])
    assert all(len(v) == 4 for v in content.values())
    assert content[0] != content[1]
    assert all(a != b for v in content.values() for a, b in itertools.pairwise(v))
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length", "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert [c["message"]["content"] for c in unary["choices"]] == [
        "".join(content[0]),
        "".join(content[1]),
    ]
    assert unary["usage"]["total_tokens"] == unary["usage"]["prompt_tokens"] + 8


async def test_chat_completions_fault(nursery: trio.Nursery) -> None:
    engine = FakeEngine(lambda call: Plan(tokens=["a"], fault=Fault.http_error(429, "slow down")))
    with trio.fail_after(GUARD):
        async with serving(nursery, engine) as (client, _):
            resp = await client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
            )
    assert resp.status_code == 429 and resp.json()["message"] == "slow down"


# ---- command line --------------------------------------------------------------------------


async def test_cli_serves() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, "-m", "engine.fake", "--port", "0", "--tokens", "3", "--incremental"]
    with trio.fail_after(GUARD):
        proc = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE, env=env, cwd=ROOT)
        try:
            assert proc.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive_some(1)
            url = line.decode().strip().rsplit(" ", 1)[-1]
            async with httpx.AsyncClient(base_url=url) as client:
                events = await stream_events(client, {"text": "p"})
                info = (await client.get("/server_info")).json()
        finally:
            proc.terminate()
            await proc.wait()
    assert len(events) == 4 and info["incremental_streaming_output"] is True


async def test_load_report_real_scripted_and_absent(nursery: trio.Nursery) -> None:
    engine = FakeEngine(script=DefaultScript(itl=0.05))
    with trio.fail_after(10):
        async with serving(nursery, engine) as (client, _):
            async with client.stream("POST", "/generate", json={"text": "a", "stream": True}):
                await engine.wait_for(lambda: len(engine.running) == 1)
                r = await client.get("/v1/loads")
                assert r.json() == {
                    "loads": [{"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 0}]
                }
            engine.load = (3, 7)
            (rank,) = (await client.get("/get_load")).json()
            assert (rank["num_reqs"], rank["num_waiting_reqs"]) == (10, 7)
            engine.reports_load = False
            assert (await client.get("/v1/loads")).status_code == 404
            assert (await client.get("/get_load")).status_code == 404
