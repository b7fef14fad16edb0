"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` through a real gateway in front of
scripted fake engines.

The contract table (tests/messages_cases.py) over HTTP and through the official ``anthropic``
SDK; the SDK's ``messages.create`` and ``messages.stream`` (text, the accumulated final message,
tool arguments reassembled from their deltas), a tool round trip with ``tool_result``,
``tool_choice`` ``any`` and ``tool`` (the grammar reaches the engine), ``count_tokens``, an image
block, its typed errors (a bad field, a bad key, an unknown model); the headers Claude Code
sends, ``x-api-key``, aliases; the event order; an error after the 200 (an ``error`` event);
an engine failing before any output (the status line, Anthropic's envelope); and a client that
leaves a stream (its generation is aborted upstream). Every socket test is guarded by
``trio.fail_after``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anthropic
import httpx
import pytest
import trio

from engine.fake import Call, DefaultScript, FakeEngine, Fault, Plan
from sieproxy.settings.load import Settings
from tests.contract_cases import PNG_B64, Case, body_bytes
from tests.messages_cases import MESSAGES_CASES, claude_code_body

from .harness import MODEL, Gateway, running_gateway
from .test_contract_http import LEAKS, _add_text_model
from .test_faults import aborted_once, faulty, settled, still_serves

T = TypeVar("T")
PATH = "/v1/messages"
LIMIT = 30  # seconds per test
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL_JSON = '{"name":"get_weather","arguments":{"city":"Paris"}}'
TOOL_TOKENS = ["\n", "<tool", "_call>", CALL_JSON[:20], CALL_JSON[20:44], CALL_JSON[44:],
               "</tool_", "call>"]  # fmt: skip
#: What a model writes under a forced tool_choice: the JSON-array grammar's shape.
ARRAY_TOKENS = ['[{"name": "get_weather", ', '"arguments": {"ci', 'ty": "Par', 'is"}}]']
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _tool_script(call: Call) -> Plan:
    """Hermes tags when the call is free, the JSON array when the grammar forces it."""
    forced = "json_schema" in call.body.get("sampling_params", {})
    return Plan(tokens=ARRAY_TOKENS if forced else TOOL_TOKENS)


def _fixed(tokens: Sequence[str], **plan: Any) -> Callable[[Call], Plan]:
    return lambda call: Plan(tokens=list(tokens), **plan)


def _hermes(s: Settings) -> None:
    s.models[MODEL].tool_parser = "hermes"


def events_of(text: str) -> list[dict[str, Any]]:
    """A Messages SSE body as its events; checks each frame's ``event:`` line names its type."""
    out: list[dict[str, Any]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        head, _, data = block.partition("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: ") :])
        assert event["type"] == head[len("event: ") :], block
        out.append(event)
    return out


def check_sequence(events: list[dict[str, Any]]) -> list[str]:
    """Problems with the event order of one streamed message (empty: none)."""
    types = [e["type"] for e in events]
    problems: list[str] = []
    if types[:2] != ["message_start", "ping"]:
        problems.append(f"starts with {types[:2]}")
    if types[-1:] == ["error"]:
        return problems
    if types[-2:] != ["message_delta", "message_stop"]:
        problems.append(f"ends with {types[-2:]}")
    open_block: int | None = None
    seen = 0
    for e in events[2:-2]:
        if e["type"] == "ping":  # a keep-alive may come anywhere (gateway.messages_ping_interval)
            continue
        if e["type"] == "content_block_start":
            if open_block is not None or e["index"] != seen:
                problems.append(f"block {e['index']} started out of order")
            open_block = e["index"]
        elif e["type"] == "content_block_stop":
            if e["index"] != open_block:
                problems.append(f"block {e['index']} stopped but not open")
            open_block, seen = None, seen + 1
        elif e["type"] == "content_block_delta":
            if e["index"] != open_block:
                problems.append(f"delta for block {e['index']}, which is not open")
        else:
            problems.append(f"unexpected {e['type']}")
    if open_block is not None:
        problems.append(f"block {open_block} never stopped")
    return problems


async def _post(
    gw: Gateway,
    body: dict[str, Any] | bytes,
    rid: str | None = None,
    path: str = PATH,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **(headers or {})}
    if rid is not None:
        sent["X-Request-Id"] = rid
    return await gw.client.post(path, content=raw, headers=sent)


