"""The official ``openai`` SDK against a running gateway in front of scripted fake engines.

The SDK is synchronous here (``openai.OpenAI``), so every call runs in a worker thread via
``trio.to_thread.run_sync`` while the gateway and the engines run on the test's trio loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import openai
import pytest
import trio

from engine.fake import Call, DefaultScript, FakeEngine, Plan, default_tokens
from sieproxy.settings.load import Settings

from .harness import MODEL, Gateway, running_gateway

T = TypeVar("T")
MSGS = [{"role": "user", "content": "Say something."}]


def _client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20)


async def _sync(fn: Callable[[], T], timeout: float = 20) -> T:
    with trio.fail_after(timeout):
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def _generates(engine: FakeEngine) -> list[dict[str, Any]]:
    return [b for p, b in engine.requests if p == "/generate"]


async def test_non_streaming_chat_and_completions() -> None:
    async with running_gateway() as gw:
        client = _client(gw)
        chat = await _sync(
            lambda: client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
        )
        assert chat.object == "chat.completion"
        assert chat.id.startswith("chatcmpl-")
        assert chat.model == MODEL
        assert len(chat.choices) == 1
        choice = chat.choices[0]
        assert choice.index == 0 and choice.finish_reason == "length"
        assert choice.message.role == "assistant" and choice.message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        assert chat.usage.total_tokens == chat.usage.prompt_tokens + 4

        cmpl = await _sync(
            lambda: client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
        )
        assert cmpl.object == "text_completion"
        assert cmpl.id.startswith("cmpl-")
        assert len(cmpl.choices) == 1 and cmpl.choices[0].text
        assert cmpl.choices[0].finish_reason == "length"
        assert cmpl.usage is not None and cmpl.usage.completion_tokens == 3

        # What the engine saw: one single-candidate /generate each, max_new_tokens forwarded.
        gens = _generates(gw.engines[0])
        assert [g["sampling_params"]["max_new_tokens"] for g in gens] == [4, 3]
        assert gens[1]["text"] == "Once upon"
        client.close()


async def test_streaming_n4_rebuilds_four_distinct_texts() -> None:
    async with running_gateway() as gw:
        client = _client(gw)

        def run() -> tuple[dict[int, str], dict[int, str | None], list[Any]]:
            texts: dict[int, str] = {}
            finish: dict[int, str | None] = {}
            chunks = list(
                client.chat.completions.create(
                    model=MODEL, messages=MSGS, max_tokens=5, n=4, stream=True
                )
            )
            for chunk in chunks:
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                    if c.finish_reason:
                        assert c.index not in finish, "closed twice"
                        finish[c.index] = c.finish_reason
            return texts, finish, chunks

        texts, finish, chunks = await _sync(run)
        assert sorted(texts) == [0, 1, 2, 3]
        assert all(texts.values())
        assert len(set(texts.values())) == 4, texts
        assert finish == dict.fromkeys(range(4), "length")
        # The first four chunks are the role chunks, in index order.
        assert [(ch.choices[0].index, ch.choices[0].delta.role) for ch in chunks[:4]] == [
            (i, "assistant") for i in range(4)
        ]
        assert len({ch.id for ch in chunks}) == 1
        # Each candidate was its own upstream request with its own rid, n never sent.
        gens = _generates(gw.engines[0])
        rid = chunks[0].id.removeprefix("chatcmpl-")
        assert sorted(g["rid"] for g in gens) == [f"{rid}-{i}" for i in range(4)]
        assert all("n" not in g["sampling_params"] for g in gens)
        client.close()


async def test_sdk_stream_helper_with_n2() -> None:
    # The helper refuses a "length" finish (LengthFinishReasonError): end on EOS instead.
    async with running_gateway(FakeEngine(DefaultScript(tokens=4))) as gw:
        client = _client(gw)

        def run() -> tuple[Any, list[str]]:
            events: list[str] = []
            with client.chat.completions.stream(
                model=MODEL, messages=MSGS, max_tokens=10, n=2
            ) as stream:
                for event in stream:
                    events.append(event.type)
                final = stream.get_final_completion()
            return final, events

        final, events = await _sync(run)
        assert "content.delta" in events and "chunk" in events
        assert len(final.choices) == 2
        assert [c.index for c in final.choices] == [0, 1]
        for c in final.choices:
            assert c.finish_reason == "stop"
            assert c.message.content
            assert c.message.role == "assistant"
        assert final.choices[0].message.content != final.choices[1].message.content
        client.close()


def _two_streamed_with_usage(client: openai.OpenAI) -> list[Any]:
    """A streamed chat of n = 2, 3 tokens each, with the usage chunk: every chunk."""
    return list(
        client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )


async def test_stream_options_include_usage() -> None:
    async with running_gateway() as gw:
        client = _client(gw)

        chunks = await _sync(lambda: _two_streamed_with_usage(client))
        usage_chunks = [c for c in chunks if c.usage is not None]
        assert len(usage_chunks) == 1
        last = chunks[-1]
        assert last is usage_chunks[0]
        assert last.choices == []
        assert last.usage is not None
        assert last.usage.completion_tokens == 6
        assert last.usage.total_tokens == last.usage.prompt_tokens + 6
        assert last.usage.prompt_tokens > 0
        assert all(c.usage is None for c in chunks[:-1])

        def cmpl() -> list[Any]:
            return list(
                client.completions.create(model=MODEL, prompt="Once", max_tokens=2, stream=True)
            )

        cchunks = await _sync(cmpl)
        assert "".join(c.choices[0].text for c in cchunks if c.choices)
        client.close()


# ---- best_of -----------------------------------------------------------------------------------

#: Per candidate index: (tokens, per-token logprobs, inter-token interval).
_BEST_OF = {
    0: ([f" zero{i}" for i in range(40)], [-0.5] * 40, 0.05),  # slow, worst: must be aborted
    1: ([" one-a", " one-b"], [-0.1, -0.1], 0.0),  # -0.2, best (ties with 3, lower index)
    2: ([" two-a", " two-b"], [-0.5, -0.5], 0.0),  # -1.0, loser
    3: ([" three-a", " three-b"], [-0.15, -0.05], 0.0),  # -0.2, second
}


def _best_of_script(call: Call) -> Plan:
    index = int(call.rid.rsplit("-", 1)[1])
    tokens, lps, itl = _BEST_OF[index]
    return Plan(tokens=tokens, logprobs=lps, itl=itl)


async def test_best_of_returns_top_n_by_cumulative_logprob() -> None:
    engine = FakeEngine(script=_best_of_script)
    async with running_gateway(engine) as gw:
        client = _client(gw)
        rid = "bestof-req-1"
        t0 = trio.current_time()
        result = await _sync(
            lambda: client.chat.completions.create(
                model=MODEL,
                messages=MSGS,
                n=2,
                max_tokens=50,
                extra_body={"best_of": 4},
                extra_headers={"X-Request-Id": rid},
            )
        )
        elapsed = trio.current_time() - t0
        assert result.id == f"chatcmpl-{rid}"
        assert [c.index for c in result.choices] == [0, 1]
        assert [c.message.content for c in result.choices] == [" one-a one-b", " three-a three-b"]
        assert all(c.finish_reason == "stop" for c in result.choices)
        # The client did not ask for logprobs: ranking needs them, the answer does not show them.
        assert all(c.logprobs is None for c in result.choices)
        # Usage counts the returned choices only.
        assert result.usage is not None and result.usage.completion_tokens == 4

        gens = _generates(engine)
        assert sorted(g["rid"] for g in gens) == [f"{rid}-{i}" for i in range(4)]
        assert all(g.get("return_logprob") is True for g in gens)
        # Candidate 0 could not win once 1 and 3 finished: it was aborted upstream, early.
        with trio.fail_after(5):
            await engine.wait_for(lambda: f"{rid}-0" in engine.aborts)
            await engine.wait_for(lambda: all(f"{rid}-{i}" in engine.outcomes for i in range(4)))
        assert elapsed < 1.5, f"best_of waited {elapsed:.2f}s for a loser that cannot win"
        assert engine.outcomes[f"{rid}-0"] in ("aborted", "cancelled")
        for i in (1, 2, 3):
            assert engine.outcomes[f"{rid}-{i}"] == "finished" or f"{rid}-{i}" in engine.aborts
        assert not engine.running
        client.close()


# ---- logprobs --------------------------------------------------------------------------------


def _check_logprob_entries(entries: list[Any], top: int) -> None:
    for e in entries:
        assert isinstance(e.token, str) and e.token
        assert isinstance(e.logprob, float) and e.logprob <= 0
        assert e.bytes == list(e.token.encode("utf-8"))
        assert len(e.top_logprobs) == top
        for alt in e.top_logprobs:
            assert isinstance(alt.token, str)
            assert alt.logprob <= 0
            assert alt.bytes == list(alt.token.encode("utf-8"))
        assert [a.logprob for a in e.top_logprobs] == sorted(
            (a.logprob for a in e.top_logprobs), reverse=True
        )


async def test_logprobs_with_top_logprobs() -> None:
    async with running_gateway() as gw:
        client = _client(gw)
        result = await _sync(
            lambda: client.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=3, logprobs=True, top_logprobs=2
            )
        )
        choice = result.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        entries = choice.logprobs.content
        assert len(entries) == 3
        _check_logprob_entries(entries, 2)
        assert "".join(e.token for e in entries) == choice.message.content
        # The chosen token is the top alternative in the fake engine's rows.
        assert all(e.top_logprobs[0].token == e.token for e in entries)
        gen = _generates(gw.engines[0])[0]
        assert gen["return_logprob"] is True and gen["top_logprobs_num"] == 2

        def streamed() -> tuple[str, list[Any]]:
            text = ""
            entries: list[Any] = []
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=MSGS,
                max_tokens=3,
                logprobs=True,
                top_logprobs=2,
                stream=True,
            ):
                for c in chunk.choices:
                    text += c.delta.content or ""
                    if c.logprobs is not None and c.logprobs.content:
                        entries += c.logprobs.content
            return text, entries

        text, sentries = await _sync(streamed)
        assert len(sentries) == 3
        _check_logprob_entries(sentries, 2)
        assert "".join(e.token for e in sentries) == text
        client.close()


# ---- stop strings enforced by the gateway ---------------------------------------------------


class NoStopEngine(FakeEngine):
    """An engine that ignores ``sampling_params.stop`` (emits the stop text, never trims it),
    so only the gateway's own stop enforcement can hide it."""

    def _make_call(self, *args: Any, **kwargs: Any) -> Call:
        call = super()._make_call(*args, **kwargs)
        return Call(
            path=call.path,
            body=call.body,
            rid=call.rid,
            prompt=call.prompt,
            prompt_tokens=call.prompt_tokens,
            max_new_tokens=call.max_new_tokens,
            stop=(),
            stream=call.stream,
            seed=call.seed,
            index=call.index,
        )


