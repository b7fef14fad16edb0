"""Engine refusals end to end: a fake engine scripted to refuse the way SGLang (and the CPU
engine) does, in each of its shapes, and the gateway's checks against the limits it learned
from the engine's ``/server_info`` and ``/model_info``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from engine.fake import Call, FakeEngine, Fault, Plan, abort_finish

from .harness import MODEL, Gateway, running_gateway

INPUT_TOO_LONG = "The input (9000 tokens) is longer than the model's context length (8192 tokens)."
TOTAL_TOO_LONG = (
    "Requested token count exceeds the model's maximum context length of 8192 tokens. You "
    "requested a total of 8300 tokens: 300 tokens from the input messages and 8000 tokens for "
    "the completion. Please reduce the number of tokens in the input messages or the "
    "completion to fit within the limit."
)
GRAMMAR = "Invalid grammar request: unsupported keyword 'patternProperties'"
LOGIT_BIAS = "logit_bias must has keys in [0, 49151], got 60000."

# (id, how the engine refuses, param, code, words the message must hold)
REFUSALS: list[tuple[str, Plan, str, str, tuple[str, ...]]] = [
    ("prompt_http400", Plan([], fault=Fault.http_error(400, INPUT_TOO_LONG)), "messages",
     "context_length_exceeded", ("8192", "9000")),
    ("prompt_contract_shape", Plan([], fault=Fault.http_error(400, body=b'{"error": "'
     + INPUT_TOO_LONG.encode() + b'"}')), "messages", "context_length_exceeded", ("9000",)),
    ("total_event", Plan([], fault=Fault.error_event(0, TOTAL_TOO_LONG, 400)), "max_tokens",
     "context_length_exceeded", ("8192", "8300", "300", "8000", "at most 7892")),
    ("grammar_abort", Plan([], finish=abort_finish(GRAMMAR, 400, "BadRequestError")),
     "response_format", "invalid_request", ("JSON schema",)),
    ("logit_bias_http400", Plan([], fault=Fault.http_error(400, LOGIT_BIAS)), "logit_bias",
     "invalid_request", ("60000", "49152")),
]  # fmt: skip


def _script(plan: Plan) -> Any:
    def script(call: Call) -> Plan:
        return plan

    return script


async def _post(gw: Gateway, *, stream: bool, **body: Any) -> httpx.Response:
    with trio.fail_after(10):
        return await gw.chat(stream=stream, **body)


@pytest.mark.parametrize(
    ("plan", "param", "code", "words"), [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS]
)
async def test_engine_refusal_names_the_field(
    plan: Plan, param: str, code: str, words: tuple[str, ...]
) -> None:
    engine = FakeEngine(script=_script(plan))
    async with running_gateway(engine) as gw:
        for stream in (False, True):
            r = await _post(
                gw,
                stream=stream,
                max_tokens=50,
                response_format={"type": "json_schema", "json_schema": {"schema": {}}},
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["param"], err["code"], err["type"]) == (
                param,
                code,
                "invalid_request_error",
            ), err
            for w in words:
                assert w in err["message"], (w, err)
            # The engine's wording is never echoed.
            assert "must has keys" not in err["message"] and "Invalid grammar" not in err["message"]


async def test_completions_refusal_names_prompt() -> None:
    engine = FakeEngine(script=_script(Plan([], fault=Fault.http_error(400, INPUT_TOO_LONG))))
    async with running_gateway(engine) as gw:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 5}
        with trio.fail_after(10):
            r = await gw.client.post("/v1/completions", json=body)
        assert r.status_code == 400
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")


async def test_max_completion_tokens_is_the_field_named_when_sent() -> None:
    engine = FakeEngine(script=_script(Plan([], fault=Fault.http_error(400, TOTAL_TOO_LONG))))
    async with running_gateway(engine) as gw:
        r = await _post(gw, stream=False, max_completion_tokens=8000)
        assert r.json()["error"]["param"] == "max_completion_tokens"


async def _learned(gw: Gateway) -> None:
    with trio.fail_after(10):
        while gw.state.profiles[MODEL].context_length is None:
            await trio.sleep(0.02)


async def test_limits_learned_from_the_engine_are_checked_before_sending() -> None:
    engine = FakeEngine(context_length=4096, vocab_size=1000)
    async with running_gateway(engine) as gw:
        await _learned(gw)
        profile = gw.state.profiles[MODEL]
        assert (profile.context_length, profile.vocab_size) == (4096, 1000)
        before = len(engine.requests)

        r = await _post(gw, stream=False, max_tokens=4096)
        assert r.status_code == 400
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
        assert "4096" in err["message"]

        r = await _post(gw, stream=True, logit_bias={"1000": 5})
        assert r.status_code == 400
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("logit_bias", "invalid_request")
        assert "1000" in err["message"] and "0 to 999" in err["message"]

        gens = [p for p, _ in engine.requests[before:] if p == "/generate"]
        assert gens == []  # refused by the gateway, nothing sent

        r = await _post(gw, stream=False, max_tokens=5, logit_bias={"999": 5})
        assert r.status_code == 200, r.text
