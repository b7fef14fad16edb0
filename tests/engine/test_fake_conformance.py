"""Every response and stream chunk the fake engine emits decodes under SGLang's own contract."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from engine.fake import (
    SAMPLING_PARAMS_FIELDS,
    FakeEngine,
    Fault,
    Plan,
    SequenceScript,
    abort_finish,
)
from tests.sglang_contract import (
    ContractViolation,
    generate_contract_error,
    load_contract,
    sampling_params_fields,
    validate_abort_request,
    validate_generate_chunk,
    validate_generate_request,
    validate_generate_response,
    validate_model_card,
    validate_model_info,
    validate_server_info,
)

GUARD = 15.0


@pytest.fixture(autouse=True)
def contract() -> Any:
    return load_contract()


def events_of(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for frame in raw.split(b"\n\n"):
        if not frame:
            continue
        assert frame.startswith(b"data: ")
        payload = frame[6:]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


REQUESTS: list[dict[str, Any]] = [
    {"text": "hello", "sampling_params": {"max_new_tokens": 4}},
    {"input_ids": [1, 2, 3], "rid": "abc", "sampling_params": {"max_new_tokens": 3, "stop": ["x"],
     "temperature": 0.0, "top_p": 0.9, "top_k": -1, "sampling_seed": 7, "no_stop_trim": True}},
    {"text": "lp", "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": -1,
     "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 3}},
    {"text": "lp", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}},
    {"text": "unlimited", "sampling_params": {"max_new_tokens": None}},
    {"text": "zero", "sampling_params": {"max_new_tokens": 0}},
]  # fmt: skip


@pytest.mark.parametrize("incremental", [False, True])
async def test_generate_chunks_and_bodies_conform(nursery: trio.Nursery, incremental: bool) -> None:
    engine = FakeEngine(incremental=incremental)
    seen = 0
    with trio.fail_after(GUARD):
        port = await nursery.start(engine.serve)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for body in REQUESTS:
                validate_generate_request(body)
                resp = await client.post("/generate", json=body)
                assert resp.status_code == 200
                validate_generate_response(resp.json())
                seen += 1
                resp = await client.post("/generate", json={**body, "stream": True})
                events = events_of(resp.content)
                assert events[-1] == "[DONE]"
                for event in events[:-1]:
                    validate_generate_chunk(event)
                    seen += 1
    assert seen > len(REQUESTS) * 2


async def test_fault_and_abort_chunks_conform(nursery: trio.Nursery) -> None:
    script = SequenceScript(
        [
            Plan(tokens=["a", "b"], fault=Fault.error_event(at=1, message="bad", code=400)),
            Plan(tokens=["a"], finish=abort_finish("OOM", 503, "ServiceUnavailable")),
            Plan(tokens=["a"], finish={"type": "stop", "matched": [2, 3]}),
            Plan(tokens=["a"], finish={"type": "future_reason", "detail": 1}),
            Plan(tokens=["a"], finish=abort_finish("client gone")),
        ]
    )
    engine = FakeEngine(script)
    with trio.fail_after(GUARD):
        port = await nursery.start(engine.serve)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(5):
                resp = await client.post("/generate", json={"text": "p", "stream": True})
                for event in events_of(resp.content)[:-1]:
                    validate_generate_chunk(event)


@pytest.mark.parametrize("incremental", [False, True])
async def test_abort_request_chunks_conform(nursery: trio.Nursery, incremental: bool) -> None:
    engine = FakeEngine(
        lambda call: Plan(tokens=["a", "b", "c"], itl=[0.01, 60]), incremental=incremental
    )
    with trio.fail_after(GUARD):
        port = await nursery.start(engine.serve)
        out: list[bytes] = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

            async def consume() -> None:
                resp = await client.post(
                    "/generate", json={"text": "p", "rid": "q", "stream": True}
                )
                out.append(resp.content)

            async with trio.open_nursery() as inner:
                inner.start_soon(consume)
                await engine.wait_for(lambda: engine.statistics().chunks_sent >= 2)
                abort = {"rid": "q"}
                validate_abort_request(abort)
                await client.post("/abort_request", json=abort)
    events = events_of(out[0])
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    for event in events[:-1]:
        validate_generate_chunk(event)


async def test_info_endpoints_conform(nursery: trio.Nursery) -> None:
    engine = FakeEngine(incremental=True)
    with trio.fail_after(GUARD):
        port = await nursery.start(engine.serve)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for path in ("/server_info", "/get_server_info"):
                info = validate_server_info((await client.get(path)).json())
                assert info.incremental_streaming_output is True
                assert info.max_context_length == engine.context_length
            for path in ("/model_info", "/get_model_info"):
                validate_model_info((await client.get(path)).json())
            for card in (await client.get("/v1/models")).json()["data"]:
                validate_model_card(card)


def test_sampling_params_parity() -> None:
    """The fake engine denies exactly the sampling_params keys SGLang's contract denies."""
    assert set(SAMPLING_PARAMS_FIELDS) == set(sampling_params_fields())


def test_contract_helpers_reject() -> None:
    assert generate_contract_error({"text": "x", "sampling_params": {"foo": 1}}) is not None
    assert generate_contract_error({"text": "x", "sampling_params": {"max_new_tokens": 3}}) is None
    with pytest.raises(ContractViolation):
        validate_generate_request({"text": 3})
    with pytest.raises(ContractViolation):
        validate_generate_chunk({"text": "x", "meta_info": {"id": "r", "prompt_tokens": -1}})
    with pytest.raises(ContractViolation):
        validate_generate_chunk(
            {
                "text": "x",
                "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": "x"}},
            }
        )
    with pytest.raises(ContractViolation):
        validate_generate_chunk({"error": {"message": "m", "code": "bad"}})
    with pytest.raises(ContractViolation):
        validate_generate_chunk({"text": "x"})
