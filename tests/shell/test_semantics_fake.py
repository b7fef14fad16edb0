"""Request/response semantics through a real gateway in front of scripted fake engines.

Reasoning split (``reasoning_parser``), tool-call parsing (``tool_parser="hermes"``), inline
images, LoRA adapters, sampling-parameter mapping to SGLang names, fields that must never reach
the engine, and ``schema_in_prompt``. Every socket test is guarded by ``trio.fail_after``.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import trio

from engine.fake import Call, FakeEngine, Plan
from sieproxy.settings.load import Settings

from .harness import MODEL, Gateway, running_gateway, sse_events

LIMIT = 15  # seconds per test


# ---------------------------------------------------------------- helpers


def _index(call: Call) -> int:
    return int(call.rid.rsplit("-", 1)[1])


def _tokens_script(tokens_for: Callable[[int], Sequence[str]]) -> Callable[[Call], Plan]:
    """A script emitting ``tokens_for(choice index)`` (choice index from the rid suffix)."""
    return lambda call: Plan(tokens=list(tokens_for(_index(call))))


def _fixed(tokens: Sequence[str]) -> Callable[[Call], Plan]:
    return _tokens_script(lambda _i: tokens)


def _generates(gw: Gateway) -> list[dict[str, Any]]:
    return [b for p, b in gw.engines[0].requests if p == "/generate"]


def _parser(reasoning: str | None = None, tools: str | None = None) -> Callable[[Settings], None]:
    def hook(s: Settings) -> None:
        s.models[MODEL].reasoning_parser = reasoning
        s.models[MODEL].tool_parser = tools

    return hook


async def _stream(gw: Gateway, **body: Any) -> list[dict[str, Any]]:
    body["stream"] = True
    r = await gw.chat(**body)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return [e for e in events[:-1]]


def _per_choice(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each choice's deltas (finish_reason folded in as ``_finish``), in arrival order."""
    out: dict[int, list[dict[str, Any]]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            d = dict(c["delta"])
            if c.get("finish_reason") is not None:
                d["_finish"] = c["finish_reason"]
            out.setdefault(c["index"], []).append(d)
    return out


def _joined(deltas: list[dict[str, Any]], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def _png() -> bytes:
    """A valid 1x1 RGB PNG."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00\xff\x00\x00")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# ---------------------------------------------------------------- reasoning

THINK_TOKENS = ["<th", "ink>pl", "an</th", "ink>\n", "\nans", "wer"]


async def test_reasoning_qwen3_included_nonstreaming_and_streaming() -> None:
    engine = FakeEngine(script=_fixed(THINK_TOKENS))
    with trio.fail_after(LIMIT):
        async with running_gateway(engine, settings_hook=_parser("qwen3")) as gw:
            r = await gw.chat(include_reasoning=True, max_tokens=32)
            assert r.status_code == 200, r.text
            body = r.json()
            msg = body["choices"][0]["message"]
            assert msg["reasoning_content"] == "plan"
            assert msg["content"] == "answer"
            assert body["choices"][0]["finish_reason"] == "stop"
            assert body["usage"]["completion_tokens"] == len(THINK_TOKENS)

            chunks = await _stream(gw, include_reasoning=True, max_tokens=32)
            deltas = _per_choice(chunks)[0]
            kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
            # All reasoning first, then all content.
            assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content"), kinds
            assert "reasoning_content" in kinds and "content" in kinds
            assert _joined(deltas, "reasoning_content") == "plan"
            assert _joined(deltas, "content") == "answer"
            assert deltas[-1]["_finish"] == "stop"


async def test_reasoning_starts_inside_when_template_opened_it() -> None:
    # qwen3 with thinking on (the default / enable_thinking: true) starts inside reasoning: the
    # model's output need not repeat <think>.
    engine = FakeEngine(script=_fixed(["pl", "an</", "think>", "\n\n", "answer"]))
    with trio.fail_after(LIMIT):
        async with running_gateway(engine, settings_hook=_parser("qwen3")) as gw:
            r = await gw.chat(
                include_reasoning=True,
                chat_template_kwargs={"enable_thinking": True},
                max_tokens=32,
            )
            assert r.status_code == 200, r.text
            msg = r.json()["choices"][0]["message"]
            assert (msg["reasoning_content"], msg["content"]) == ("plan", "answer")
            chunks = await _stream(
                gw, include_reasoning=True, chat_template_kwargs={"enable_thinking": True}
            )
            deltas = _per_choice(chunks)[0]
            assert _joined(deltas, "reasoning_content") == "plan"
            assert _joined(deltas, "content") == "answer"


async def test_reasoning_hidden_without_include_reasoning_same_usage() -> None:
    engine = FakeEngine(script=_fixed(THINK_TOKENS))
    with trio.fail_after(LIMIT):
        async with running_gateway(engine, settings_hook=_parser("qwen3")) as gw:
            shown = await gw.chat(include_reasoning=True, max_tokens=32)
            hidden = await gw.chat(max_tokens=32)
            off = await gw.chat(include_reasoning=False, max_tokens=32)
            for r in (shown, hidden, off):
                assert r.status_code == 200, r.text
            for r in (hidden, off):
                body = r.json()
                assert "reasoning_content" not in body["choices"][0]["message"]
                assert body["choices"][0]["message"]["content"] == "answer"
                assert "plan" not in r.text
                assert body["usage"] == shown.json()["usage"]

            usages = []
            for flag in (None, False, True):
                extra = {} if flag is None else {"include_reasoning": flag}
                chunks = await _stream(
                    gw, max_tokens=32, stream_options={"include_usage": True}, **extra
                )
                usages.append(chunks[-1]["usage"])
                deltas = _per_choice([c for c in chunks if c["choices"]])[0]
                if flag:
                    assert _joined(deltas, "reasoning_content") == "plan"
                else:
                    assert not any("reasoning_content" in d for d in deltas)
                    assert "plan" not in json.dumps(chunks)
                assert _joined(deltas, "content") == "answer"
            assert usages[0] == usages[1] == usages[2]
            assert usages[0]["completion_tokens"] == len(THINK_TOKENS)


def _think_n(i: int) -> list[str]:
    # Different split per choice; choice 2 writes no <think> opener (starts inside reasoning).
    if i == 0:
        return ["<think>", "plan0", "</think>", "\n\nanswer0"]
    if i == 1:
        return ["<", "think>\npl", "an1\n</", "thi", "nk>", "\n", "\n", "ans", "wer1"]
    return ["plan2</think>answer2"]


async def test_reasoning_n3_independent_per_choice() -> None:
    engine = FakeEngine(script=_tokens_script(_think_n))
    with trio.fail_after(LIMIT):
        async with running_gateway(engine, settings_hook=_parser("qwen3")) as gw:
            r = await gw.chat(include_reasoning=True, n=3, max_tokens=32)
            assert r.status_code == 200, r.text
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            for i, c in enumerate(choices):
                assert c["message"]["reasoning_content"] == f"plan{i}"
                assert c["message"]["content"] == f"answer{i}"
                assert c["finish_reason"] == "stop"
            assert r.json()["usage"]["completion_tokens"] == sum(len(_think_n(i)) for i in range(3))

            per = _per_choice(await _stream(gw, include_reasoning=True, n=3, max_tokens=32))
            assert sorted(per) == [0, 1, 2]
            for i in range(3):
                assert _joined(per[i], "reasoning_content") == f"plan{i}"
                assert _joined(per[i], "content") == f"answer{i}"
                assert per[i][-1]["_finish"] == "stop"


async def test_no_reasoning_parser_means_no_reasoning_field() -> None:
    engine = FakeEngine(script=_fixed(THINK_TOKENS))
    with trio.fail_after(LIMIT):
        async with running_gateway(engine) as gw:
            r = await gw.chat(include_reasoning=True, max_tokens=32)
            assert r.status_code == 200, r.text
            msg = r.json()["choices"][0]["message"]
            assert "reasoning_content" not in msg
            assert msg["content"] == "".join(THINK_TOKENS)
            chunks = await _stream(gw, include_reasoning=True, max_tokens=32)
            deltas = _per_choice(chunks)[0]
            assert not any("reasoning_content" in d for d in deltas)
            assert _joined(deltas, "content") == "".join(THINK_TOKENS)


# ---------------------------------------------------------------- tool calls (hermes)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_JSON = '{"name":"get_weather","arguments":{"city":"Paris"}}'
TOOL_TOKENS = [
    "<tool", "_ca", "ll>", '{"na', 'me":"get_w', 'eather","argu', 'ments":{"ci', 'ty":"Par',
    'is"}', "}</tool_", "call>",
]  # fmt: skip
assert "".join(TOOL_TOKENS) == f"<tool_call>{CALL_JSON}</tool_call>"


async def test_hermes_tool_call_split_tokens_nonstreaming_and_streaming() -> None:
    engine = FakeEngine(script=_fixed(TOOL_TOKENS))
    with trio.fail_after(LIMIT):
        async with running_gateway(engine, settings_hook=_parser(tools="hermes")) as gw:
            r = await gw.chat(tools=[WEATHER], max_tokens=64)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            calls = choice["message"]["tool_calls"]
            assert len(calls) == 1
            assert calls[0]["type"] == "function"
            assert calls[0]["id"].startswith("call_")
            assert calls[0]["function"]["name"] == "get_weather"
            assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
            assert not choice["message"]["content"]
            # The engine kept special tokens so the tags survive detokenization.
            assert _generates(gw)[0]["sampling_params"]["skip_special_tokens"] is False

            deltas = _per_choice(await _stream(gw, tools=[WEATHER], max_tokens=64))[0]
            frags = [tc for d in deltas for tc in d.get("tool_calls") or []]
            assert frags, deltas
            first = frags[0]
            assert first["index"] == 0 and first["id"].startswith("call_")
            assert first["type"] == "function"
            assert first["function"]["name"] == "get_weather"
            for f in frags[1:]:
                assert f["index"] == 0
                assert "id" not in f and "name" not in f["function"]
            args = "".join(f["function"].get("arguments") or "" for f in frags)
            assert json.loads(args) == {"city": "Paris"}
            assert args == json.dumps({"city": "Paris"}, separators=(",", ":"))
            assert _joined(deltas, "content") == ""
            assert deltas[-1]["_finish"] == "tool_calls"


# ---------------------------------------------------------------- images

IMAGE_MSGS_TEXT = "What is in this picture?"


def _image_msg(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": IMAGE_MSGS_TEXT},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


async def test_inline_image_reaches_engine_as_image_data() -> None:
    png = _png()
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    with trio.fail_after(LIMIT):
        async with running_gateway() as gw:
            r = await gw.chat(messages=_image_msg(uri), max_tokens=3)
            assert r.status_code == 200, r.text
            (body,) = _generates(gw)
            images = body["image_data"]
            assert isinstance(images, list) and len(images) == 1
            head, payload = images[0].split(",", 1)
            assert head == "data:image/png;base64"
            assert base64.b64decode(payload) == png
            assert "<image>" in body["text"] and IMAGE_MSGS_TEXT in body["text"]
            assert body["text"].count("<image>") == 1


async def test_remote_image_url_is_400_before_any_engine_request() -> None:
    with trio.fail_after(LIMIT):
        async with running_gateway() as gw:
            before = len(gw.engines[0].requests)
            for url in ("http://example.com/cat.png", "https://example.com/cat.png"):
                r = await gw.chat(messages=_image_msg(url), max_tokens=3)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["type"] == "invalid_request_error"
            assert _generates(gw) == []
            # Only health probes, if anything, reached the engine.
            assert all(p != "/generate" for p, _ in gw.engines[0].requests[before:])


# ---------------------------------------------------------------- LoRA


async def test_lora_adapter_reaches_engine_as_lora_path() -> None:
    with trio.fail_after(LIMIT):
        async with running_gateway() as gw:
            r = await gw.chat(lora_adapter="my-adapter", max_tokens=3, n=2)
            assert r.status_code == 200, r.text
            bodies = _generates(gw)
            assert len(bodies) == 2
            assert all(b["lora_path"] == "my-adapter" for b in bodies)
            assert all("lora_adapter" not in b for b in bodies)
            assert all("lora_adapter" not in b["sampling_params"] for b in bodies)

            r = await gw.chat(max_tokens=3)
            assert r.status_code == 200
            assert "lora_path" not in _generates(gw)[-1]

            r = await gw.chat(lora_adapter="nope", max_tokens=3)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "lora_adapter"
            assert len(_generates(gw)) == 3


# ---------------------------------------------------------------- sampling params


async def test_sampling_params_use_sglang_names() -> None:
    with trio.fail_after(LIMIT):
        async with running_gateway() as gw:
            r = await gw.chat(
                n=3,
                max_tokens=5,
                min_tokens=2,
                repetition_penalty=1.15,
                top_k=7,
                seed=1234,
                logit_bias={"42": -100, "7": 5},
                frequency_penalty=0.5,
                presence_penalty=-0.25,
                temperature=0.7,
                top_p=0.9,
            )
            assert r.status_code == 200, r.text
            bodies = sorted(_generates(gw), key=lambda b: b["rid"])
            assert len(bodies) == 3
            seeds = []
            for b in bodies:
                sp = b["sampling_params"]
                assert sp["max_new_tokens"] == 5
                assert sp["min_new_tokens"] == 2
                assert sp["repetition_penalty"] == 1.15
                assert sp["top_k"] == 7
                assert sp["frequency_penalty"] == 0.5
                assert sp["presence_penalty"] == -0.25
                assert sp["temperature"] == 0.7
                assert sp["top_p"] == 0.9
                assert {k: float(v) for k, v in sp["logit_bias"].items()} == {
                    "42": -100.0,
                    "7": 5.0,
                }
                for openai_name in ("min_tokens", "seed", "max_tokens", "n"):
                    assert openai_name not in sp and openai_name not in b
                seeds.append(sp["sampling_seed"])
            assert seeds == [1234, 1235, 1236]
            assert len({b["rid"] for b in bodies}) == 3

            # Unset knobs are not sent at all (the engine's defaults apply).
            r = await gw.chat(max_tokens=4)
            assert r.status_code == 200
            sp = _generates(gw)[-1]["sampling_params"]
            for key in (
                "min_new_tokens", "repetition_penalty", "top_k", "sampling_seed", "logit_bias",
                "frequency_penalty", "presence_penalty", "temperature", "top_p",
            ):  # fmt: skip
                assert key not in sp, key


async def test_routing_and_identity_fields_never_reach_the_engine() -> None:
    marks = {
        "user": "user-MARK-1",
        "safety_identifier": "safety-MARK-2",
        "prompt_cache_key": "cache-MARK-3",
        "routing_key": "route-MARK-4",
    }
    with trio.fail_after(LIMIT):
        async with running_gateway() as gw:
            r = await gw.chat(max_tokens=3, n=2, **marks)
            assert r.status_code == 200, r.text
            chunks = await _stream(gw, max_tokens=3, **marks)
            assert chunks
            bodies = _generates(gw)
            assert len(bodies) == 3
            for b in bodies:
                dumped = json.dumps(b)
                for key, value in marks.items():
                    assert key not in b and key not in b["sampling_params"]
                    assert value not in dumped


# ---------------------------------------------------------------- schema_in_prompt

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
    "required": ["answer", "score"],
}
COMPACT = json.dumps(SCHEMA, separators=(",", ":"))


def _rf(schema: dict[str, Any] = SCHEMA) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}


async def test_schema_in_prompt() -> None:
    with trio.fail_after(LIMIT):
        async with running_gateway() as gw:
            # Default (absent): on.
            r = await gw.chat(response_format=_rf(), max_tokens=3)
            assert r.status_code == 200, r.text
            body = _generates(gw)[-1]
            assert "# Response Formats" in body["text"]
            assert "## verdict" in body["text"]
            assert COMPACT in body["text"]
            assert json.loads(body["sampling_params"]["json_schema"]) == SCHEMA

            r = await gw.chat(response_format=_rf(), schema_in_prompt=True, max_tokens=3)
            assert r.status_code == 200
            assert "# Response Formats" in _generates(gw)[-1]["text"]

            # Off: the constraint is still sent, the prompt is untouched.
            r = await gw.chat(response_format=_rf(), schema_in_prompt=False, max_tokens=3)
            assert r.status_code == 200
            body = _generates(gw)[-1]
            assert "# Response Formats" not in body["text"]
            assert COMPACT not in body["text"]
            assert json.loads(body["sampling_params"]["json_schema"]) == SCHEMA

            # Already shown by the client (pretty-printed): not added again.
            shown = "Answer with JSON following this schema:\n" + json.dumps(SCHEMA, indent=2)
            msgs = [{"role": "system", "content": shown}, {"role": "user", "content": "go"}]
            r = await gw.chat(messages=msgs, response_format=_rf(), max_tokens=3)
            assert r.status_code == 200
            body = _generates(gw)[-1]
            assert "# Response Formats" not in body["text"]
            assert json.dumps(SCHEMA, indent=2) in body["text"]

            # Not a json_schema format: nothing added.
            r = await gw.chat(response_format={"type": "json_object"}, max_tokens=3)
            assert r.status_code == 200
            body = _generates(gw)[-1]
            assert "# Response Formats" not in body["text"]
            assert json.loads(body["sampling_params"]["json_schema"]) == {"type": "object"}


async def test_schema_in_prompt_profile_default_off() -> None:
    def hook(s: Settings) -> None:
        s.models[MODEL].schema_in_prompt = False

    with trio.fail_after(LIMIT):
        async with running_gateway(settings_hook=hook) as gw:
            r = await gw.chat(response_format=_rf(), max_tokens=3)
            assert r.status_code == 200, r.text
            assert "# Response Formats" not in _generates(gw)[-1]["text"]
            r = await gw.chat(response_format=_rf(), schema_in_prompt=True, max_tokens=3)
            assert r.status_code == 200
            assert "# Response Formats" in _generates(gw)[-1]["text"]


# ---------------------------------------------------------------- encode-only models


async def test_encode_only_model_is_400_on_both_generation_surfaces() -> None:
    def hook(s: Settings) -> None:
        s.models[MODEL].encode_only = True

    with trio.fail_after(LIMIT):
        async with running_gateway(settings_hook=hook) as gw:
            answers = [
                await gw.chat(max_tokens=3),
                await gw.chat(max_tokens=3, stream=True),
                await gw.client.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}
                ),
            ]
            for r in answers:
                assert r.status_code == 400, r.text
                assert r.headers["content-type"].startswith("application/json")
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error"
                assert (err["code"], err["param"]) == ("invalid_request", "model")
                assert "cannot generate" in err["message"] and MODEL in err["message"]
            assert _generates(gw) == []
