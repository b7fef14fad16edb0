"""``POST /v1/responses`` through a real gateway in front of scripted fake engines.

The contract table (tests/responses_cases.py) over HTTP; the official ``openai`` SDK's
``client.responses.create`` and ``client.responses.stream`` (sync and async) on text, function
calls (the ``hermes`` parser), a tool round trip and reasoning items; the event order and
sequence numbers; a length cut; an error after the 200; and a client that leaves a streamed
response (its generation is aborted upstream). Every socket test is guarded by
``trio.fail_after``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio

from engine.fake import Call, DefaultScript, FakeEngine, Fault, Plan
from sieproxy.settings.load import Settings
from tests.contract_cases import Case, body_bytes
from tests.responses_cases import RESPONSES_CASES

from .harness import MODEL, Gateway, running_gateway
from .test_contract_http import _add_text_model, _check_refusal
from .test_faults import aborted_once, faulty, settled, still_serves

T = TypeVar("T")
PATH = "/v1/responses"
LIMIT = 30  # seconds per test
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": True,
}
CALL_JSON = '{"name":"get_weather","arguments":{"city":"Paris"}}'
TOOL_TOKENS = ["\n", "<tool", "_call>", CALL_JSON[:20], CALL_JSON[20:], "</tool_", "call>"]
THINK_TOKENS = ["<th", "ink>pl", "an</th", "ink>\n", "\nans", "wer"]


def _fixed(tokens: Sequence[str]) -> Callable[[Call], Plan]:
    return lambda call: Plan(tokens=list(tokens))


def _parsers(reasoning: str | None = None, tools: str | None = None) -> Callable[[Settings], None]:
    def hook(s: Settings) -> None:
        s.models[MODEL].reasoning_parser = reasoning
        s.models[MODEL].tool_parser = tools

    return hook


def events_of(text: str) -> list[dict[str, Any]]:
    """A Responses SSE body as its events; checks each frame's ``event:`` line names its type."""
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
    """Problems with the event order of one streamed response (empty: none)."""
    problems: list[str] = []
    types = [e["type"] for e in events]
    if [e.get("sequence_number") for e in events] != list(range(len(events))):
        problems.append("sequence numbers are not 0, 1, 2, ...")
    if types[:2] != ["response.created", "response.in_progress"]:
        problems.append(f"starts with {types[:2]}")
    last = types[-1] if types else None
    if last not in ("response.completed", "response.incomplete", "response.failed"):
        problems.append(f"ends with {last}")
    open_items: set[int] = set()
    done_items: set[int] = set()
    for e in events[2:-1]:
        index = e.get("output_index")
        if e["type"] == "response.output_item.added":
            if index in open_items or index in done_items or index != len(done_items):
                problems.append(f"item {index} added out of order")
            open_items.add(index)
        elif e["type"] == "response.output_item.done":
            open_items.discard(index)
            done_items.add(index)
        elif index is not None and index not in open_items:
            problems.append(f"{e['type']} for item {index}, which is not open")
    if open_items and last != "response.failed":  # a failure leaves its item open
        problems.append(f"items {sorted(open_items)} never done")
    return problems


async def _post(
    gw: Gateway, body: dict[str, Any] | bytes, rid: str | None = None
) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if rid is not None:
        headers["X-Request-Id"] = rid
    return await gw.client.post(PATH, content=raw, headers=headers)


async def _sync(fn: Callable[[], T], timeout: float = LIMIT) -> T:
    with trio.fail_after(timeout):
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def _client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20)


def _async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)


def _generates(engine: FakeEngine) -> list[dict[str, Any]]:
    return [b for p, b in engine.requests if p == "/generate"]


# ---------------------------------------------------------------- the contract table


def _check_accepted(case: Case, resp: httpx.Response) -> list[str]:
    if resp.status_code != 200:
        return [f"status {resp.status_code} != 200: {resp.text[:300]}"]
    assert isinstance(case.body, dict)
    want_id = "resp_" + resp.headers.get("x-request-id", "")
    if case.body.get("stream"):
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            return [f"stream content-type {resp.headers.get('content-type')!r}"]
        events = events_of(resp.text)
        problems = check_sequence(events)
        final = events[-1].get("response", {})
    else:
        problems = []
        final = resp.json()
    if final.get("object") != "response" or final.get("id") != want_id:
        problems.append(f"object/id {final.get('object')}/{final.get('id')}")
    if final.get("status") not in ("completed", "incomplete"):
        problems.append(f"status {final.get('status')}")
    usage = final.get("usage") or {}
    if usage.get("total_tokens") != usage.get("input_tokens", 0) + usage.get("output_tokens", 0):
        problems.append(f"usage does not add up: {usage}")
    return problems


