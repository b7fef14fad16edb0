"""Constrained decoding end to end: gateway → real CPU engine (SmolLM2-135M + xgrammar).

- ``response_format`` ``json_schema``: 50 varied requests (streaming and not, ``n`` 1-4); every
  returned choice must be JSON valid against its schema and end with ``finish_reason="stop"``.
- ``tool_choice`` ``"required"`` and named: 50 requests; every choice must end with
  ``"tool_calls"`` and carry calls to allowed functions whose arguments validate against the
  function's ``parameters`` (exactly one call with ``parallel_tool_calls: false``).
- The official ``openai`` SDK's stream helper with tools and ``n=3``.

Schemas are small (short ``maxLength`` strings, bounded integers, ``maxItems``) so each document
closes well within ``max_tokens``; requests run a few at a time to use the engine's batching.
Failures are collected and reported together (``k of 50 passed``).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import trio

from .conftest import MODEL, CpuGateway

pytestmark = pytest.mark.model

CONCURRENCY = 6
SUITE_TIMEOUT = 300.0  # seconds, per 50-request suite


# ---------------------------------------------------------------- helpers


def _sse(text: str) -> list[dict[str, Any]]:
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert blocks and blocks[-1] == "data: [DONE]", text[-500:]
    out = []
    for b in blocks[:-1]:
        assert b.startswith("data: "), b
        out.append(json.loads(b[len("data: ") :]))
    return out


def _rebuild_stream(chunks: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Per-choice ``{content, finish_reason, tool_calls}`` rebuilt from stream chunks."""
    out: list[dict[str, Any]] = [
        {"content": "", "finish_reason": None, "calls": {}} for _ in range(n)
    ]
    for ch in chunks:
        if "error" in ch:
            raise AssertionError(f"error event: {ch}")
        for c in ch["choices"]:
            st = out[c["index"]]
            d = c["delta"]
            st["content"] += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                call = st["calls"].get(tc["index"])
                fn = tc.get("function") or {}
                if call is None:
                    # The first fragment of a call carries its id and name.
                    assert tc.get("id") and fn.get("name"), f"first fragment lacks id/name: {tc}"
                    call = {"id": tc["id"], "name": fn["name"], "arguments": ""}
                    st["calls"][tc["index"]] = call
                else:
                    assert "id" not in tc and "name" not in fn, f"repeated id/name: {tc}"
                call["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason") is not None:
                assert st["finish_reason"] is None, "two finish_reasons for one choice"
                st["finish_reason"] = c["finish_reason"]
    return [
        {
            "index": i,
            "content": st["content"],
            "finish_reason": st["finish_reason"],
            "tool_calls": [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(st["calls"].items())
            ],
        }
        for i, st in enumerate(out)
    ]  # fmt: skip


