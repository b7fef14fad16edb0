"""``POST /v1/responses`` in the core: the contract table through ``RESPONSES.prepare``, the
mapping to the chat request, and the shaper's items and events."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from sieproxy.core.errors import EngineTimeout, InternalError, RequestError
from sieproxy.core.request.profile import ModelProfile
from sieproxy.core.request.schemas import NamedToolChoice
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish
from sieproxy.surfaces import RESPONSES
from sieproxy.surfaces.responses.paths import PathMap
from sieproxy.surfaces.responses.request import decode_responses
from sieproxy.surfaces.responses.shaper import ResponsesShaper
from tests.contract_cases import PROFILES, Case, body_bytes
from tests.responses_cases import RESPONSES_CASES


def build(body: dict[str, Any] | bytes, rid: str = "r1") -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return RESPONSES.prepare(raw, PROFILES, request_id=rid, created=1700000000)


@pytest.mark.parametrize("case", RESPONSES_CASES, ids=lambda c: c.id)
def test_contract_table(case: Case) -> None:
    if case.status == 200:
        prepared = build(body_bytes(case))
        assert prepared.n == 1 and len(prepared.bodies) == 1
        return
    with pytest.raises(RequestError) as info:
        build(body_bytes(case))
    err = info.value
    assert (err.status, err.code, err.param) == (case.status, case.code, case.param), err.message
    assert err.message.endswith(".")
    if case.param != "messages":  # a chat word only where the client sent it
        assert "`messages" not in err.message and "tool_call_id" not in err.message


def test_table_ids_are_unique() -> None:
    ids = [c.id for c in RESPONSES_CASES]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------- the mapping to chat


def test_items_map_to_chat_messages_and_tool_calls() -> None:
    body = {
        "model": "test-model",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "summary": []},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather",
             "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "21C"}]},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "text"}},
        "max_output_tokens": 7,
        "lora_adapter": "my-adapter",
        "user": "u-1",
    }  # fmt: skip
    _, chat, _ = decode_responses(json.dumps(body).encode())
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "system", "user", "assistant", "tool", "tool"]
    turn = chat.messages[3]
    assert turn.tool_calls is not None and [c.id for c in turn.tool_calls] == ["c1", "c2"]
    assert [m.tool_call_id for m in chat.messages[4:]] == ["c1", "c2"]
    assert chat.max_completion_tokens == 7 and chat.n is None and chat.lora_adapter == "my-adapter"
    assert isinstance(chat.tool_choice, NamedToolChoice)
    assert chat.tool_choice.function.name == "get_weather"
    prepared = build(body)
    [engine_body] = prepared.bodies
    assert engine_body["sampling_params"]["max_new_tokens"] == 7
    assert engine_body["lora_path"] == "my-adapter" and "u-1" not in json.dumps(engine_body)


def test_a_chat_refusal_names_the_responses_path() -> None:
    paths = PathMap(messages=["instructions", "input[0]", "input[2]"], calls={(1, 0): "input[1]"})
    paths.outputs.add(2)
    assert paths.translate("messages[1].tool_calls[0].function.arguments") == "input[1].arguments"
    assert paths.translate("messages[1].tool_calls[0].id") == "input[1].call_id"
    assert paths.translate("messages[2].tool_call_id") == "input[2].call_id"
    assert paths.translate("messages[2].content") == "input[2].output"
    assert paths.translate("messages[0].content") == "instructions.content"
    assert paths.translate("max_completion_tokens") == "max_output_tokens"
    assert paths.translate("response_format.json_schema") == "text.format.schema"
    assert paths.translate("tools[3].function.name") == "tools[3].name"
    assert paths.translate("temperature") == "temperature"


# ---------------------------------------------------------------- the shaper

SHAPER_PROFILES = {
    "tools-model": ModelProfile(name="tools-model", tool_parser="hermes"),
    "think-model": ModelProfile(name="think-model", tool_parser="hermes", reasoning_parser="qwen3"),
}
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


def shaper(stream: bool, **fields: Any) -> ResponsesShaper:
    body = {"model": "tools-model", "input": "hi", "stream": stream, **fields}
    prepared = RESPONSES.prepare(
        json.dumps(body).encode(), SHAPER_PROFILES, request_id="r1", created=5
    )
    assert isinstance(prepared.shaper, ResponsesShaper)
    return prepared.shaper


def events(data: bytes) -> list[dict[str, Any]]:
    """The events of a stream; each frame's bytes must be its event's canonical encoding (key
    order and all: the text-delta frames are built from pre-encoded bytes)."""
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            head, data_line = block.split("\n")
            payload = data_line.removeprefix("data: ")
            event = json.loads(payload)
            assert head == "event: " + event["type"]
            assert msgspec.json.encode(event).decode() == payload
            out.append(event)
    return out


def run(
    tokens: list[str], reason: str = "stop", *, stream: bool, **fields: Any
) -> tuple[bytes, ResponsesShaper]:
    s = shaper(stream, **fields)
    out = s.start()
    for k, tok in enumerate(tokens, 1):
        out += s.on_delta(0, CandidateDelta(tok, k, prompt_tokens=4))
    out += s.on_finish(0, CandidateFinish(reason, None, 4, len(tokens), 1, 2))
    return out + s.end(), s


SCRIPTS = {
    "text": ["Hel", "lo", " there"],
    "text-escapes": ['"quoted"', " \\ ", "\u00e9\u4e2d", "\n\t", "\u2028"],
    "whitespace-then-call": ["\n", " ", CALL[:30], CALL[30:]],
    "text-then-call": ["Let me check.", "\n", CALL],
    "two-calls": [CALL, "\n", CALL],
    "reasoning-text": ["<think>", "pl", "an</think>", "\n\n", "ans", "wer"],
    "only-whitespace": ["\n", "  "],
    "empty": [],
}


def _model(script: str) -> str:
    return "think-model" if script.startswith("reasoning") else "tools-model"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_stream_accumulates_to_the_body(name: str) -> None:
    """The streamed events, applied in order, give the non-streamed body's items, and the
    terminal event carries that body exactly."""
    fields = {"tools": TOOLS, "include_reasoning": True, "model": _model(name)}
    body = json.loads(run(SCRIPTS[name], stream=False, **fields)[0])
    streamed = events(run(SCRIPTS[name], stream=True, **fields)[0])
    assert [e["sequence_number"] for e in streamed] == list(range(len(streamed)))
    assert streamed[-1]["type"] == "response.completed"
    assert streamed[-1]["response"] == body
    done = [e["item"] for e in streamed if e["type"] == "response.output_item.done"]
    assert done == body["output"]
    text = "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta")
    assert text == "".join(
        c["text"] for i in body["output"] if i["type"] == "message" for c in i["content"]
    )


def test_items_in_order_and_whitespace_before_a_call_is_no_message() -> None:
    kinds = {
        name: [i["type"] for i in json.loads(run(tokens, stream=False, tools=TOOLS,
                                                     include_reasoning=True,
                                                     model=_model(name))[0])["output"]]
        for name, tokens in SCRIPTS.items()
    }  # fmt: skip
    assert kinds == {
        "text": ["message"],
        "text-escapes": ["message"],
        "whitespace-then-call": ["function_call"],
        "text-then-call": ["message", "function_call"],
        "two-calls": ["function_call", "function_call"],
        "reasoning-text": ["reasoning", "message"],
        "only-whitespace": ["message"],
        "empty": [],
    }
    body = json.loads(run(SCRIPTS["two-calls"], stream=False, tools=TOOLS)[0])
    calls = body["output"]
    assert [c["id"] for c in calls] == ["fc_r1_0", "fc_r1_1"]
    assert calls[0]["call_id"] != calls[1]["call_id"]
    assert all(json.loads(c["arguments"]) == {"city": "Paris"} for c in calls)
    assert body["usage"] == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 1},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 7,
    }


def test_event_order_of_a_message() -> None:
    out, _ = run(["a", "b"], stream=True)
    assert [e["type"] for e in events(out)] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_length_cut_is_incomplete() -> None:
    out, _ = run(["a", "b"], "length", stream=True)
    evs = events(out)
    assert evs[-1]["type"] == "response.incomplete"
    final = evs[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    body = json.loads(run(["a", "b"], "length", stream=False)[0])
    assert body == final


def test_an_error_after_the_start_is_error_then_failed() -> None:
    s = shaper(True)
    out = s.start() + s.on_delta(0, CandidateDelta("a", 1))
    err = EngineTimeout("The engine produced no token in time.")
    evs = events(out + s.on_error(err))
    assert [e["type"] for e in evs[-2:]] == ["error", "response.failed"]
    assert evs[-2]["message"] == err.message and evs[-2]["code"] == err.code
    failed = evs[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["status"] == "incomplete"
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    with pytest.raises(InternalError):
        s.end()
    quiet = shaper(False)
    quiet.start()
    with pytest.raises(EngineTimeout):
        quiet.on_error(err)


def test_out_of_order_calls_raise() -> None:
    s = shaper(True)
    s.start()
    with pytest.raises(InternalError):
        s.end()  # before the choice finished
    with pytest.raises(InternalError):
        s.on_delta(1, CandidateDelta("a", 1))  # there is one choice
    with pytest.raises(InternalError):
        s.start()