async def test_responses_table_over_http() -> None:
    failures: list[str] = []
    engine = FakeEngine(DefaultScript(tokens=3))
    async with running_gateway(engine, settings_hook=_add_text_model) as gw:
        with trio.fail_after(90):
            for case in RESPONSES_CASES:
                resp = await _post(gw, body_bytes(case))
                if case.status == 200:
                    problems = _check_accepted(case, resp)
                else:
                    problems = _check_refusal(case, resp.status_code, resp.json())
                failures += [f"{case.id}: {p}" for p in problems]
                if "x-request-id" not in resp.headers:
                    failures.append(f"{case.id}: answer without X-Request-Id")
        # Every refusal was decided before any engine work; each accepted case is one generation.
        accepted = sum(c.status == 200 for c in RESPONSES_CASES)
        if len(_generates(engine)) != accepted:
            failures.append(f"engine saw {len(_generates(engine))} generations, want {accepted}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)


def _sdk_table(url: str) -> tuple[list[str], int]:
    """Every dict-bodied case through ``client.responses.create`` (fields the SDK does not know
    go in ``extra_body``): the SDK must send the case's body and get the case's answer."""
    sent: list[bytes] = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(r.read())]}, timeout=30)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, http_client=http)
    known = set(inspect.signature(client.responses.create).parameters) - {
        "extra_headers", "extra_query", "extra_body", "timeout"
    }  # fmt: skip
    failures: list[str] = []
    ran = 0
    try:
        for case in RESPONSES_CASES:
            if not isinstance(case.body, dict):
                continue
            kwargs: dict[str, Any] = {}
            extra: dict[str, Any] = {}
            for key, value in case.body.items():
                (kwargs if key in known else extra)[key] = value
            if extra:
                kwargs["extra_body"] = extra
            sent.clear()
            outcome: Any
            try:
                result = client.responses.create(**kwargs)
                outcome = list(result) if case.body.get("stream") else result
            except openai.APIStatusError as exc:
                outcome = exc
            except openai.APIError as exc:
                failures.append(f"{case.id}: SDK error {type(exc).__name__}: {exc}")
                continue
            ran += 1
            if not sent or json.loads(sent[0]) != case.body:
                failures.append(f"{case.id}: the SDK sent {sent[:1]!r:.300}, not the case body")
                continue
            failures += [f"{case.id}: {p}" for p in _sdk_outcome(case, outcome)]
    finally:
        client.close()
    return failures, ran


def _sdk_outcome(case: Case, outcome: Any) -> list[str]:
    if case.status == 200:
        if isinstance(outcome, openai.APIStatusError):
            return [f"SDK raised {outcome.status_code}: {outcome.body}"]
        assert isinstance(case.body, dict)
        final = outcome[-1].response if case.body.get("stream") else outcome
        if final.status not in ("completed", "incomplete") or not final.id.startswith("resp_"):
            return [f"SDK final response {final.id} {final.status}"]
        return []
    if not isinstance(outcome, openai.BadRequestError):
        return [f"SDK outcome {type(outcome).__name__}, want BadRequestError"]
    if (outcome.code, outcome.param, outcome.type) != (
        case.code, case.param, "invalid_request_error"
    ):  # fmt: skip
        return [f"SDK code/param/type {outcome.code}/{outcome.param}/{outcome.type}"]
    return []


async def test_responses_table_through_openai_sdk() -> None:
    engine = FakeEngine(DefaultScript(tokens=3))
    async with running_gateway(engine, settings_hook=_add_text_model) as gw:
        failures, ran = await _sync(lambda: _sdk_table(gw.url), timeout=120)
        metrics = (await gw.client.get("/metrics")).text
    assert ran == sum(isinstance(c.body, dict) for c in RESPONSES_CASES)
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures)
    # Counted under their own endpoint label, as chat's are under theirs.
    assert 'sieproxy_requests_total{endpoint="responses",model="test-model",status="200"}' in (
        metrics
    )


# ---------------------------------------------------------------- the SDK


def _plain(response: Any) -> Any:
    """A response as data, without the ``parsed*`` members the stream helper's result adds and
    without ``created_at`` (two requests may fall in different seconds)."""

    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if not k.startswith("parsed")}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v

    data = strip(response.model_dump())
    del data["created_at"]
    return data


def _texts(response: Any) -> list[str]:
    return [c.text for item in response.output if item.type == "message" for c in item.content]


