"""``POST /v1/messages`` in the core: the contract table through ``MESSAGES.prepare``, the
mapping to the chat request, the shaper's blocks and events, the error envelope, aliases and
``count_tokens``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sieproxy.core.errors import (
    AuthenticationError,
    EngineTimeout,
    NotFound,
    RequestError,
    ServiceUnavailable,
)
from sieproxy.core.planning.prepared import find_profile
from sieproxy.core.request.aliases import alias_conflict, resolve_alias
from sieproxy.core.request.profile import ModelProfile
from sieproxy.core.request.schemas import NamedToolChoice
from sieproxy.core.shaping.events import CandidateDelta, CandidateFinish
from sieproxy.surfaces import COUNT_TOKENS, MESSAGES
from sieproxy.surfaces.messages.count import CountShaper
from sieproxy.surfaces.messages.errors import error_reply
from sieproxy.surfaces.messages.paths import PathMap
from sieproxy.surfaces.messages.request import decode_messages
from sieproxy.surfaces.messages.shaper import MessagesShaper
from tests.contract_cases import PROFILES, Case, body_bytes
from tests.messages_cases import MESSAGES_CASES, claude_code_body


def build(body: dict[str, Any] | bytes, profiles: Any = PROFILES, rid: str = "r1") -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return MESSAGES.prepare(raw, profiles, request_id=rid, created=1700000000)


@pytest.mark.parametrize("case", MESSAGES_CASES, ids=lambda c: c.id)
def test_contract_table(case: Case) -> None:
    if case.status == 200:
        prepared = build(body_bytes(case))
        assert prepared.n == 1 and len(prepared.bodies) == 1
        assert isinstance(prepared.shaper, MessagesShaper)
        return
    with pytest.raises(RequestError) as info:
        build(body_bytes(case))
    err = info.value
    assert (err.status, err.code, err.param) == (case.status, case.code, case.param), err.message
    assert err.message.endswith(".")
    # a chat word only where the client could have sent it
    for word in ("max_completion_tokens", "tool_call_id", "response_format", "`stop`"):
        assert word not in err.message, err.message


def test_table_ids_are_unique() -> None:
    ids = [c.id for c in MESSAGES_CASES]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------- the mapping to chat


def test_blocks_map_to_chat_messages_and_tool_calls() -> None:
    body = claude_code_body("test-model", follow_up=True)
    _, chat, paths = decode_messages(json.dumps(body).encode())
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "system", "assistant", "tool"]
    system = chat.messages[0].content
    assert isinstance(system, str) and system.startswith("You are Claude Code")
    assert "billing" not in system  # Claude Code's billing line is no instruction
    turn = chat.messages[3]
    assert turn.content == "Let me check."  # the thinking block is dropped
    assert turn.tool_calls is not None
    [call] = turn.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "toolu_01A", "Bash", {"command": "ls"}
    )  # fmt: skip
    assert chat.messages[4].tool_call_id == "toolu_01A" and chat.messages[4].content == "README.md"
    assert chat.tools is not None and len(chat.tools) == 24
    assert chat.max_completion_tokens == 32000 and chat.stream is True
    assert paths.messages == [
        "system", "messages[0]", "messages[1]", "messages[2]", "messages[3].content[0]"
    ]  # fmt: skip


def test_tool_results_come_first_and_is_error_is_said() -> None:
    body = {
        "model": "test-model",
        "max_tokens": 5,
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "a", "name": "f", "input": {}},
                {"type": "tool_use", "id": "b", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "here"},
                {"type": "tool_result", "tool_use_id": "a", "content": "one"},
                {"type": "tool_result", "tool_use_id": "b", "is_error": True,
                 "content": [{"type": "text", "text": "boom"}]}]},
        ],
    }  # fmt: skip
    _, chat, _ = decode_messages(json.dumps(body).encode())
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "tool", "user"]
    assert [m.content for m in chat.messages[2:4]] == ["one", "Error: boom"]
    assert isinstance(chat.tool_choice, NamedToolChoice)
    assert chat.parallel_tool_calls is False and chat.stop == ["END"]


def test_a_chat_refusal_names_the_messages_path() -> None:
    paths = PathMap(
        messages=["system", "messages[0]", "messages[1]", "messages[2].content[0]"],
        parts={(1, 0): "messages[0].content[1]"},
        calls={(2, 0): "messages[1].content[2]"},
        results={3},
    )
    assert paths.translate("messages[1].content[0].image_url") == "messages[0].content[1].source"
    assert paths.translate("messages[2].tool_calls[0].function.arguments") == (
        "messages[1].content[2].input"
    )
    assert paths.translate("messages[3].tool_call_id") == "messages[2].content[0].tool_use_id"
    assert paths.translate("messages[2]") == "messages[1]"
    assert paths.translate("max_completion_tokens") == "max_tokens"
    assert paths.translate("stop[3]") == "stop_sequences[3]"
    assert paths.translate("tools[2].function.parameters") == "tools[2].input_schema"
    assert paths.translate("tools[2].function.name") == "tools[2].name"
    assert paths.translate("response_format") == "output_config.format"
    assert paths.translate("temperature") == "temperature"


THINK = ModelProfile(name="think", tool_parser="hermes", reasoning_parser="qwen3",
                     context_length=8192)  # fmt: skip
PLAIN = ModelProfile(name="plain", context_length=8192)
TOOLS_ONLY = ModelProfile(name="tools", tool_parser="hermes")
MODELS = {"think": THINK, "plain": PLAIN, "tools": TOOLS_ONLY}


def test_thinking_maps_onto_the_reasoning_parser_only() -> None:
    body = {"model": "think", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for thinking, on in (({"type": "enabled", "budget_tokens": 2048}, True),
                         ({"type": "adaptive"}, True), ({"type": "disabled"}, False)):  # fmt: skip
        prepared = build({**body, "thinking": thinking}, MODELS)
        assert prepared.shaper.choices[0].include_reasoning is on
        assert ("<think>" in prepared.bodies[0]["text"]) is False  # the fallback renderer
    prepared = build(body, MODELS)  # absent: the reasoning stays hidden
    assert prepared.shaper.choices[0].include_reasoning is False
    prepared = build({**body, "model": "plain", "thinking": {"type": "adaptive"}}, MODELS)
    assert prepared.shaper.choices[0].include_reasoning is False  # no parser: no effect


def test_max_tokens_beyond_the_context_is_capped_to_what_fits() -> None:
    body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}]}
    assert build({**body, "max_tokens": 32000}, MODELS).bodies[0]["sampling_params"][
        "max_new_tokens"] is None  # fmt: skip
    assert build({**body, "max_tokens": 8191}, MODELS).bodies[0]["sampling_params"][
        "max_new_tokens"] == 8191  # fmt: skip
    unknown = {"plain": ModelProfile(name="plain")}  # context not learned yet: sent as is
    assert build({**body, "max_tokens": 32000}, unknown).bodies[0]["sampling_params"][
        "max_new_tokens"] == 32000  # fmt: skip


def test_claude_code_turns_keep_their_prefix_key() -> None:
    first = build(claude_code_body("test-model"))
    second = build(claude_code_body("test-model", follow_up=True))
    assert first.prefix_key is not None and first.prefix_key == second.prefix_key
    # Another conversation's billing line differs: the rendered prompt does not.
    other = claude_code_body("test-model")
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.197.c40;"
    assert build(other).bodies[0]["text"] == first.bodies[0]["text"]
    only = {**other, "system": other["system"][:1]}
    assert "<|system|>" not in build(only).bodies[0]["text"].partition("<|user|>")[0]
    assert first.bodies[0]["sampling_params"]["max_new_tokens"] == 32000  # context unknown
    assert "user_0a1b" not in json.dumps(first.bodies[0])  # metadata is never forwarded


# ---------------------------------------------------------------- aliases


def test_aliases_exact_then_patterns_in_order() -> None:
    a = ModelProfile(name="a", aliases=("claude-opus-4-8", "claude-*"))
    b = ModelProfile(name="b", aliases=("claude-haiku-*", "gpt-4o"))
    profiles = {"a": a, "b": b}
    assert resolve_alias(profiles, "claude-opus-4-8") is a
    assert resolve_alias(profiles, "gpt-4o") is b
    assert resolve_alias(profiles, "claude-haiku-4-5") is a  # a's pattern comes first
    assert resolve_alias(profiles, "Claude-x") is None  # case-sensitive
    assert find_profile(profiles, "b") is b
    with pytest.raises(NotFound):
        find_profile(profiles, "gpt-5")
    prepared = build({"model": "claude-sonnet-5", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hi"}]}, profiles)  # fmt: skip
    assert prepared.model == "a"  # the served name from here on


def test_alias_conflicts() -> None:
    assert alias_conflict({"a": ["x", "claude-*"], "b": ["y"]}) is None
    assert alias_conflict({"a": ["b"], "b": []}) == (
        "a", 0, "'b' is the name of a served model"
    )  # fmt: skip
    assert alias_conflict({"a": ["x"], "b": ["x"]}) == (
        "b", 0, "'x' is already an alias of model 'a'"
    )  # fmt: skip
    clash = alias_conflict({"claude-1": [], "b": ["claude-*"]})
    assert clash is not None and clash[:2] == ("b", 0) and "matches" in clash[2]
    assert alias_conflict({"a": [""]}) is not None


# ---------------------------------------------------------------- the shaper

CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]


def shaper(stream: bool, model: str = "plain", **fields: Any) -> MessagesShaper:
    body = {"model": model, "max_tokens": 50, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}], **fields}  # fmt: skip
    prepared = build(body, MODELS)
    assert isinstance(prepared.shaper, MessagesShaper)
    return prepared.shaper


def events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        head, _, line = block.partition("\n")
        assert head.startswith("event: ") and line.startswith("data: "), block
        event = json.loads(line[6:])
        assert event["type"] == head[7:]
        out.append(event)
    return out


def run(s: MessagesShaper, pieces: list[str], reason: str = "stop", **fin: Any) -> bytes:
    out = s.start()
    for k, text in enumerate(pieces):
        out += s.on_delta(0, CandidateDelta(text, k + 1, prompt_tokens=12))
    finish = {"prompt_tokens": 12, "completion_tokens": len(pieces), "cached_tokens": 5, **fin}
    out += s.on_finish(0, CandidateFinish(reason, **finish))
    return out + s.end()


def accumulate(evs: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed message put together as a client does."""
    message = dict(evs[0]["message"])
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for e in evs[1:]:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            else:
                partial[e["index"]] = partial.get(e["index"], "") + d["partial_json"]
        elif e["type"] == "message_delta":
            message.update(e["delta"])
            message["usage"] = e["usage"]
    for i, text in partial.items():
        blocks[i]["input"] = json.loads(text)
    message["content"] = blocks
    return message


