"""The gateway in front of an OpenAI-compatible engine (``protocol = "openai"``,
``core.upstream.openai``): the fake engine's ``/v1/completions`` mode, with the same scripts and
faults as its native ``/generate``. The fault matrix and the disconnect tests run through both
protocols in ``test_faults``; this module has what is the OpenAI protocol's own."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio

from engine.fake import Call, DefaultScript, FakeEngine, Plan, default_tokens
from sieproxy.core.errors import EngineHTTPError
from sieproxy.fleet.client import EngineClient

from .harness import MODEL, running_gateway
from .test_openai_sdk import MSGS, _client, _sync


def _upstream(engine: FakeEngine) -> list[dict[str, Any]]:
    return [b for p, b in engine.requests if p == "/v1/completions"]


async def test_sdk_sync_and_async_through_the_openai_protocol() -> None:
    async with running_gateway(protocol="openai") as gw:
        client = _client(gw)
        chat = await _sync(
            lambda: client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
        )
        assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        cmpl = await _sync(
            lambda: client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
        )
        assert cmpl.choices[0].text and cmpl.usage is not None
        assert cmpl.usage.completion_tokens == 3
        client.close()
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20
        ) as aclient:
            with trio.fail_after(20):
                again = await aclient.chat.completions.create(
                    model=MODEL, messages=MSGS, max_tokens=2
                )
        assert again.usage is not None and again.usage.completion_tokens == 2
        # What the engine saw: the planned prompt on /v1/completions, one streamed n = 1
        # request each, usage asked for, no rid and nothing on /generate or /abort_request.
        seen = _upstream(gw.engines[0])
        assert len(seen) == 3, [p for p, _ in gw.engines[0].requests]
        assert [b["max_tokens"] for b in seen] == [4, 3, 2]
        assert seen[1]["prompt"] == "Once upon"
        for b in seen:
            assert b["n"] == 1 and b["stream"] is True and b["model"] == MODEL
            assert b["stream_options"] == {"include_usage": True}
            assert "rid" not in b and "sampling_params" not in b
        assert not [p for p, _ in gw.engines[0].requests if p in ("/generate", "/abort_request")]


async def test_n4_streaming_order_and_the_stream_helper_with_n2() -> None:
    async with running_gateway(FakeEngine(DefaultScript(tokens=4)), protocol="openai") as gw:
        client = _client(gw)
        chunks = await _sync(
            lambda: list(
                client.chat.completions.create(
                    model=MODEL, messages=MSGS, max_tokens=3, n=4, stream=True
                )
            )
        )
        assert [(ch.choices[0].index, ch.choices[0].delta.role) for ch in chunks[:4]] == [
            (i, "assistant") for i in range(4)
        ]
        texts: dict[int, str] = {}
        for ch in chunks:
            for c in ch.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        assert sorted(texts) == [0, 1, 2, 3] and len(set(texts.values())) == 4
        assert len(_upstream(gw.engines[0])) == 4  # one upstream request per candidate

        def helper() -> Any:
            with client.chat.completions.stream(
                model=MODEL, messages=MSGS, max_tokens=10, n=2
            ) as stream:
                for _ in stream:
                    pass
                return stream.get_final_completion()

        final = await _sync(helper)
        assert [c.index for c in final.choices] == [0, 1]
        assert all(c.finish_reason == "stop" and c.message.content for c in final.choices)
        client.close()


def _ranked_script(call: Call) -> Plan:
    # Candidate 2 (seed 102) is the likeliest: its tokens' logprobs are the highest.
    seed = call.body.get("seed", call.body.get("sampling_params", {}).get("sampling_seed"))
    tokens, ids = default_tokens(int(seed or 0), 3)
    lp = -0.1 if seed == 102 else -2.0
    return Plan(tokens=tokens, token_ids=ids, logprobs=[lp] * 3)


async def test_best_of_ranks_by_the_upstream_logprobs() -> None:
    async with running_gateway(FakeEngine(_ranked_script), protocol="openai") as gw:
        client = _client(gw)
        out = await _sync(
            lambda: client.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=3, seed=100, extra_body={"best_of": 3}
            )
        )
        seen = _upstream(gw.engines[0])
        assert sorted(b["seed"] for b in seen) == [100, 101, 102]
        assert all(b["logprobs"] == 0 for b in seen)  # ranking needs them; not shown
        assert out.choices[0].message.content == "".join(default_tokens(102, 3)[0])
        assert out.choices[0].logprobs is None
        assert out.usage is not None and out.usage.completion_tokens == 3
        client.close()


@pytest.mark.parametrize("protocol", ["sglang", "openai"])
async def test_best_of_from_an_engine_without_logprobs_is_a_400(protocol: str) -> None:
    """An engine that accepts ``logprobs`` and returns none cannot rank ``best_of``: a 400
    naming ``best_of``, not candidates ranked by chance; every candidate's generation ends."""
    engine = FakeEngine(_ranked_script)
    engine.returns_logprobs = False
    async with running_gateway(engine, protocol=protocol) as gw:
        for extra in ({"best_of": 3}, {"best_of": 3, "n": 2, "logprobs": True}):
            r = await gw.chat(model=MODEL, messages=MSGS, max_tokens=3, seed=100, **extra)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "best_of" and err["code"] == "invalid_request", err
            assert "returns no logprobs" in err["message"], err
            with trio.fail_after(10):
                await engine.wait_for(lambda: not engine.running)
        # Without best_of nothing needs ranking: the answer comes, with no logprobs to show.
        r = await gw.chat(model=MODEL, messages=MSGS, max_tokens=3, logprobs=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"] == {"content": []}
        engine.returns_logprobs = True  # the same request ranks once the logprobs come
        r = await gw.chat(model=MODEL, messages=MSGS, max_tokens=3, seed=100, best_of=3)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "".join(default_tokens(102, 3)[0])


@pytest.mark.parametrize("stream", [False, True])
async def test_images_are_refused_for_an_openai_engine(stream: bool) -> None:
    png = (
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
        "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
    )
    content = [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": png}}]
    async with running_gateway(protocol="openai") as gw:
        r = await gw.chat(
            model=MODEL, messages=[{"role": "user", "content": content}], stream=stream
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "image" in err["message"]
        assert not gw.engines[0].requests or all(
            p != "/v1/completions" for p, _ in gw.engines[0].requests
        )


async def test_a_model_without_a_template_is_engine_rendered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An OpenAI engine has no ``/model_info`` to discover a template from: a model without one
    renders on the engine (the default for these engines) and opens once its replica is ready;
    asking for gateway rendering without a template is refused at start (``test_openai_chat``)
    instead of a generic prompt the model was never trained on."""

    async def no_info(self: Any, base: str) -> dict[str, Any]:  # as vLLM or llama.cpp answer
        raise EngineHTTPError("The engine has no such endpoint.", engine_status=404)

    monkeypatch.setattr(EngineClient, "model_info", no_info)
    monkeypatch.setattr(EngineClient, "server_info", no_info)

    def no_template(s: Any) -> None:
        for m in s.models.values():
            m.chat_template = None
            m.render = None  # the default

    async with running_gateway(protocol="openai", settings_hook=no_template) as gw:
        assert gw.state.pools[MODEL].gate_open
        r = await gw.client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        chats = [b for p, b in gw.engines[0].requests if p == "/v1/chat/completions"]
        assert chats[0]["messages"] == MSGS and not _upstream(gw.engines[0])