async def test_sdk_create_and_stream_text_sync() -> None:
    async with running_gateway(FakeEngine(DefaultScript(tokens=12))) as gw:
        client = _client(gw)
        headers = {"X-Request-Id": "same"}  # the fake engine's tokens follow the rid

        created = await _sync(
            lambda: client.responses.create(
                model=MODEL, input="Say something.", instructions="Be brief.",
                max_output_tokens=40, temperature=0.5, extra_headers=headers,
            )
        )  # fmt: skip
        assert created.id == "resp_same" and created.object == "response"
        assert created.status == "completed"
        assert created.output_text and _texts(created) == [created.output_text]
        assert created.usage is not None and created.usage.output_tokens > 0
        assert created.usage.total_tokens == (
            created.usage.input_tokens + created.usage.output_tokens
        )

        def streamed() -> tuple[list[Any], Any]:
            with client.responses.stream(
                model=MODEL, input="Say something.", instructions="Be brief.",
                max_output_tokens=40, temperature=0.5, extra_headers=headers,
            ) as stream:  # fmt: skip
                events = list(stream)
                return events, stream.get_final_response()

        events, final = await _sync(streamed)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == created.output_text
        a, b = _plain(final), _plain(created)
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


async def test_sdk_create_and_stream_async() -> None:
    async with running_gateway(FakeEngine(DefaultScript(tokens=12))) as gw:
        url = gw.url

        async def run() -> tuple[Any, Any, list[str]]:
            client = _async_client(url)
            headers = {"X-Request-Id": "same-async"}
            created = await client.responses.create(
                model=MODEL, input="Hello", extra_headers=headers
            )
            async with client.responses.stream(
                model=MODEL, input="Hello", extra_headers=headers
            ) as stream:
                types = [e.type async for e in stream]
                final = await stream.get_final_response()
            await client.close()
            return created, final, types

        # The async SDK runs on asyncio, in a thread beside the gateway's trio loop.
        import asyncio

        created, final, types = await _sync(lambda: asyncio.run(run()))
        assert created.status == "completed" and created.output_text
        assert _plain(final) == _plain(created)
        assert types[0] == "response.created" and types[-1] == "response.completed"
        assert types.count("response.output_item.added") == 1


ARRAY_TOKENS = ['[{"name":"get_', 'weather","arguments":{"ci', 'ty":"Paris"}}', "]"]


@pytest.mark.parametrize(
    ("choice", "tokens"),
    [("auto", TOOL_TOKENS), ({"type": "function", "name": "get_weather"}, ARRAY_TOKENS)],
    ids=["auto-hermes", "forced-json-array"],
)
async def test_function_call_streamed_and_not_then_round_trip(
    choice: Any, tokens: list[str]
) -> None:
    engine = FakeEngine(script=_fixed(tokens))
    async with running_gateway(engine, settings_hook=_parsers(tools="hermes")) as gw:
        client = _client(gw)
        headers = {"X-Request-Id": "tools"}
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "input": "Weather in Paris?",
            "tools": [WEATHER],
            "tool_choice": choice,
            "extra_headers": headers,
        }
        created = await _sync(lambda: client.responses.create(**kwargs))
        # The whitespace before the call is no answer: one item, the call.
        assert [item.type for item in created.output] == ["function_call"]
        call = created.output[0]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_") and call.status == "completed"
        assert created.tool_choice == choice or created.tool_choice.type == "function"

        def streamed() -> tuple[list[str], Any]:
            with client.responses.stream(**kwargs) as stream:
                types = [e.type for e in stream]
                return types, stream.get_final_response()

        types, final = await _sync(streamed)
        a, b = _plain(final), _plain(created)
        assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
        assert "response.function_call_arguments.delta" in types
        assert types.index("response.function_call_arguments.done") < types.index(
            "response.output_item.done"
        )

        # The round trip: the call and its output fed back as input items.
        engine.script = lambda c: Plan(tokens=[" It", " is", " sunny."])
        follow = await _sync(
            lambda: client.responses.create(
                model=MODEL,
                tools=[WEATHER],
                input=[
                    {"role": "user", "content": "Weather in Paris?"},
                    *created.output,  # the output items as they are (the SDK serializes them)
                    {"type": "function_call_output", "call_id": call.call_id, "output": "18C"},
                ],
            )
        )
        assert follow.output_text == " It is sunny."
        prompt = _generates(engine)[-1]["text"]
        assert "Weather in Paris?" in prompt and "18C" in prompt


async def test_reasoning_items_with_include_reasoning() -> None:
    engine = FakeEngine(script=_fixed(THINK_TOKENS))
    async with running_gateway(engine, settings_hook=_parsers(reasoning="qwen3")) as gw:
        with trio.fail_after(LIMIT):
            r = await _post(gw, {"model": MODEL, "input": "hi", "include_reasoning": True})
            body = r.json()
            kinds = [item["type"] for item in body["output"]]
            assert kinds == ["reasoning", "message"], body
            assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan"}]
            assert body["output"][1]["content"][0]["text"] == "answer"
            assert body["usage"]["output_tokens"] == len(THINK_TOKENS)

            r = await _post(
                gw, {"model": MODEL, "input": "hi", "include_reasoning": True, "stream": True}
            )
            events = events_of(r.text)
            assert not check_sequence(events)
            streamed = events[-1]["response"]["output"]
            assert [(i["type"], i.get("content")) for i in streamed] == [
                (i["type"], i.get("content")) for i in body["output"]
            ]
            deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
            assert "".join(deltas) == "plan"

            # Without include_reasoning the reasoning stays private: only the message.
            r = await _post(gw, {"model": MODEL, "input": "hi"})
            assert [item["type"] for item in r.json()["output"]] == ["message"]