_STOP_TOKENS = ["Hel", "lo ST", "OP now", " and", " then", *[f" w{i}" for i in range(30)]]


def _stop_script(call: Call) -> Plan:
    return Plan(tokens=_STOP_TOKENS, itl=0.02)


async def test_stop_string_split_across_tokens_is_enforced() -> None:
    engine = NoStopEngine(script=_stop_script)
    async with running_gateway(engine) as gw:
        client = _client(gw)
        result = await _sync(
            lambda: client.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=50, stop=["STOP"]
            )
        )
        assert result.choices[0].message.content == "Hello "
        assert result.choices[0].finish_reason == "stop"
        gens = _generates(engine)
        assert gens[0]["sampling_params"]["stop"] == ["STOP"]  # forwarded all the same

        def streamed() -> tuple[str, list[str | None]]:
            text = ""
            reasons: list[str | None] = []
            for chunk in client.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=50, stop="STOP", stream=True
            ):
                for c in chunk.choices:
                    text += c.delta.content or ""
                    assert "ST" not in (c.delta.content or "") or "STOP" not in text
                    reasons.append(c.finish_reason)
            return text, reasons

        text, reasons = await _sync(streamed)
        assert text == "Hello "
        assert "STOP" not in text
        assert [r for r in reasons if r] == ["stop"]

        result = await _sync(
            lambda: client.completions.create(
                model=MODEL, prompt="x", max_tokens=50, stop=["OP n", "zzz"]
            )
        )
        assert result.choices[0].text == "Hello ST"
        assert result.choices[0].finish_reason == "stop"

        # The gateway cut the candidates short: upstream they were stopped, not run to the end.
        rids = [g["rid"] for g in _generates(engine)]
        assert len(rids) == 3
        with trio.fail_after(5):
            await engine.wait_for(lambda: all(r in engine.outcomes for r in rids))
        for r in rids:
            assert engine.outcomes[r] in ("aborted", "cancelled"), (r, engine.outcomes[r])
        client.close()


