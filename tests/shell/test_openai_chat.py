"""The gateway in front of an OpenAI-compatible engine that renders chat itself
(``render = "engine"``, the default for ``protocol = "openai"``; ``core.openai_chat``): a
chat-only fake (``FakeEngine(chat_only=True)``: ``/v1/chat/completions`` and ``/v1/models``,
nothing else, not even ``/health``), through the ``openai`` SDK and LangChain. The fault matrix
and the disconnect tests run in this mode too (``test_faults``, ``openai-chat``)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import trio

from engine.fake import Call, FakeEngine, Plan, default_tokens
from sieproxy.settings.checks import check_settings
from sieproxy.settings.load import EngineSpec, ModelSettings, Settings
from sieproxy.settings.schema import ConfigError

from .harness import MODEL, TEMPLATE, running_gateway
from .test_openai_sdk import MSGS, _client, _sync

PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def chat_only(script: Any = None) -> FakeEngine:
    return FakeEngine(script, chat_only=True)


def _seen(engine: FakeEngine) -> list[dict[str, Any]]:
    return [b for p, b in engine.requests if p == "/v1/chat/completions"]


def _by_seed(call: Call) -> Plan:
    seed = int(call.body.get("seed") or 0)
    tokens, ids = default_tokens(seed, 3)
    return Plan(tokens=tokens, token_ids=ids, logprobs=[-0.1 if seed == 102 else -2.0] * 3)


async def test_the_sdk_sync_and_async_against_a_chat_only_engine() -> None:
    async with running_gateway(chat_only(), protocol="openai-chat") as gw:
        client = _client(gw)
        chat = await _sync(
            lambda: client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
        )
        assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        client.close()
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20
        ) as aclient:
            with trio.fail_after(20):
                stream = await aclient.chat.completions.create(
                    model=MODEL, messages=MSGS, max_tokens=2, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
        seen = _seen(gw.engines[0])
        assert len(seen) == 2
        for b in seen:  # the validated messages as they are, one candidate, streamed
            assert b["messages"] == MSGS and b["model"] == MODEL
            assert b["n"] == 1 and b["stream"] is True
            assert b["stream_options"] == {"include_usage": True}
        # Ready though the engine has no /health (the probe fell back to /v1/models); no
        # other POST was made of it.
        paths = {p for p, _ in gw.engines[0].requests}
        assert paths <= {"/v1/models", "/v1/chat/completions"}


async def test_n4_streams_in_the_gateways_order() -> None:
    async with running_gateway(chat_only(), protocol="openai-chat") as gw:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 3, "n": 4, "stream": True,
                "seed": 5, "stream_options": {"include_usage": True}}  # fmt: skip
        with trio.fail_after(20):
            r = await gw.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        events = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        roles = [c["choices"][0]["index"] for c in chunks[:4]]
        assert roles == [0, 1, 2, 3]
        assert all(c["choices"][0]["delta"].get("role") == "assistant" for c in chunks[:4])
        finished: list[int] = []
        texts: dict[int, str] = {}
        for c in chunks[4:-1]:
            (choice,) = c["choices"]
            assert choice["index"] not in finished  # nothing after a choice's closure
            texts[choice["index"]] = texts.get(choice["index"], "") + (
                choice["delta"].get("content") or ""
            )
            if choice["finish_reason"] is not None:
                finished.append(choice["index"])
        assert sorted(finished) == [0, 1, 2, 3] and len(set(texts.values())) == 4
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
        seen = _seen(gw.engines[0])
        assert sorted(b["seed"] for b in seen) == [5, 6, 7, 8]  # one request per candidate


async def test_best_of_ranks_by_the_engines_chat_logprobs() -> None:
    async with running_gateway(chat_only(_by_seed), protocol="openai-chat") as gw:
        with trio.fail_after(20):
            r = await gw.chat(messages=MSGS, max_tokens=3, seed=100, best_of=3)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["message"]["content"] == "".join(default_tokens(102, 3)[0])
        assert choice["logprobs"] is None
        seen = _seen(gw.engines[0])
        assert all(b["logprobs"] is True for b in seen)
        with trio.fail_after(20):
            r = await gw.chat(messages=MSGS, max_tokens=3, logprobs=True, top_logprobs=2)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 3 and all(len(e["top_logprobs"]) == 2 for e in content)


def _tools_and_thinking(call: Call) -> Plan:
    args = {"name": "get_weather", "arguments": {"city": "Paris"}}
    return Plan(["<think>", "plan", "</think>", "Let me check.",
                 f"<tool_call>{json.dumps(args)}</tool_call>"])  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_the_engines_tool_calls_and_reasoning_reach_the_client(stream: bool) -> None:
    async with running_gateway(chat_only(_tools_and_thinking), protocol="openai-chat") as gw:
        client = _client(gw)

        def call(include: bool) -> Any:
            kw: dict[str, Any] = {"extra_body": {"include_reasoning": include}}
            if not stream:
                return client.chat.completions.create(
                    model=MODEL,
                    messages=MSGS,
                    tools=[WEATHER],
                    **kw,  # type: ignore[list-item]
                )
            with client.chat.completions.stream(
                model=MODEL,
                messages=MSGS,
                tools=[WEATHER],
                **kw,  # type: ignore[list-item]
            ) as s:
                for _ in s:
                    pass
                return s.get_final_completion()

        for include in (False, True):
            out = await _sync(lambda include=include: call(include))
            (choice,) = out.choices
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Let me check."
            (tc,) = choice.message.tool_calls
            assert tc.id == "call_fake_1" and tc.function.name == "get_weather"
            assert json.loads(tc.function.arguments) == {"city": "Paris"}
            reasoning = getattr(choice.message, "reasoning_content", None)
            assert reasoning == ("plan" if include else None)
        client.close()
        sent = _seen(gw.engines[0])[0]
        assert sent["tools"] == [WEATHER] and "include_reasoning" not in sent


async def test_images_pass_through_to_the_engine() -> None:
    content = [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": PNG}}]
    async with running_gateway(chat_only(), protocol="openai-chat") as gw:
        with trio.fail_after(20):
            r = await gw.chat(messages=[{"role": "user", "content": content}], max_tokens=2)
        assert r.status_code == 200, r.text
        assert _seen(gw.engines[0])[0]["messages"][0]["content"] == content


async def test_legacy_completions_still_go_to_v1_completions() -> None:
    engine = FakeEngine()
    async with running_gateway(engine, protocol="openai-chat") as gw:
        with trio.fail_after(20):
            r = await gw.client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 2}
            )
        assert r.status_code == 200, r.text
        assert [b["prompt"] for p, b in engine.requests if p == "/v1/completions"] == ["Once"]


async def test_conversations_sharing_an_opening_meet_on_one_replica() -> None:
    engines = [chat_only() for _ in range(4)]
    opening = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Q"}]
    async with running_gateway(engines, protocol="openai-chat") as gw:
        for turn in range(3):  # a conversation growing turn by turn
            messages = list(opening)
            for k in range(turn):
                messages += [{"role": "assistant", "content": "A"},
                             {"role": "user", "content": f"Q{k}"}]  # fmt: skip
            with trio.fail_after(20):
                r = await gw.chat(messages=messages, max_tokens=1)
            assert r.status_code == 200, r.text
        used = [e for e in engines if _seen(e)]
        assert len(used) == 1 and len(_seen(used[0])) == 3


async def test_langchain_chat_openai() -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    async with running_gateway(chat_only(), protocol="openai-chat") as gw:
        llm = langchain_openai.ChatOpenAI(
            model=MODEL, base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20,
            max_tokens=3,
        )  # fmt: skip
        reply = await _sync(lambda: llm.invoke("Say something."))
        assert reply.content
        pieces = await _sync(lambda: [c.content for c in llm.stream("Say something.")])
        assert "".join(pieces)
        batch = await _sync(lambda: llm.batch(["a", "b"], config={"max_concurrency": 2}))
        assert len(batch) == 2 and all(m.content for m in batch)


# ---------------------------------------------------------------- the setting, checked


def _settings(**model: Any) -> Settings:
    return Settings(models={MODEL: ModelSettings(**model)})


def test_render_defaults_and_refusals_name_the_key() -> None:
    openai_engine = [EngineSpec(url="http://127.0.0.1:1", protocol="openai")]
    ok = _settings(engines=openai_engine)
    check_settings(ok, "t")
    assert ok.models[MODEL].render_mode() == "engine"
    assert _settings(engines=["http://127.0.0.1:1"]).models[MODEL].render_mode() == "gateway"
    check_settings(_settings(engines=openai_engine, render="gateway", chat_template=TEMPLATE), "t")
    with pytest.raises(ConfigError, match=rf"`models\.{MODEL}\.render`.*tokenizer"):
        check_settings(_settings(engines=openai_engine, render="gateway"), "t")
    with pytest.raises(ConfigError, match=rf"`models\.{MODEL}\.render`.*protocol"):
        check_settings(_settings(engines=["http://127.0.0.1:1"], render="engine"), "t")
    with pytest.raises(ConfigError, match=rf"`models\.{MODEL}\.render`.*one of"):
        check_settings(_settings(engines=openai_engine, render="both"), "t")