async def _choices(gw: CpuGateway, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST the chat request; the returned choices in one shape for streaming and not."""
    r = await gw.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]}"
    n = body.get("n", 1)
    if body.get("stream"):
        choices = _rebuild_stream(_sse(r.text), n)
    else:
        data = r.json()
        choices = [
            {
                "index": c["index"],
                "content": c["message"]["content"],
                "finish_reason": c["finish_reason"],
                "tool_calls": c["message"].get("tool_calls") or [],
            }
            for c in data["choices"]
        ]
    assert sorted(c["index"] for c in choices) == list(range(n)), choices
    return choices


async def _run_suite(
    name: str,
    bodies: list[dict[str, Any]],
    check: Callable[[dict[str, Any], list[dict[str, Any]]], None],
    gw: CpuGateway,
) -> None:
    """Run every request (``CONCURRENCY`` at a time), check each, report ``k of N passed``."""
    failures: list[str] = []
    passed = 0
    limiter = trio.CapacityLimiter(CONCURRENCY)
    started = time.monotonic()

    async def one(i: int, body: dict[str, Any]) -> None:
        nonlocal passed
        async with limiter:
            try:
                check(body, await _choices(gw, body))
                passed += 1
            except (AssertionError, jsonschema.ValidationError, ValueError) as exc:
                failures.append(f"#{i} {json.dumps(body)[:300]}\n    -> {exc}")

    with trio.fail_after(SUITE_TIMEOUT):
        async with trio.open_nursery() as nursery:
            for i, body in enumerate(bodies):
                nursery.start_soon(one, i, body)
    elapsed = time.monotonic() - started
    print(f"\n[{name}] {passed} of {len(bodies)} passed in {elapsed:.1f}s")
    assert not failures, f"{len(failures)} of {len(bodies)} failed:\n" + "\n".join(failures)


def _validate(instance: Any, schema: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(schema).validate(instance)


# ---------------------------------------------------------------- response_format json_schema

S = {"type": "string"}


def _str(n: int) -> dict[str, Any]:
    return {**S, "maxLength": n}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


#: (name, schema, prompts): ten small schemas, five prompts each → 50 requests.
SCHEMAS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("person", _obj({"name": _str(12), "age": _int(0, 120)}), [
        "Invent a person and give their name and age.",
        "Who wrote Hamlet? Give name and age at death.",
        "Describe a fictional pilot.",
        "Make up a child character.",
        "Name a famous scientist and their age.",
    ]),
    ("color", _obj({"color": {"enum": ["red", "green", "blue"]}, "confidence": _int(0, 10)}), [
        "What color is the sky?",
        "What color is grass?",
        "Pick the color of a ripe tomato.",
        "Which color do you like best?",
        "Classify the color of the sea.",
    ]),
    ("tags", _obj({"tags": {"type": "array", "items": _str(8), "minItems": 1, "maxItems": 3}}), [
        "Give tags for a blog post about cooking pasta.",
        "Tag a photo of a mountain at sunset.",
        "Suggest keywords for a song about rain.",
        "Label a news story about elections.",
        "Tags for a video of cats playing.",
    ]),
    ("city", _obj({
        "city": _obj({"name": _str(12), "country": _str(12)}),
        "population_millions": _int(0, 50),
    }), [
        "Describe the capital of France.",
        "Tell me about a big city in Japan.",
        "Pick any European city.",
        "What is the largest city in Brazil?",
        "Describe a city you like.",
    ]),
    ("task", _obj({"done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}}), [
        "Is the task 'buy milk' done? Give its priority.",
        "Status of the task: fix the roof.",
        "Report on the task: write the report.",
        "Summarize the status of 'call mom'.",
        "Task: pay taxes. Done or not?",
    ]),
    ("movie", _obj({
        "title": _str(16),
        "year": _int(1900, 2030),
        "rating": {"enum": ["good", "bad"]},
    }, required=["title", "year"]), [
        "Recommend a movie.",
        "Name a science fiction film.",
        "What is a classic comedy?",
        "Tell me about an old movie.",
        "Pick a film for tonight.",
    ]),
    ("order", _obj({
        "items": {
            "type": "array",
            "items": _obj({"name": _str(8), "qty": _int(1, 9)}),
            "minItems": 1,
            "maxItems": 2,
        },
    }), [
        "Order lunch for two people.",
        "Make a grocery order.",
        "Buy office supplies.",
        "Order some fruit.",
        "I need bread and milk.",
    ]),
    ("verdict", _obj({"answer": {"enum": ["yes", "no"]}, "reason": _str(24)}), [
        "Is water wet?",
        "Can penguins fly?",
        "Is 7 a prime number?",
        "Is the earth flat?",
        "Do cats like water?",
    ]),
    ("point", _obj({"x": _int(-100, 100), "y": _int(-100, 100), "label": _str(6)}), [
        "Give a point on a map.",
        "Where is the origin?",
        "Pick a random point.",
        "A point in the top right quadrant.",
        "Locate the treasure.",
    ]),
    ("profile", _obj({
        "user": _obj({"id": _int(1, 9999), "role": {"enum": ["admin", "guest"]}}),
        "active": {"type": "boolean"},
        "nick": _str(10),
    }, required=["user", "active"]), [
        "Create a user profile.",
        "Describe an administrator account.",
        "Make a guest user.",
        "Profile of an inactive user.",
        "Show a sample account.",
    ]),
]  # fmt: skip
N_CYCLE = [1, 2, 3, 4, 1]


def _schema_bodies() -> list[dict[str, Any]]:
    bodies = []
    for i, (name, schema, prompt) in enumerate(
        (name, schema, p) for name, schema, prompts in SCHEMAS for p in prompts
    ):
        bodies.append(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": schema, "strict": True},
                },
                "n": N_CYCLE[i % len(N_CYCLE)],
                "stream": i % 2 == 1,
                "max_tokens": 96,
                "temperature": 0.8,
                "seed": 1000 + i,
            }
        )
    return bodies


def _check_schema(body: dict[str, Any], choices: list[dict[str, Any]]) -> None:
    schema = body["response_format"]["json_schema"]["schema"]
    for c in choices:
        assert c["finish_reason"] == "stop", f"choice {c['index']}: {c['finish_reason']} {c}"
        assert not c["tool_calls"]
        try:
            doc = json.loads(c["content"])
        except ValueError as exc:
            raise AssertionError(f"choice {c['index']}: not JSON ({exc}): {c}") from None
        _validate(doc, schema)


async def test_response_format_json_schema_50(gw: CpuGateway) -> None:
    bodies = _schema_bodies()
    assert len(bodies) == 50
    assert {b["n"] for b in bodies} == {1, 2, 3, 4}
    assert {b["stream"] for b in bodies} == {True, False}
    for _, schema, _ in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
    await _run_suite("json_schema", bodies, _check_schema, gw)


# ---------------------------------------------------------------- tool_choice required / named


def _fn(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS = {
    "get_weather": _fn(
        "get_weather",
        "Current weather in a city.",
        _obj({"city": _str(16), "unit": {"enum": ["c", "f"]}}, required=["city"]),
    ),
    "add": _fn("add", "Add two integers.", _obj({"a": _int(0, 1000), "b": _int(0, 1000)})),
    "search": _fn(
        "search",
        "Search the web.",
        _obj({"query": _str(24), "limit": _int(1, 10)}, required=["query"]),
    ),
    "set_alarm": _fn(
        "set_alarm",
        "Set an alarm clock.",
        _obj({"hour": _int(0, 23), "minute": _int(0, 59), "label": _str(12)},
             required=["hour", "minute"]),
    ),
    "send_email": _fn(
        "send_email", "Send an email.", _obj({"to": _str(24), "subject": _str(20)})
    ),
    "get_time": _fn("get_time", "The current time.", {"type": "object", "properties": {}}),
    "move": _fn(
        "move",
        "Move a robot.",
        _obj({
            "direction": {"enum": ["north", "south", "east", "west"]},
            "steps": _int(1, 20),
            "options": _obj({"fast": {"type": "boolean"}}),
        }, required=["direction", "steps"]),
    ),
}  # fmt: skip

PARALLEL_FREQUENCY_PENALTY = 1.5

TOOL_CASES: list[tuple[list[str], str]] = [
    (["get_weather"], "What's the weather in Paris?"),
    (["get_weather", "search"], "Find the weather in Tokyo."),
    (["add", "get_time"], "What is 12 plus 30?"),
    (["search", "send_email"], "Look up the best pizza in Rome."),
    (["set_alarm"], "Wake me up at 7:30."),
    (["send_email", "get_time"], "Email bob about the meeting."),
    (["move", "get_time"], "Walk the robot three steps north."),
    (["get_time"], "What time is it?"),
    (["add", "search", "set_alarm"], "Add 5 and 9."),
    (["move", "get_weather", "send_email"], "Move east quickly."),
]


def _tool_bodies() -> list[dict[str, Any]]:
    bodies = []
    cases = itertools.cycle(TOOL_CASES)
    for i in range(50):
        names, prompt = next(cases)
        named = i % 2 == 1
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "tools": [TOOLS[n] for n in names],
            "n": [1, 1, 2, 1, 3][i % 5],
            "stream": (i // 2) % 2 == 1,
            "temperature": 0.8,
            "seed": 2000 + i,
        }
        if named:
            target = names[(i // 2) % len(names)]
            body["tool_choice"] = {"type": "function", "function": {"name": target}}
        else:
            body["tool_choice"] = "required"
        if (i // 4) % 2 == 0:
            body["parallel_tool_calls"] = False
            body["max_tokens"] = 96
        else:
            # Parallel calls allowed: the array is bounded by the model's max_tool_calls (4).
            # Before that bound SmolLM2 at temperature 0.8 ran away in about a quarter of
            # samples (5-14 calls until the length cut); a frequency penalty still makes the
            # closing "]" win over yet another "," (every sample closes within ~130 tokens).
            body["frequency_penalty"] = PARALLEL_FREQUENCY_PENALTY
            body["max_tokens"] = 192
        bodies.append(body)
    return bodies


def _check_tools(body: dict[str, Any], choices: list[dict[str, Any]]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
    choice = body["tool_choice"]
    allowed = set(schemas) if choice == "required" else {choice["function"]["name"]}
    for c in choices:
        where = f"choice {c['index']}"
        assert c["finish_reason"] == "tool_calls", f"{where}: {c['finish_reason']} {c}"
        calls = c["tool_calls"]
        assert calls, f"{where}: no tool_calls: {c}"
        if body.get("parallel_tool_calls") is False:
            assert len(calls) == 1, f"{where}: {len(calls)} calls with parallel off"
        ids = [call["id"] for call in calls]
        assert len(set(ids)) == len(ids) and all(ids), ids
        for call in calls:
            assert call["type"] == "function"
            name = call["function"]["name"]
            assert name in allowed, f"{where}: {name} not in {allowed}"
            try:
                args = json.loads(call["function"]["arguments"])
            except ValueError as exc:
                raise AssertionError(f"{where}: arguments not JSON ({exc}): {c}") from None
            _validate(args, schemas[name])
    all_ids = [call["id"] for c in choices for call in c["tool_calls"]]
    assert len(set(all_ids)) == len(all_ids), f"tool call ids repeat across choices: {all_ids}"


async def test_tool_choice_required_and_named_50(gw: CpuGateway) -> None:
    bodies = _tool_bodies()
    assert len(bodies) == 50
    kinds = {("named" if isinstance(b["tool_choice"], dict) else "required") for b in bodies}
    assert kinds == {"named", "required"}
    assert {b["stream"] for b in bodies} == {True, False}
    assert any(b.get("parallel_tool_calls") is False for b in bodies)
    await _run_suite("tool_choice", bodies, _check_tools, gw)


# ---------------------------------------------------------------- openai SDK stream helper


async def _in_thread(fn: Callable[[], Any], timeout: float = 180) -> Any:
    with trio.fail_after(timeout):
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


async def test_openai_sdk_stream_helper_n3_tools(gw: CpuGateway) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=180)
    tools: Any = [TOOLS["get_weather"], TOOLS["search"]]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    def run() -> tuple[Any, list[Any]]:
        events = []
        with client.chat.completions.stream(
            model=MODEL,
            messages=[{"role": "user", "content": "What's the weather in Berlin?"}],
            tools=tools,
            tool_choice="required",
            n=3,
            max_tokens=192,
            frequency_penalty=PARALLEL_FREQUENCY_PENALTY,
            temperature=0.8,
            seed=77,
        ) as stream:
            for event in stream:
                events.append(event)
            return stream.get_final_completion(), events

    try:
        final, events = await _in_thread(run)
    finally:
        client.close()

    assert len(final.choices) == 3
    assert sorted(c.index for c in final.choices) == [0, 1, 2]
    final_ids: dict[int, set[str]] = {}
    for c in final.choices:
        assert c.finish_reason == "tool_calls", c
        calls = c.message.tool_calls
        assert calls, c
        for call in calls:
            assert call.type == "function"
            assert call.function.name in schemas
            _validate(json.loads(call.function.arguments), schemas[call.function.name])
        final_ids[c.index] = {call.id for call in calls}

    # The raw chunks: each choice's tool-call deltas are its own (ids never shared).
    streamed_ids: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}
    streamed_args: dict[tuple[int, int], str] = {}
    for ev in events:
        if ev.type != "chunk":
            continue
        for ch in ev.chunk.choices:
            for tc in ch.delta.tool_calls or []:
                if tc.id:
                    streamed_ids[ch.index].add(tc.id)
                if tc.function is not None and tc.function.arguments:
                    key = (ch.index, tc.index)
                    streamed_args[key] = streamed_args.get(key, "") + tc.function.arguments
    for i in range(3):
        assert streamed_ids[i], f"choice {i} streamed no tool-call id"
        assert streamed_ids[i] == final_ids[i]
        for j in range(3):
            if i != j:
                assert not streamed_ids[i] & streamed_ids[j], streamed_ids
    by_index = {c.index: c for c in final.choices}
    for (i, j), args in streamed_args.items():
        final_args = by_index[i].message.tool_calls[j].function.arguments
        assert json.loads(args) == json.loads(final_args)
    # The SDK's own argument events: one per call of every choice.
    done = [ev for ev in events if ev.type == "tool_calls.function.arguments.done"]
    assert len(done) == sum(len(c.message.tool_calls or []) for c in final.choices)


async def test_second_turn_reports_cached_tokens_through_the_sdk(gw: CpuGateway) -> None:
    """The engine's prefix cache, as a client sees it: the next turn of a conversation (history
    + reply + new message) reports its reused history in usage.prompt_tokens_details."""
    system = (
        "You answer questions about the fictional town of Vellmar in one sentence. Vellmar's "
        "harbour freezes for eleven weeks each winter; ships then unload at Ostrand. The rail "
        "line was doubled in 1962 and its bridges were rebuilt in steel after the 1974 flood."
    )
    messages: list[Any] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "When does the harbour freeze?"},
    ]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=180)
    try:
        async with httpx.AsyncClient(base_url=gw.engine.url, timeout=60) as engine:
            assert (await engine.post("/flush_cache")).status_code == 200
        first = await _in_thread(
            lambda: client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=24, temperature=0
            )
        )
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And when was the rail line doubled?"},
        ]

        def second() -> list[Any]:
            return list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )

        usage = (await _in_thread(second))[-1].usage
        # The whole first prompt is reused (to its last whole 16-token block), and more.
        assert first.usage.prompt_tokens // 16 * 16 <= usage.prompt_tokens_details.cached_tokens
        assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    finally:
        client.close()