# ---- cached tokens -----------------------------------------------------------------------------


def _cached_script(call: Call) -> Plan:
    """The engine reports part of the prompt as served from its prefix cache; the candidates
    of one request report different figures (one found more cached than the other)."""
    texts, ids = default_tokens(call.seed, 3)
    index = int(call.rid.rsplit("-", 1)[1]) if call.rid.rsplit("-", 1)[1].isdigit() else 0
    return Plan(tokens=texts, token_ids=ids, prompt_tokens=40, cached_tokens=32 - 8 * index)


async def test_usage_carries_cached_tokens() -> None:
    async with running_gateway(FakeEngine(script=_cached_script)) as gw:
        client = _client(gw)
        chat = await _sync(
            lambda: client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
        )
        assert chat.usage is not None and chat.usage.prompt_tokens == 40
        assert chat.usage.prompt_tokens_details is not None
        assert chat.usage.prompt_tokens_details.cached_tokens == 32

        last = (await _sync(lambda: _two_streamed_with_usage(client)))[-1]
        assert last.usage is not None and last.usage.prompt_tokens == 40
        assert last.usage.prompt_tokens_details is not None
        assert last.usage.prompt_tokens_details.cached_tokens == 24  # once, not summed

        def one_stream() -> list[Any]:  # n = 1: its tokens take the express lane
            return list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=MSGS,
                    max_tokens=3,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )

        last = (await _sync(one_stream))[-1]
        assert last.usage is not None and last.usage.prompt_tokens_details is not None
        assert last.usage.prompt_tokens_details.cached_tokens == 32

        cmpl = await _sync(
            lambda: client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
        )
        assert cmpl.usage is not None and cmpl.usage.prompt_tokens_details is not None
        assert cmpl.usage.prompt_tokens_details.cached_tokens == 32
        client.close()