async def test_length_cut_is_incomplete() -> None:
    async with running_gateway(FakeEngine(DefaultScript())) as gw:
        with trio.fail_after(LIMIT):
            r = await _post(gw, {"model": MODEL, "input": "hi", "max_output_tokens": 3})
            body = r.json()
            assert body["status"] == "incomplete"
            assert body["incomplete_details"] == {"reason": "max_output_tokens"}
            assert body["output"][0]["status"] == "incomplete"
            assert body["usage"]["output_tokens"] == 3
            assert _generates(gw.engines[0])[-1]["sampling_params"]["max_new_tokens"] == 3

            r = await _post(
                gw, {"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True}
            )
            events = events_of(r.text)
            assert not check_sequence(events)
            assert events[-1]["type"] == "response.incomplete"
            assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_error_after_the_200_is_an_error_event_then_failed() -> None:
    engine = FakeEngine(script=faulty(Plan([" a", " b", " c", " d"], fault=Fault.error_event(2))))
    async with running_gateway(engine) as gw:
        with trio.fail_after(LIMIT):
            r = await _post(gw, {"model": MODEL, "input": "hi", "stream": True}, rid="fault-err")
            assert r.status_code == 200
            events = events_of(r.text)
            types = [e["type"] for e in events]
            assert types[-2:] == ["error", "response.failed"], types
            assert not check_sequence(events)
            failed = events[-1]["response"]
            assert failed["status"] == "failed" and failed["error"]["message"]
            assert events[-2]["message"] == failed["error"]["message"]
            assert "injected" not in r.text  # engine text is never echoed


async def test_client_leaving_a_stream_aborts_the_generation() -> None:
    plan = Plan([f" t{k}" for k in range(400)], itl=0.02)
    engine = FakeEngine(script=faulty(plan))
    async with running_gateway(engine) as gw:
        with trio.fail_after(LIMIT):
            async with gw.client.stream(
                "POST",
                PATH,
                json={"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 400},
                headers={"X-Request-Id": "fault-gone"},
            ) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("event: response.output_text.delta")
                    if seen >= 5:
                        break
        await aborted_once(engine, ["fault-gone-0"])
        await settled(engine)
        assert "fault-gone-0" not in engine.finished
        await still_serves(gw)


async def test_routes_and_openapi() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(LIMIT):
            r = await gw.client.get(PATH)
            assert r.status_code == 405 and r.headers["allow"] == "POST"
            doc = (await gw.client.get("/openapi.json")).json()
            op = doc["paths"][PATH]["post"]
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
            assert schema["additionalProperties"] is False
            assert {"model", "input", "tools", "text", "stream"} <= set(schema["properties"])
            assert "previous_response_id" not in schema["properties"]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_failing_before_any_output_decides_the_status(stream: bool) -> None:
    """As on chat: nothing was sent yet, so the status line carries the engine's failure (503
    with Retry-After), in the error envelope, never a 200 with an error event."""
    engine = FakeEngine(script=faulty(Plan([" a"], fault=Fault.http_error(503, "engine secret"))))
    async with running_gateway(engine) as gw:
        with trio.fail_after(LIMIT):
            r = await _post(gw, {"model": MODEL, "input": "hi", "stream": stream}, rid="fault-503")
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert r.headers["content-type"].startswith("application/json")
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert "engine secret" not in r.text


async def test_sdk_parse_with_a_pydantic_text_format() -> None:
    """``client.responses.parse(text_format=Model)`` sends a strict json_schema ``text.format``
    and parses the answer into the model (the grammar itself is the engine's: scripted here)."""
    import pydantic

    class Person(pydantic.BaseModel):
        name: str
        age: int

    engine = FakeEngine(script=_fixed(['{"name"', ': "Ada", ', '"age": 36}']))
    async with running_gateway(engine) as gw:
        client = _client(gw)
        parsed = await _sync(
            lambda: client.responses.parse(model=MODEL, input="Ada, 36.", text_format=Person)
        )
        assert parsed.output_parsed == Person(name="Ada", age=36)
        sent = _generates(engine)[-1]["sampling_params"]
        assert json.loads(sent["json_schema"])["required"] == ["name", "age"]
        assert parsed.text.format.type == "json_schema"  # echoed as sent
