"""The streaming core end to end: order contract, backpressure, long streams, engine contract."""

from __future__ import annotations

import gc
import json
import tracemalloc
from typing import Any

import pytest
import trio

from engine.fake import Call, FakeEngine, Plan
from tests import sglang_contract
from tests.contract_cases import PNG_DATA_URI

from .harness import MODEL, host_port, running_gateway, sse_events


def _idx(call: Call) -> int:
    """The candidate index the gateway encoded in the rid (``<request_id>-<index>``)."""
    return int(call.rid.rsplit("-", 1)[1])


def _check_order(events: list[Any], n: int, include_usage: bool) -> dict[int, str]:
    """Assert the contract's streaming order; return each choice's text."""
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    chunks = events[:-1]
    # 1. one role chunk per choice, indexes 0..n-1 in order, before any content
    for i in range(n):
        (c,) = chunks[i]["choices"]
        assert c["index"] == i
        assert c["delta"] == {"role": "assistant", "content": ""}
    body = chunks[n:]
    if include_usage:
        usage_chunk = body[-1]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] > 0
        body = body[:-1]
        assert all(ch["usage"] is None for ch in chunks[:-1])
    else:
        assert all("usage" not in ch for ch in chunks)
    texts = {i: "" for i in range(n)}
    closed: set[int] = set()
    for ch in body:
        assert ch["object"] == "chat.completion.chunk"
        (c,) = ch["choices"]
        i = c["index"]
        assert i not in closed, f"delta for choice {i} after its closure"
        if c["finish_reason"] is not None:
            assert c["delta"] == {}
            assert c["finish_reason"] in ("stop", "length", "tool_calls")
            closed.add(i)
        else:
            assert "role" not in c["delta"]
            texts[i] += c["delta"].get("content") or ""
    assert closed == set(range(n)), "every choice gets exactly one closure chunk"
    return texts


@pytest.mark.parametrize("n", [1, 4, 16, 128])
async def test_order_contract_for_n(n: int) -> None:
    engine = FakeEngine(
        script=lambda call: Plan(tokens=[f"t{_idx(call)}-{k} " for k in range(6)], itl=0.001)
    )
    async with running_gateway(engine) as gw:
        with trio.fail_after(60):
            r = await gw.chat(
                n=n, stream=True, max_tokens=6, stream_options={"include_usage": True}
            )
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        texts = _check_order(events, n, include_usage=True)
        assert len(set(texts.values())) == n, "each choice has its own text"
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] == 6 * n
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        # each candidate was its own /generate with its own rid and no `n`
        gens = [b for p, b in engine.requests if p == "/generate"]
        assert sorted(b["rid"] for b in gens) == sorted(
            f"{r.headers['x-request-id']}-{i}" for i in range(n)
        )
        assert all("n" not in b["sampling_params"] for b in gens)
        assert not engine.aborts


async def test_no_usage_key_without_include_usage() -> None:
    async with running_gateway() as gw:
        r = await gw.chat(n=2, stream=True, max_tokens=3)
        _check_order(sse_events(r.text), 2, include_usage=False)


async def test_interleaving_follows_engine_timing() -> None:
    # choice 1 is fast, choice 0 slow: choice 1's tokens (and closure) come first
    def script(call: Call) -> Plan:
        return Plan(tokens=["a ", "b ", "c "], itl=0.15 if _idx(call) == 0 else 0.0)

    async with running_gateway(FakeEngine(script=script)) as gw:
        r = await gw.chat(n=2, stream=True, max_tokens=3)
        events = sse_events(r.text)
        _check_order(events, 2, include_usage=False)
        order = [e["choices"][0]["index"] for e in events[2:-1]]
        first_closure_1 = next(
            k for k, e in enumerate(events[2:-1]) if e["choices"][0]["finish_reason"]
        )
        assert order[first_closure_1] == 1


