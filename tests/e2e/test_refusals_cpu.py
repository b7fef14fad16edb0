"""The CPU engine's real refusals, as a client sees them through the gateway."""

from __future__ import annotations

import pytest
import trio

from .conftest import MODEL, CpuGateway

pytestmark = pytest.mark.model


async def test_prompt_over_the_context_names_messages_with_the_numbers(gw: CpuGateway) -> None:
    ctx = (await gw.client.get(gw.engine.url + "/server_info")).json()["context_length"]
    long_text = "hello " * (ctx + 200)
    with trio.fail_after(120):
        r = await gw.client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": long_text}]},
        )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded"), err
    assert str(ctx) in err["message"]

    # A prompt that fits, with a completion cap that does not: the cap is the field to change.
    with trio.fail_after(120):
        r = await gw.client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": ctx - 2},
        )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded"), err
    assert str(ctx) in err["message"] and f"{ctx - 2} for the completion" in err["message"]


async def test_logit_bias_outside_the_vocabulary_names_logit_bias(gw: CpuGateway) -> None:
    vocab = (await gw.client.get(gw.engine.url + "/model_info")).json()["vocab_size"]
    with trio.fail_after(60):
        r = await gw.client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "logit_bias": {str(vocab + 5): 1},
            },
        )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and str(vocab + 5) in err["message"], err
