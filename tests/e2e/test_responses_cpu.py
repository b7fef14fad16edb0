"""``POST /v1/responses`` end to end: the ``openai`` SDK → gateway → real CPU engine
(SmolLM2-135M + xgrammar).

- ``text.format`` ``json_schema``: the answer is JSON valid against the schema, created and
  streamed (``client.responses.stream`` accumulates the events into the final response);
- a forced function call (named ``tool_choice``) whose arguments validate against the tool's
  ``parameters``;
- a tool round trip: the call and a ``function_call_output`` fed back as input items give a
  text answer;
- plain text, created and streamed (sync and async clients).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import jsonschema
import openai
import pytest
import trio

from .conftest import MODEL, CpuGateway

pytestmark = pytest.mark.model

TIMEOUT = 240.0
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


async def _in_thread(fn: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    with trio.fail_after(timeout):
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def _client(gw: CpuGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def _validate(instance: Any, schema: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(schema).validate(instance)


async def test_json_schema_created_and_streamed(gw: CpuGateway) -> None:
    client = _client(gw)
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "instructions": "You answer with JSON only.",
        "input": "Describe a person called Ada who is 36 years old.",
        "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                            "strict": True}},
        "max_output_tokens": 96,
        "temperature": 0,
    }  # fmt: skip

    def run() -> tuple[Any, Any, list[str]]:
        created = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            types = [e.type for e in stream]
            final = stream.get_final_response()
        return created, final, types

    try:
        created, final, types = await _in_thread(run)
    finally:
        client.close()
    for response in (created, final):
        assert response.status == "completed", response
        _validate(json.loads(response.output_text), PERSON)
    assert types[0] == "response.created" and types[-1] == "response.completed"
    # Greedy decoding: the stream accumulates to the same answer as the created response.
    assert final.output_text == created.output_text


async def test_forced_function_call_then_round_trip(gw: CpuGateway) -> None:
    client = _client(gw)
    question = "What is the weather in Paris, in celsius?"

    def run() -> tuple[Any, Any]:
        called = client.responses.create(
            model=MODEL,
            input=question,
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=128,
            temperature=0,
        )
        calls = [item for item in called.output if item.type == "function_call"]
        replay = [item.model_dump(exclude_none=True) for item in called.output]
        answer = client.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": question},
                *replay,
                *[
                    {"type": "function_call_output", "call_id": c.call_id,
                     "output": json.dumps({"temperature": 18, "sky": "sunny"})}
                    for c in calls
                ],
            ],
            tools=[WEATHER],
            max_output_tokens=64,
            temperature=0,
        )  # fmt: skip
        return called, answer

    try:
        called, answer = await _in_thread(run)
    finally:
        client.close()
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls, called.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        _validate(json.loads(call.arguments), WEATHER["parameters"])
    assert called.status == "completed"
    # The model's answer after the tool output: text, or another call, but a finished response.
    assert answer.status in ("completed", "incomplete"), answer
    assert answer.output and answer.usage is not None and answer.usage.input_tokens > 0


async def test_text_created_and_streamed_async(gw: CpuGateway) -> None:
    url = gw.url

    async def run() -> tuple[Any, Any]:
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT
        )
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "input": "Name three colours.",
            "max_output_tokens": 300,
            "temperature": 0,
        }
        created = await client.responses.create(**kwargs)
        async with client.responses.stream(**kwargs) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_response()
        await client.close()
        return created, final

    created, final = await _in_thread(lambda: asyncio.run(run()))
    assert created.status == "completed" and created.output_text.strip()
    assert final.output_text == created.output_text
    assert final.usage is not None and created.usage is not None
    assert final.usage.output_tokens == created.usage.output_tokens