async def test_completions_stream() -> None:
    async with running_gateway() as gw:
        r = await gw.client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Once", "stream": True, "max_tokens": 4},
        )
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert all(e["object"] == "text_completion" for e in events[:-1])
        assert events[0]["id"] == "cmpl-" + r.headers["x-request-id"]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert all("logprobs" not in e["choices"][0] for e in events[:-1])


async def test_slow_reader_backpressure_bounds_memory() -> None:
    """A client that reads nothing stalls the upstream read; gateway memory stays flat."""
    engine = FakeEngine(script=lambda call: Plan(tokens=[f"tok{k:06d} " for k in range(200_000)]))
    async with running_gateway(engine, client_stall_timeout=300) as gw:
        host, port = host_port(gw)
        body = json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": 200_000,
                "messages": [{"role": "user", "content": "go"}],
            }
        ).encode()
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await engine.wait_for(lambda: bool(engine.running))
        gc.collect()
        tracemalloc.start()
        try:
            await trio.sleep(1.0)
            gc.collect()
            before, _ = tracemalloc.get_traced_memory()
            await trio.sleep(2.0)
            gc.collect()
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # the engine is blocked writing (backpressure reached it), not finished
        assert engine.running
        assert not engine.finished
        assert after - before < 2 * 1024 * 1024, f"gateway memory grew by {after - before} B"
        await stream.aclose()
        with trio.fail_after(10):
            await engine.wait_for(lambda: not engine.running)
        rid = next(b["rid"] for p, b in engine.requests if p == "/generate")
        with trio.fail_after(10):
            await engine.wait_for(lambda: rid in engine.aborts)
        assert engine.aborts.count(rid) == 1


@pytest.mark.slow
async def test_ninety_second_stream_is_not_cut() -> None:
    """Quart's 60 s RESPONSE_TIMEOUT would cut this; the gateway disables it."""
    engine = FakeEngine(script=lambda call: Plan(tokens=[f"s{k} " for k in range(46)], itl=2.0))
    async with running_gateway(engine) as gw:
        with trio.fail_after(150):
            r = await gw.chat(stream=True, max_tokens=46)
        events = sse_events(r.text)
        texts = _check_order(events, 1, include_usage=False)
        assert texts[0].split() == [f"s{k}" for k in range(46)]


async def test_every_generate_body_is_valid_for_sglang() -> None:
    """Bodies the gateway sends pass SGLang 0.5.23's own contract (api_types.py)."""
    sglang_contract.load_contract()
    engine = FakeEngine()
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    requests: list[dict[str, Any]] = [
        {},
        {"n": 3, "seed": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_tokens": 1},
        {
            "stop": ["\n", "END"],
            "frequency_penalty": 0.5,
            "presence_penalty": -0.5,
            "repetition_penalty": 1.1,
            "logit_bias": {"42": 5.0},
        },
        {"logprobs": True, "top_logprobs": 3},
        {"best_of": 3, "n": 2},
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                },
            }
        },
        {"tools": [weather], "tool_choice": "required"},
        {
            "tools": [weather],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        {"tools": [weather], "tool_choice": "auto", "parallel_tool_calls": False},
        {"lora_adapter": "my-adapter", "max_completion_tokens": 9},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": PNG_DATA_URI}},
                    ],
                }
            ]
        },
        {"user": "u", "safety_identifier": "s", "prompt_cache_key": "k", "routing_key": "r"},
    ]
    async with running_gateway(engine) as gw:
        for extra in requests:
            for stream in (False, True) if "best_of" not in extra else (False,):
                r = await gw.chat(max_tokens=4, stream=stream, **extra)
                assert r.status_code == 200, (extra, r.text)
        r = await gw.client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "seed": -3, "stop": "y", "max_tokens": 2},
        )
        assert r.status_code == 200
    bodies = [b for p, b in engine.requests if p == "/generate"]
    assert len(bodies) >= 2 * len(requests)
    for b in bodies:
        sglang_contract.validate_generate_request(b)
        for key in ("user", "safety_identifier", "prompt_cache_key", "routing_key"):
            assert key not in b and key not in b["sampling_params"]