async def _sync(fn: Callable[[], T], timeout: float = LIMIT) -> T:
    with trio.fail_after(timeout):
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def _client(gw: Gateway, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=20)


def _generates(engine: FakeEngine) -> list[dict[str, Any]]:
    return [b for p, b in engine.requests if p == "/generate"]


def _check_error(status: int, body: Any, want_status: int, want_type: str) -> list[str]:
    problems: list[str] = []
    if status != want_status:
        problems.append(f"status {status} != {want_status}")
    if not isinstance(body, dict) or set(body) != {"type", "error"} or body["type"] != "error":
        return [*problems, f"not Anthropic's envelope: {body!r:.200}"]
    err = body["error"]
    if set(err) != {"type", "message"} or err["type"] != want_type:
        problems.append(f"error {err!r:.200}, want type {want_type}")
    elif LEAKS.search(err["message"]):
        problems.append(f"message leaks internals: {err['message']!r}")
    return problems


# ---------------------------------------------------------------- the contract table


def _check_accepted(case: Case, resp: httpx.Response) -> list[str]:
    if resp.status_code != 200:
        return [f"status {resp.status_code} != 200: {resp.text[:300]}"]
    assert isinstance(case.body, dict)
    if case.body.get("stream"):
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            return [f"stream content-type {resp.headers.get('content-type')!r}"]
        events = events_of(resp.text)
        problems = check_sequence(events)
        message = events[0]["message"]
        usage = events[-2].get("usage", {})
    else:
        problems = []
        message = resp.json()
        usage = message.get("usage", {})
    want_id = "msg_" + resp.headers.get("x-request-id", "")
    if message.get("type") != "message" or message.get("id") != want_id:
        problems.append(f"type/id {message.get('type')}/{message.get('id')}")
    if not usage.get("output_tokens") or "input_tokens" not in usage:
        problems.append(f"usage {usage}")
    return problems


def _check_refused(case: Case, resp: httpx.Response) -> list[str]:
    problems = _check_error(resp.status_code, resp.json(), 400, "invalid_request_error")
    if not problems and case.param is not None:
        message = resp.json()["error"]["message"]
        if not message.startswith(f"{case.param}: "):
            problems.append(f"message does not name {case.param}: {message!r}")
    return problems


async def test_messages_table_over_http() -> None:
    failures: list[str] = []
    engine = FakeEngine(DefaultScript(tokens=3))
    async with running_gateway(engine, settings_hook=_add_text_model) as gw:
        with trio.fail_after(90):
            for case in MESSAGES_CASES:
                resp = await _post(gw, body_bytes(case))
                if case.status == 200:
                    problems = _check_accepted(case, resp)
                else:
                    problems = _check_refused(case, resp)
                failures += [f"{case.id}: {p}" for p in problems]
                if "x-request-id" not in resp.headers:
                    failures.append(f"{case.id}: answer without X-Request-Id")
        accepted = sum(c.status == 200 for c in MESSAGES_CASES)
        if len(_generates(engine)) != accepted:
            failures.append(f"engine saw {len(_generates(engine))} generations, want {accepted}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


def _sdk_table(url: str) -> tuple[list[str], int]:
    """Every dict-bodied case with the SDK's required fields through
    ``client.messages.create`` (fields the SDK does not name go in ``extra_body``)."""
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=30)
    known = set(inspect.signature(client.messages.create).parameters) - {
        "extra_headers", "extra_query", "extra_body", "timeout"
    }  # fmt: skip
    failures: list[str] = []
    ran = 0
    for case in MESSAGES_CASES:
        body = case.body
        if not isinstance(body, dict) or not {"model", "max_tokens", "messages"} <= set(body):
            continue
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in body.items():
            (kwargs if key in known else extra)[key] = value
        ran += 1
        try:
            out = client.messages.create(**kwargs, extra_body=extra or None)
            if body.get("stream"):
                kinds = [event.type for event in out]
                if kinds[-1] != "message_stop":
                    failures.append(f"{case.id}: stream ended with {kinds[-1]}")
            elif out.type != "message":
                failures.append(f"{case.id}: got {out.type}")
            if case.status != 200:
                failures.append(f"{case.id}: accepted, want {case.status}")
        except anthropic.BadRequestError as exc:
            message = exc.body["error"]["message"] if isinstance(exc.body, dict) else ""
            if case.status != 400:
                failures.append(f"{case.id}: refused: {message}")
            elif case.param is not None and not message.startswith(f"{case.param}: "):
                failures.append(f"{case.id}: {message!r} does not name {case.param}")
    return failures, ran


