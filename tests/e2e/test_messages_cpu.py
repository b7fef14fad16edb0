"""``POST /v1/messages`` end to end: the ``anthropic`` SDK → gateway → real CPU engine
(SmolLM2-135M + xgrammar).

- text, created and streamed with greedy decoding (the SDK's final message equals the created
  one), and ``count_tokens`` equal to the prompt the message's usage reports (the engine's own
  tokenizer, through a prefill with ``max_new_tokens: 0``); a ``max_tokens`` past the context is
  capped to what fits;
- a forced ``tool_use`` (``tool_choice`` ``tool``) whose ``input`` validates against the tool's
  ``input_schema``, then a round trip with its ``tool_result``;
- Claude Code's request shape: its prompt alone is longer than the model's 8192-token context,
  so it is refused with Anthropic's ``invalid_request_error`` naming ``messages``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import jsonschema
import pytest
import trio

from tests.messages_cases import claude_code_body

from .conftest import MODEL, CpuGateway

pytestmark = pytest.mark.model

TIMEOUT = 240.0
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
USER = [{"role": "user", "content": "Say hello in five words."}]


async def _in_thread(fn: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    with trio.fail_after(timeout):
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def _client(gw: CpuGateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0, timeout=TIMEOUT)


async def test_text_created_streamed_and_counted(gw: CpuGateway) -> None:
    client = _client(gw)
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 24, "messages": USER,
                              "system": "You are brief.", "extra_body": {"temperature": 0}}

    def run() -> tuple[Any, Any, Any, Any]:
        created = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        count = client.messages.count_tokens(model=MODEL, messages=USER, system="You are brief.")
        capped = client.messages.create(
            model=MODEL, max_tokens=64000, messages=USER, extra_body={"temperature": 0}
        )
        return created, final, count, capped

    try:
        created, final, count, capped = await _in_thread(run)
    finally:
        client.close()
    assert created.content[0].type == "text" and created.content[0].text
    assert [b.text for b in final.content] == [b.text for b in created.content]  # greedy
    assert final.stop_reason == created.stop_reason
    prompt = created.usage.input_tokens + (created.usage.cache_read_input_tokens or 0)
    assert count.input_tokens == prompt
    assert capped.stop_reason in ("end_turn", "max_tokens")


async def test_forced_tool_use_then_round_trip(gw: CpuGateway) -> None:
    client = _client(gw)
    question = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]

    def run() -> tuple[Any, Any]:
        called = client.messages.create(
            model=MODEL, max_tokens=128, messages=question, tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
        )  # fmt: skip
        [use] = called.content
        history = [
            *question,
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "18 degrees and sunny"}]},
        ]  # fmt: skip
        answer = client.messages.create(
            model=MODEL, max_tokens=48, messages=history, tools=[WEATHER]
        )
        return called, answer

    try:
        called, answer = await _in_thread(run)
    finally:
        client.close()
    [use] = called.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert called.stop_reason == "tool_use"
    jsonschema.Draft202012Validator(WEATHER["input_schema"]).validate(use.input)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


async def test_claude_code_prompt_is_longer_than_the_context(gw: CpuGateway) -> None:
    body = claude_code_body(MODEL)
    body["system"][2]["text"] += " Follow the instructions. " * 2000  # as long as the real one
    with trio.fail_after(TIMEOUT):
        r = await gw.client.post("/v1/messages?beta=true", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("messages: ") and "8192" in err["message"], err
