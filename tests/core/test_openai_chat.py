"""Chat as chat (``core.openai_chat``): the engine-rendered plan, its upstream request, and the
reader of ``chat.completion.chunk`` streams mapped onto the gateway's candidate events."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from sieproxy.core.errors import EngineMalformed, EngineStreamError, EngineTruncated
from sieproxy.core.request.profile import ModelProfile
from sieproxy.core.request.valid import ValidChat
from sieproxy.core.request.validate import check_chat, decode_chat
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish, ToolCallDelta
from sieproxy.core.shaping.merger import ChatCollector, ChatStream
from sieproxy.core.upstream.openai import OPENAI
from sieproxy.core.upstream.openai_chat import (
    OpenAIChatReader,
    chat_request,
    opening_key,
    plan_engine_chat,
)
from sieproxy.core.upstream.sglang import SGLANG

PROFILE = ModelProfile(
    name="m", render="engine", stop=("<|end|>",), inputs=frozenset({"text", "image"}),
    lora_names=frozenset({"sql"}),
)  # fmt: skip
PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


def valid(**body: Any) -> ValidChat:
    body.setdefault("model", "m")
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return check_chat(decode_chat(json.dumps(body).encode()), PROFILE)


def sse(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> bytes:
    one = {"index": 0, "delta": delta, "finish_reason": finish, **choice}
    return sse({"object": "chat.completion.chunk", "choices": [one]})


USAGE = sse({"choices": [], "usage": {
    "prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4},
    "completion_tokens_details": {"reasoning_tokens": 1}}})  # fmt: skip


# ---------------------------------------------------------------- the plan and the request


def test_every_field_reaches_the_engine_under_its_openai_name() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what"},
                                     {"type": "image_url", "image_url": {"url": PNG}}]},
        {"role": "assistant", "content": None, "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    v = valid(
        messages=messages, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        stop=["END"], temperature=0.5, top_p=0.9, frequency_penalty=0.1, presence_penalty=0.2,
        top_k=5, min_tokens=1, repetition_penalty=1.1, logit_bias={"7": 1.0}, seed=10, n=2,
        logprobs=True, top_logprobs=2, max_completion_tokens=30, ignore_eos=True,
        chat_template_kwargs={"enable_thinking": False}, lora_adapter="sql", user="u-1",
        include_reasoning=True, routing_key="rk",
    )  # fmt: skip
    plan = plan_engine_chat(v, PROFILE, request_id="req")
    assert plan.tool_parser is None and plan.reasoning_parser is None and plan.prompt == ""
    assert [b["rid"] for b in plan.bodies] == ["req-0", "req-1"]
    path, body = chat_request(plan.bodies[1], "m")
    assert path == "/v1/chat/completions"
    assert body == {
        "model": "sql",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what"},
                                         {"type": "image_url", "image_url": {"url": PNG}}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "max_tokens": 30,
        "tools": [WEATHER],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "response_format": {"type": "json_schema",
                            "json_schema": {"schema": {"type": "object"}, "name": "response"}},
        "chat_template_kwargs": {"enable_thinking": False},
        "stop": ["END", "<|end|>"],
        "temperature": 0.5, "top_p": 0.9, "frequency_penalty": 0.1, "presence_penalty": 0.2,
        "top_k": 5, "min_tokens": 1, "repetition_penalty": 1.1, "logit_bias": {"7": 1.0},
        "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
        "seed": 11,
        "n": 1, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    for private in ("user", "routing_key", "include_reasoning", "rid"):
        assert private not in body


def test_minimal_request_and_best_of_asks_for_logprobs_only_to_rank() -> None:
    _, body = chat_request(plan_engine_chat(valid(), PROFILE, request_id="r").bodies[0], "m")
    assert body == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1024,
        "stop": ["<|end|>"], "n": 1, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    plan = plan_engine_chat(valid(best_of=3), PROFILE, request_id="r")
    assert len(plan.bodies) == 3
    assert all(b["chat"]["logprobs"] is True and b["chat"]["top_logprobs"] == 0
               for b in plan.bodies)  # fmt: skip


def test_the_openai_protocol_sends_a_planned_chat_to_chat_completions() -> None:
    plan = plan_engine_chat(valid(), PROFILE, request_id="r")
    path, _ = OPENAI.request(plan.bodies[0], "chat", "m")
    assert path == "/v1/chat/completions"
    assert isinstance(OPENAI.reader(incremental=False, max_line=1024, body=plan.bodies[0]),
                      OpenAIChatReader)  # fmt: skip
    assert not isinstance(OPENAI.reader(incremental=False, max_line=1024), OpenAIChatReader)
    assert SGLANG.reader(incremental=False, max_line=1024, body=plan.bodies[0]) is not None


def test_the_prefix_key_is_the_conversations_opening() -> None:
    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]
    longer = [*first, {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]
    assert opening_key(first, None) == opening_key(longer, None)
    assert opening_key(first, None) != opening_key(first, [WEATHER])
    other = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q9"}]
    assert opening_key(first, None) != opening_key(other, None)
    a = plan_engine_chat(valid(messages=first), PROFILE, request_id="a").prefix_key
    b = plan_engine_chat(valid(messages=longer), PROFILE, request_id="b").prefix_key
    assert a == b and a is not None and a.startswith("prefix:")


# ---------------------------------------------------------------- the reader


def read(*parts: bytes) -> tuple[list[Any], Any]:
    r = OpenAIChatReader()
    events, err = r.feed(b"".join(parts))
    return events, err


def test_content_reasoning_tool_calls_and_the_finish_with_usage() -> None:
    events, err = read(
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "think"}),
        chunk({"reasoning": " more"}),  # vLLM's newer name
        chunk({"content": "Hi"}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": "{\"a\""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        chunk({}, "tool_calls"),
        USAGE,
        sse(b"[DONE]"),
    )  # fmt: skip
    assert err is None
    deltas = [e for e in events if isinstance(e, CandidateDelta)]
    assert [(d.text, d.reasoning) for d in deltas] == [
        ("", "think"),
        ("", " more"),
        ("Hi", ""),
        ("", ""),
        ("", ""),
    ]
    assert deltas[3].tool_calls == [ToolCallDelta(0, "call_1", "f", '{"a"')]
    assert deltas[4].tool_calls == [ToolCallDelta(0, None, None, ": 1}")]
    assert [d.completion_tokens for d in deltas] == [1, 2, 3, 4, 5]
    assert events[-1] == CandidateFinish(
        "tool_calls", prompt_tokens=7, completion_tokens=3, cached_tokens=4, reasoning_tokens=1
    )


def test_logprobs_count_the_tokens_and_done_without_usage_finishes() -> None:
    lp = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97],
                       "top_logprobs": [{"token": "a", "logprob": -0.5}, {"token": "b",
                                                                        "logprob": None}]},
                      {"token": "b", "logprob": -1.0, "top_logprobs": []}]}  # fmt: skip
    events, err = read(chunk({"content": "ab"}, logprobs=lp), chunk({}, "length"), sse(b"[DONE]"))
    assert err is None
    (delta, finish) = events
    assert [(t.token, t.logprob) for t in delta.logprobs] == [("a", -0.5), ("b", -1.0)]
    assert [(t.token, t.logprob) for t in delta.logprobs[0].top] == [("a", -0.5), ("b", -9999.0)]
    assert finish == CandidateFinish("length", prompt_tokens=0, completion_tokens=2)


@pytest.mark.parametrize(
    ("parts", "error"),
    [
        ((chunk({"content": "a"}), sse(b"[DONE]")), EngineTruncated),
        ((sse(b"{not json"),), EngineMalformed),
        ((chunk({}, "stop"), chunk({"content": "late"})), EngineMalformed),
        ((sse({"error": {"message": "boom", "code": "500"}}),), EngineStreamError),
    ],
    ids=["done-before-finish", "not-json", "output-after-finish", "error-object"],
)
def test_a_broken_stream_is_an_error(parts: tuple[bytes, ...], error: type[Exception]) -> None:
    _, err = read(*parts)
    assert isinstance(err, error)


def test_eof_before_the_finish_is_truncated() -> None:
    r = OpenAIChatReader()
    r.feed(chunk({"content": "a"}))
    with pytest.raises(EngineTruncated):
        r.eof()
    r = OpenAIChatReader()
    r.feed(chunk({"content": "a"}, "stop") + USAGE)
    assert r.finished
    r.eof()
    assert r.local_finish("abort").completion_tokens == 3


# ---------------------------------------------------------------- the engine's parsed output


def _deltas() -> list[CandidateDelta]:
    return [
        CandidateDelta("", 1, reasoning="private"),
        CandidateDelta("Hello", 2),
        CandidateDelta("", 3, tool_calls=[ToolCallDelta(0, "call_9", "f", "{}")]),
    ]


@pytest.mark.parametrize("include_reasoning", [False, True])
def test_parsed_output_is_shaped_by_the_gateways_rules(include_reasoning: bool) -> None:
    v = valid(include_reasoning=include_reasoning, stream=True, tools=[WEATHER])
    stream = ChatStream(v, response_id="c", model="m", created=1)
    out = bytearray(stream.start())
    for d in _deltas():
        out += stream.on_delta(0, d)
    out += stream.on_finish(0, CandidateFinish("tool_calls", completion_tokens=3))
    out += stream.end()
    events = [json.loads(x[6:]) for x in bytes(out).decode().split("\n\n") if x[6:] != "[DONE]"
              and x]  # fmt: skip
    deltas = [e["choices"][0]["delta"] for e in events]
    assert ({"reasoning_content": "private"} in deltas) is include_reasoning
    assert {"content": "Hello"} in deltas
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls == [[{"index": 0, "id": "call_9", "type": "function",
                       "function": {"name": "f", "arguments": "{}"}}]]  # fmt: skip
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

    collector = ChatCollector(valid(include_reasoning=include_reasoning, tools=[WEATHER]),
                              response_id="c", model="m", created=1)  # fmt: skip
    for d in _deltas():
        collector.on_delta(0, d)
    collector.on_finish(0, CandidateFinish("tool_calls", completion_tokens=3))
    (choice,) = msgspec.json.decode(collector.result())["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["id"] == "call_9"
    assert choice["message"].get("reasoning_content") == ("private" if include_reasoning else None)