async def test_usage_cached_tokens_zero_when_the_engine_reports_none() -> None:
    async with running_gateway() as gw:
        client = _client(gw)
        chat = await _sync(
            lambda: client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
        )
        assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
        assert chat.usage.prompt_tokens_details.cached_tokens == 0
        client.close()

async def test_models_list_and_retrieve() -> None:
    """``client.models.retrieve`` gets OpenAI's model object; an unknown id is the SDK's
    ``NotFoundError`` with the error envelope naming ``model``."""
    async with running_gateway() as gw:
        client = _client(gw)
        listed = await _sync(lambda: client.models.list())
        assert [m.id for m in listed.data] == [MODEL]
        got = await _sync(lambda: client.models.retrieve(MODEL))
        assert (got.id, got.object, got.owned_by) == (MODEL, "model", "sieproxy")
        assert got.model_dump() == listed.data[0].model_dump()
        with pytest.raises(openai.NotFoundError) as caught:
            await _sync(lambda: client.models.retrieve("no-such-model"))
        err = caught.value.body
        assert isinstance(err, dict)
        assert err["param"] == "model" and err["code"] == "model_not_found"
        assert err["type"] == "invalid_request_error"
        assert "no-such-model" in err["message"] and "GET /v1/models" in err["message"]
        client.close()


async def test_model_ids_with_slashes_are_retrievable() -> None:
    """Hugging Face style ids (``org/name``) are one path segment too many for a plain route."""
    def rename(s: Settings) -> None:
        s.models = {"org/some-model": s.models[MODEL]}

    async with running_gateway(settings_hook=rename) as gw:
        resp = await gw.client.get("/v1/models/org/some-model")
        assert resp.status_code == 200, resp.text
        assert resp.json()["id"] == "org/some-model"