async def test_messages_table_through_the_anthropic_sdk() -> None:
    async with running_gateway(
        FakeEngine(DefaultScript(tokens=3)), settings_hook=_add_text_model
    ) as gw:
        failures, ran = await _sync(lambda: _sdk_table(gw.url), timeout=120)
    assert ran >= len(MESSAGES_CASES) - 5
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- the SDK


async def test_sdk_create_stream_and_final_message() -> None:
    engine = FakeEngine(script=_fixed(["Hello", " from", " the", " gateway."], cached_tokens=2))
    async with running_gateway(engine) as gw:
        client = _client(gw)
        message = await _sync(
            lambda: client.messages.create(model=MODEL, max_tokens=50, messages=USER)
        )
        assert message.content[0].type == "text"
        assert message.content[0].text == "Hello from the gateway."
        assert message.stop_reason == "end_turn" and message.role == "assistant"
        assert message.usage.cache_read_input_tokens == 2
        assert message.usage.output_tokens == 4

        def stream() -> tuple[list[str], Any]:
            with client.messages.stream(model=MODEL, max_tokens=50, messages=USER) as s:
                texts = list(s.text_stream)
                return texts, s.get_final_message()

        texts, final = await _sync(stream)
        assert "".join(texts) == "Hello from the gateway." and len(texts) >= 2
        assert final.model_dump() == {**message.model_dump(), "id": final.id}


async def test_sdk_tool_round_trip_and_forced_choices() -> None:
    engine = FakeEngine(script=_tool_script)
    async with running_gateway(engine, settings_hook=_hermes) as gw:
        client = _client(gw)

        def stream_call() -> Any:
            with client.messages.stream(
                model=MODEL, max_tokens=100, messages=USER, tools=[WEATHER],
                tool_choice={"type": "any"},
            ) as s:
                kinds = [e.type for e in s]
                final = s.get_final_message()
            assert kinds.count("input_json") >= 2  # the arguments came in pieces
            return final

        final = await _sync(stream_call)
        [use] = final.content
        assert use.type == "tool_use" and use.name == "get_weather"
        assert use.input == {"city": "Paris"} and final.stop_reason == "tool_use"
        auto = await _sync(lambda: client.messages.create(
            model=MODEL, max_tokens=100, messages=USER, tools=[WEATHER]))  # fmt: skip
        named = await _sync(lambda: client.messages.create(
            model=MODEL, max_tokens=100, messages=USER, tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"}))  # fmt: skip
        assert [b.type for b in auto.content] == [b.type for b in named.content] == ["tool_use"]
        bodies = _generates(engine)
        grammar = {"regex", "ebnf", "json_schema", "structural_tag"}
        assert grammar & set(bodies[0]["sampling_params"])  # any: the call is forced
        assert grammar & set(bodies[2]["sampling_params"])  # tool: forced too
        assert not grammar & set(bodies[1]["sampling_params"])  # auto: free

        # the round trip: the call and its result go back
        history = [
            *USER,
            {"role": "assistant", "content": [b.model_dump() for b in final.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "18C and sunny",
                 "cache_control": {"type": "ephemeral"}}]},
        ]  # fmt: skip
        await _sync(lambda: client.messages.create(
            model=MODEL, max_tokens=100, messages=history, tools=[WEATHER]))  # fmt: skip
        prompt = _generates(engine)[-1]["text"]  # (the test template shows no tool calls)
        assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n18C and sunny" in prompt


async def test_sdk_count_tokens_image_and_beta() -> None:
    engine = FakeEngine(script=_fixed(["It", " is", " a", " dot."]))
    async with running_gateway(engine) as gw:
        client = _client(gw)
        count = await _sync(lambda: client.messages.count_tokens(
            model=MODEL, messages=USER, system="Be brief.", tools=[WEATHER]))  # fmt: skip
        body = _generates(engine)[-1]
        assert body["sampling_params"] == {"max_new_tokens": 0}
        assert count.input_tokens == max(1, len(body["text"].split()))  # the fake's tokenizer
        message = await _sync(lambda: client.messages.create(
            model=MODEL, max_tokens=100, system="Be brief.", tools=[WEATHER], messages=USER))
        assert message.usage.input_tokens == count.input_tokens  # the same prompt, counted
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": PNG_B64}}  # fmt: skip
        described = await _sync(lambda: client.beta.messages.create(
            model=MODEL, max_tokens=20, betas=["interleaved-thinking-2025-05-14"],
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}]))
        assert described.content[0].text == "It is a dot."
        assert _generates(engine)[-1]["image_data"] == [f"data:image/png;base64,{PNG_B64}"]


