"""An engine's refusal keeps its meaning (``core.refusal.classify_error``), and which engine
statuses count toward the breaker is one table (``core.upstream_status``): an OpenAI error
envelope's code reaches the client as that code with the gateway's own words, and a 4xx never
opens the breaker."""

from __future__ import annotations

import json

import pytest
import trio

from engine.fake import FakeEngine, Fault, Plan
from sieproxy.core.request.refusal import RequestFields, classify_error, explain
from sieproxy.core.upstream.status import breaker_counts

from .harness import MODEL, running_gateway

SECRET = "SECRET-ENGINE-TEXT"


def _envelope(code: str, kind: str = "invalid_request_error") -> bytes:
    return json.dumps(
        {"error": {"message": SECRET, "type": kind, "param": None, "code": code}}
    ).encode()


@pytest.mark.parametrize(
    ("status", "body", "code", "param", "words"),
    [
        (400, _envelope("context_length_exceeded"), "context_length_exceeded", "messages",
         "exceed this model's maximum context length"),
        (400, _envelope("content_filter"), "content_policy_violation", "messages",
         "content policy refused"),
        (422, _envelope("content_policy_violation"), "content_policy_violation", "messages",
         "content policy refused"),
        (404, _envelope("model_not_found"), "upstream_error", None, "HTTP 404"),
    ],
    ids=["context-length", "content-filter", "content-policy-422", "engine-404"],
)  # fmt: skip
@pytest.mark.parametrize("protocol", ["openai-chat", "openai", "sglang"])
async def test_the_engines_error_code_reaches_the_client(
    protocol: str, status: int, body: bytes, code: str, param: str | None, words: str
) -> None:
    plan = Plan(["x"], fault=Fault.http_error(status, body=body))
    engine = FakeEngine(lambda call: plan)
    async with running_gateway(engine, protocol=protocol, breaker_failures=2) as gw:
        for _ in range(4):  # more than breaker_failures: a 4xx must not open it
            with trio.fail_after(20):
                r = await gw.chat(max_tokens=2)
            err = r.json()["error"]
            assert (r.status_code, err["code"], err["param"]) == (
                502 if status == 404 else 400, code, param
            ), r.text
            assert words in err["message"] and SECRET not in r.text
        replica = gw.state.pools[MODEL].replicas[0]
        assert replica.failures == 0 and replica.out_until == 0.0


def test_the_status_table() -> None:
    assert not breaker_counts(404, 502) and not breaker_counts(400, 400)
    assert not breaker_counts(429, 503)
    assert breaker_counts(503, 503) and breaker_counts(500, 502)
    assert breaker_counts(None, 502) and not breaker_counts(None, 400)


def test_text_wins_over_the_code_and_unknown_codes_stay_generic() -> None:
    f = RequestFields(prompt="prompt", max_tokens="max_tokens")
    text = {"error": {"message": "The input (9000 tokens) is longer than the model's context "
                      "length (8192 tokens)", "code": "content_filter"}}  # fmt: skip
    assert classify_error(text).kind == "prompt_too_long"
    assert classify_error({"object": "error", "message": "?", "code": "weird"}).kind == "other"
    err = explain(classify_error({"error": {"code": "context_length_exceeded"}}), f)
    assert err.code == "context_length_exceeded" and err.param == "prompt"
    assert "`max_tokens`" in err.message