@pytest.mark.parametrize(
    "pieces",
    [
        ["<think>pl", "an</think>", "\n", "Hello", " there"],
        ["Hi. ", CALL[:30], CALL[30:]],
        ["\n", CALL, "\n", CALL.replace("Paris", "Rome")],
        [" "],
    ],
)
def test_stream_accumulates_to_the_body(pieces: list[str]) -> None:
    thinking = {"type": "enabled", "budget_tokens": 1024}
    whole = json.loads(run(shaper(False, "think", tools=TOOLS, thinking=thinking), pieces))
    evs = events(run(shaper(True, "think", tools=TOOLS, thinking=thinking), pieces))
    types = [e["type"] for e in evs]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta",
                                                                     "message_stop"]
    assert evs[0]["message"]["usage"]["input_tokens"] == 12
    assert accumulate(evs) == whole
    assert whole["usage"] == {"input_tokens": 7, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 5, "output_tokens": len(pieces)}


def test_blocks_and_stop_reasons() -> None:
    body = json.loads(run(shaper(False, "tools", tools=TOOLS), ["Checking.", " ", CALL]))
    assert [b["type"] for b in body["content"]] == ["text", "tool_use"]
    use = body["content"][1]
    assert use["id"].startswith("toolu_") and use["input"] == {"city": "Paris"}
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    body = json.loads(run(shaper(False), ["a", "b"], "length"))
    assert body["stop_reason"] == "max_tokens"
    body = json.loads(run(shaper(False), ["a", "b"]))
    assert body["stop_reason"] == "end_turn"
    # a stop sequence the gateway matched, and one the engine matched
    body = json.loads(run(shaper(False, stop_sequences=["END"]), ["a E", "ND b"]))
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    assert body["content"] == [{"type": "text", "text": "a "}]
    body = json.loads(run(shaper(False, stop_sequences=["END"]), ["a"], matched="END"))
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    body = json.loads(run(shaper(False), ["a"], matched="<|im_end|>"))
    assert body["stop_reason"] == "end_turn"