async def test_sdk_typed_errors() -> None:
    async with running_gateway(auth=True, tokens=["sesame"]) as gw:
        good = _client(gw, "sesame")
        with pytest.raises(anthropic.BadRequestError) as bad:
            await _sync(lambda: good.messages.create(
                model=MODEL, max_tokens=5, messages=USER, extra_body={"colour": "red"}))
        assert bad.value.body["error"]["message"].startswith("colour: ")  # type: ignore[index]
        with pytest.raises(anthropic.AuthenticationError):
            await _sync(lambda: _client(gw, "wrong").messages.create(
                model=MODEL, max_tokens=5, messages=USER))  # fmt: skip
        with pytest.raises(anthropic.NotFoundError) as missing:
            await _sync(lambda: good.messages.create(
                model="claude-nope", max_tokens=5, messages=USER))  # fmt: skip
        assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        ok = await _sync(lambda: good.messages.create(model=MODEL, max_tokens=3, messages=USER))
        assert ok.stop_reason == "max_tokens"


# ---------------------------------------------------------------- HTTP details


async def test_claude_code_request_headers_and_aliases() -> None:
    def aliases(s: Settings) -> None:
        s.models[MODEL].aliases = ["claude-haiku-4-5-20251001", "claude-*"]

    engine = FakeEngine(DefaultScript(tokens=4))
    async with running_gateway(engine, settings_hook=aliases, auth=True, tokens=["k"]) as gw:
        with trio.fail_after(LIMIT):
            while gw.state.profiles[MODEL].context_length is None:  # learned from the engine
                await trio.sleep(0.02)
            headers = {
                "Authorization": "Bearer k",
                "anthropic-version": "2023-06-01",
                "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                  "context-management-2025-06-27,fine-grained-tool-streaming",
                "x-app": "cli",
                "X-Claude-Code-Session-Id": "3f2e",
                "X-Stainless-Lang": "js",
            }  # fmt: skip
            for model in ("claude-opus-4-8", "claude-haiku-4-5-20251001"):
                for follow_up in (False, True):
                    r = await _post(gw, claude_code_body(model, follow_up=follow_up),
                                    path=PATH + "?beta=true", headers=headers)  # fmt: skip
                    assert r.status_code == 200, r.text
                    events = events_of(r.text)
                    assert not check_sequence(events), check_sequence(events)
                    assert events[0]["message"]["model"] == MODEL
            bodies = _generates(engine)
            # max_tokens 32000 is past the fake's 8192-token context: capped to what fits
            assert all(b["sampling_params"]["max_new_tokens"] is None for b in bodies)
            r = await _post(gw, claude_code_body(), headers={"x-api-key": "k"})
            assert r.status_code == 200
            r = await _post(gw, claude_code_body(), headers={"x-api-key": "no"})
            assert not _check_error(r.status_code, r.json(), 401, "authentication_error")
            r = await _post(gw, claude_code_body(), headers={"x-api-key": "no",
                                                              "Authorization": "Bearer k"})
            assert r.status_code == 401  # x-api-key wins when both are sent
            r = await _post(gw, {**claude_code_body(), "model": "gpt-4o"},
                            headers={"x-api-key": "k"})  # fmt: skip
            assert not _check_error(r.status_code, r.json(), 404, "not_found_error")
            r = await gw.client.get(PATH)
            assert r.status_code == 405 and r.headers["allow"] == "POST"
            assert r.json()["type"] == "error"


async def test_messages_routes_in_the_openapi_document() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(LIMIT):
            doc = (await gw.client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    for path, fields in ((PATH, {"model", "max_tokens", "messages", "stream", "tools"}),
                         (PATH + "/count_tokens", {"model", "messages", "tools"})):  # fmt: skip
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = schemas[ref.rsplit("/", 1)[1]]
        assert schema["additionalProperties"] is False
        assert fields <= set(schema["properties"]) and "container" not in schema["properties"]
        assert "model" in schema["required"] and "messages" in schema["required"]
        assert {p["name"] for p in op["parameters"]} >= {"x-api-key", "anthropic-version", "beta"}
        for status in ("400", "401", "404", "429", "503"):
            err = op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
            assert err.endswith("/AnthropicError")
    assert "max_tokens" in schemas["MessagesRequest"]["required"]
    assert "max_tokens" not in schemas["CountTokensRequest"]["properties"]
    assert set(schemas["AnthropicError"]["required"]) == {"type", "error"}


async def test_error_after_the_200_is_an_error_event() -> None:
    engine = FakeEngine(script=faulty(Plan([" a", " b", " c", " d"], fault=Fault.error_event(2))))
    async with running_gateway(engine) as gw:
        with trio.fail_after(LIMIT):
            body = {"model": MODEL, "max_tokens": 20, "messages": USER, "stream": True}
            r = await _post(gw, body, rid="fault-err")
            assert r.status_code == 200
            events = events_of(r.text)
            assert events[-1]["type"] == "error" and not check_sequence(events)
            assert events[-1]["error"]["type"] in ("invalid_request_error", "api_error")
            assert "injected" not in r.text  # engine text is never echoed

            def sdk() -> None:
                with _client(gw).messages.stream(
                    model=MODEL, max_tokens=20, messages=USER,
                    extra_headers={"X-Request-Id": "fault-sdk"},
                ) as s:
                    list(s)

            with pytest.raises(anthropic.APIStatusError):
                await _sync(sdk)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_failing_before_any_output_decides_the_status(stream: bool) -> None:
    engine = FakeEngine(script=faulty(Plan([" a"], fault=Fault.http_error(503, "engine secret"))))
    async with running_gateway(engine) as gw:
        with trio.fail_after(LIMIT):
            body = {"model": MODEL, "max_tokens": 5, "messages": USER, "stream": stream}
            r = await _post(gw, body, rid="fault-503")
            assert not _check_error(r.status_code, r.json(), 503, "overloaded_error"), r.text
            assert int(r.headers["retry-after"]) >= 1
            assert "engine secret" not in r.text


async def test_client_leaving_a_stream_aborts_the_generation() -> None:
    plan = Plan([f" t{k}" for k in range(400)], itl=0.02)
    engine = FakeEngine(script=faulty(plan))
    async with running_gateway(engine) as gw:
        with trio.fail_after(LIMIT):
            async with gw.client.stream(
                "POST",
                PATH,
                json={"model": MODEL, "messages": USER, "stream": True, "max_tokens": 400},
                headers={"X-Request-Id": "fault-gone"},
            ) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += line == "event: content_block_delta"
                    if seen >= 5:
                        break
        await aborted_once(engine, ["fault-gone-0"])
        await settled(engine)
        assert "fault-gone-0" not in engine.finished
        await still_serves(gw)


async def test_an_sdk_client_leaving_a_stream_aborts_the_generation() -> None:
    plan = Plan([f" t{k}" for k in range(400)], itl=0.02)
    engine = FakeEngine(script=faulty(plan))
    async with running_gateway(engine) as gw:
        client = _client(gw)

        def leave() -> int:
            with client.messages.stream(
                model=MODEL, max_tokens=400, messages=USER,
                extra_headers={"X-Request-Id": "fault-sdk-gone"},
            ) as s:  # fmt: skip
                seen = 0
                for event in s:
                    seen += event.type == "text"
                    if seen >= 5:
                        break  # leaving the block closes the response
                return seen

        assert await _sync(leave) == 5
        await aborted_once(engine, ["fault-sdk-gone-0"])
        await settled(engine)
        assert "fault-sdk-gone-0" not in engine.finished