def test_tool_arguments_stream_as_input_json_deltas() -> None:
    evs = events(run(shaper(True, "tools", tools=TOOLS), [CALL[:50], CALL[50:56], CALL[56:]]))
    start = next(e for e in evs if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    parts = [e["delta"]["partial_json"] for e in evs if e["type"] == "content_block_delta"]
    assert len(parts) >= 2 and json.loads("".join(parts)) == {"city": "Paris"}


def test_keep_alive_pings_before_and_after_the_first_output() -> None:
    s = shaper(True)
    assert s.pings
    out = s.start() + s.ping()  # the engine is slow to its first token: message_start now
    assert [e["type"] for e in events(out)] == ["message_start", "ping"]
    assert events(out)[0]["message"]["usage"]["input_tokens"] == 0  # not known yet
    out += s.ping() + s.on_delta(0, CandidateDelta("Hi", 1, prompt_tokens=3))
    finish = CandidateFinish("stop", prompt_tokens=3, completion_tokens=1)
    out += s.ping() + s.on_finish(0, finish) + s.end()
    types = [e["type"] for e in events(out)]
    assert types == ["message_start", "ping", "ping", "content_block_start",
                     "content_block_delta", "ping", "content_block_stop", "message_delta",
                     "message_stop"]  # fmt: skip
    assert types.count("message_start") == 1
    assert events(out)[-2]["usage"]["input_tokens"] == 3  # the final usage has the count
    assert s.ping() == b""  # the stream has ended
    quiet = shaper(False)
    assert not quiet.pings and quiet.ping() == b""


def test_an_error_after_the_start_is_an_error_event() -> None:
    s = shaper(True)
    out = s.start() + s.on_delta(0, CandidateDelta("Hel", 1, prompt_tokens=3))
    out += s.on_error(EngineTimeout("No token arrived in time."))
    evs = events(out)
    assert [e["type"] for e in evs][-1] == "error"
    assert evs[-1]["error"] == {"type": "timeout_error", "message": "No token arrived in time."}
    s = shaper(False)
    s.start()
    with pytest.raises(EngineTimeout):
        s.on_error(EngineTimeout("x"))


def test_error_envelope() -> None:
    status, headers, body = error_reply(RequestError("`x` is bad.", param="messages[0].role"))
    assert status == 400 and json.loads(body) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "messages[0].role: `x` is bad."},
    }
    status, headers, body = error_reply(ServiceUnavailable("busy", retry_after=3))
    assert (status, headers["Retry-After"]) == (503, "3")
    assert json.loads(body)["error"]["type"] == "overloaded_error"
    assert json.loads(error_reply(AuthenticationError())[2])["error"]["type"] == (
        "authentication_error"
    )
    assert json.loads(error_reply(NotFound("no"))[2])["error"]["type"] == "not_found_error"


def test_count_tokens_prefills_the_same_prompt() -> None:
    body = claude_code_body("test-model", follow_up=True)
    gen = build(body)
    for key in ("max_tokens", "stream", "metadata"):
        del body[key]
    count = COUNT_TOKENS.prepare(json.dumps(body).encode(), PROFILES, request_id="c", created=0)
    assert count.bodies[0]["text"] == gen.bodies[0]["text"]
    assert count.bodies[0]["sampling_params"] == {"max_new_tokens": 0}
    s = count.shaper
    assert isinstance(s, CountShaper)
    s.on_delta(0, CandidateDelta("", 0, prompt_tokens=40))
    s.on_finish(0, CandidateFinish("length", prompt_tokens=40))
    assert json.loads(s.end()) == {"input_tokens": 40}
    with pytest.raises(RequestError) as info:
        COUNT_TOKENS.prepare(json.dumps({**body, "max_tokens": 5}).encode(), PROFILES,
                           request_id="c", created=0)  # fmt: skip
    assert info.value.param == "max_tokens"
