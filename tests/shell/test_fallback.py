"""Fallbacks before the first byte (sieproxy/relay/fallback.py): another model or another pool takes
a request its model cannot serve, never once a byte of the answer has gone out.

Two scripted fake engines behind a real gateway: engine 0 serves ``MODEL``, engine 1 serves
``OTHER`` (or, for pool fallbacks, both serve ``MODEL`` in two pools).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from engine.fake import DefaultScript, FakeEngine, Fault, Plan, SequenceScript
from sieproxy.settings.load import EngineSpec, FallbackSpec, Settings

from .harness import MODEL, Gateway, no_resumes, running_gateway, sse_events
from .test_health import Switch, chat, gen_rids, sample, scrape, served_by, wait_until

OTHER = "other-model"


def two_models(settings: Settings) -> None:
    """Engine 0 serves MODEL, engine 1 serves OTHER; MODEL falls back to OTHER."""
    m = settings.models[MODEL]
    first, *rest = m.engines
    settings.models[OTHER] = type(m)(
        engines=rest, chat_template=m.chat_template, inputs=list(m.inputs), render=m.render
    )
    m.engines = [first]
    m.fallbacks = [OTHER]


def ready(gw: Gateway, model: str) -> bool:
    return gw.state.pools[model].any_ready()


def fallbacks(metrics: dict[Any, float], cause: str) -> float | None:
    return sample(metrics, "sieproxy_fallbacks_total", model=MODEL, cause=cause)


async def test_no_ready_replica_falls_back_to_the_other_model_on_every_surface() -> None:
    engines = [FakeEngine(healthy=False), FakeEngine()]
    with trio.fail_after(30):
        async with running_gateway(engines, settings_hook=two_models, wait_ready=False) as gw:
            await wait_until(lambda: ready(gw, OTHER))
            r = await chat(gw)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == OTHER
            assert served_by(gw, r.headers["x-request-id"]) == [1]

            r = await chat(gw, stream=True)
            assert r.status_code == 200, r.text
            events = [e for e in sse_events(r.text) if e != "[DONE]"]
            assert events and {e["model"] for e in events} == {OTHER}

            r = await gw.client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}
            )
            assert r.status_code == 200, r.text
            assert r.json()["model"] == OTHER

            r = await gw.client.post(
                "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3}
            )
            assert r.status_code == 200, r.text
            assert r.json()["model"] == OTHER

            assert gen_rids(engines[0]) == []
            metrics = await scrape(gw)
            assert fallbacks(metrics, "no_replica") == 4
            assert fallbacks(metrics, "full") == 0  # exported from the start
            assert sample(metrics, "sieproxy_fallbacks_total", model=OTHER, cause="full") is None
            # The request counts under the model that served it.
            assert (
                sample(
                    metrics, "sieproxy_requests_total", endpoint="chat", model=OTHER, status="200"
                )
                == 2
            )


async def test_without_fallbacks_no_ready_replica_stays_a_503() -> None:
    def hook(s: Settings) -> None:
        two_models(s)
        s.models[MODEL].fallbacks = []

    engines = [FakeEngine(healthy=False), FakeEngine()]
    with trio.fail_after(30):
        async with running_gateway(engines, settings_hook=hook, wait_ready=False) as gw:
            await wait_until(lambda: ready(gw, OTHER))
            r = await chat(gw)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "model_loading"
            assert "retry-after" in r.headers


async def test_full_past_admission_wait_falls_back() -> None:
    slow = SequenceScript([Plan(tokens=[" a"] * 3, itl=0.5)])
    engines = [FakeEngine(slow), FakeEngine()]
    with trio.fail_after(30):
        async with running_gateway(
            engines, settings_hook=two_models, replica_max_inflight=1, admission_wait=0.2
        ) as gw:
            async with trio.open_nursery() as nursery:
                first: list[Any] = []

                async def long() -> None:
                    first.append(await chat(gw, request_id="long"))

                nursery.start_soon(long)
                await engines[0].wait_for(lambda: bool(engines[0].running))
                started = trio.current_time()
                r = await chat(gw, request_id="spill")
                waited = trio.current_time() - started
                assert r.status_code == 200, r.text
                assert r.json()["model"] == OTHER
                assert served_by(gw, "spill") == [1]
                assert waited >= 0.2  # the primary's admission wait came first
            assert first[0].status_code == 200 and first[0].json()["model"] == MODEL
            assert fallbacks(await scrape(gw), "full") == 1


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_failing_before_any_byte_falls_back(n: int, stream: bool) -> None:
    failing = Switch()
    failing.fault = Fault.http_error(500)
    engines = [FakeEngine(failing), FakeEngine()]
    with trio.fail_after(30):
        async with running_gateway(engines, settings_hook=two_models) as gw:
            r = await chat(gw, n=n, stream=stream, request_id=f"f{n}{stream}")
            assert r.status_code == 200, r.text
            if stream:
                events = [e for e in sse_events(r.text) if e != "[DONE]"]
                assert {e["model"] for e in events} == {OTHER}
                assert not any("error" in e for e in events)
            else:
                assert r.json()["model"] == OTHER
                assert len(r.json()["choices"]) == n
            assert served_by(gw, f"f{n}{stream}") == [0, 1]  # tried on 0, served by 1
            assert fallbacks(await scrape(gw), "failed") == 1


def two_models_no_resumes(settings: Settings) -> None:
    """:func:`two_models` with ``max_resumes = 0``: a break after output is the answer's
    error (with resumes, the default, it continues: test_resume.py)."""
    two_models(settings)
    no_resumes(settings)


async def test_engine_failing_after_the_first_byte_is_an_sse_error_not_a_fallback() -> None:
    script = SequenceScript([Plan(tokens=[" a", " b", " c", " d"], fault=Fault.reset(at=2))])
    engines = [FakeEngine(script), FakeEngine()]
    with trio.fail_after(30):
        async with running_gateway(engines, settings_hook=two_models_no_resumes) as gw:
            r = await chat(gw, stream=True, max_tokens=4, request_id="mid")
            assert r.status_code == 200
            events = [e for e in sse_events(r.text) if e != "[DONE]"]
            assert "error" in events[-1], events
            assert {e["model"] for e in events[:-1]} == {MODEL}
            text = "".join(
                e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
            )
            assert text == " a b"
            assert gen_rids(engines[1]) == []
            metrics = await scrape(gw)
            assert fallbacks(metrics, "failed") == 0


async def test_a_non_streaming_answer_failing_midway_is_an_error_not_a_fallback() -> None:
    """Not streamed, nothing reached the client yet, but the engine's output reached the
    response: the failure is the answer's status, not a move to the fallback."""
    script = SequenceScript([Plan(tokens=[" a", " b", " c", " d"], fault=Fault.reset(at=2))])
    engines = [FakeEngine(script), FakeEngine()]
    with trio.fail_after(30):
        async with running_gateway(engines, settings_hook=two_models_no_resumes) as gw:
            r = await chat(gw, max_tokens=4, request_id="mid")
            assert r.status_code == 502, r.text
            assert gen_rids(engines[1]) == []
            assert fallbacks(await scrape(gw), "failed") == 0


async def test_a_client_error_is_not_a_fallback() -> None:
    failing = Switch()
    failing.fault = Fault.http_error(400, "bad request")
    engines = [FakeEngine(failing), FakeEngine()]
    with trio.fail_after(30):
        async with running_gateway(engines, settings_hook=two_models) as gw:
            r = await chat(gw)
            assert r.status_code == 400, r.text
            assert gen_rids(engines[1]) == []


async def test_pool_fallback_keeps_the_model() -> None:
    """Engine 0 is in pool-0, engine 1 in pool-1; a request pinned to pool-0 falls back to
    pool-1 of the same model when pool-0 has no ready replica."""

    def hook(s: Settings) -> None:
        s.models[MODEL].fallbacks = [FallbackSpec(pool="pool-1")]

    engines = [FakeEngine(healthy=False), FakeEngine()]
    with trio.fail_after(30):
        async with running_gateway(engines, settings_hook=hook) as gw:
            r = await chat(gw, headers={"X-SIE-Pool": "pool-0"}, request_id="pinned")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == MODEL
            assert served_by(gw, "pinned") == [1]
            assert fallbacks(await scrape(gw), "no_replica") == 1


async def test_a_fallback_that_cannot_take_the_request_is_skipped() -> None:
    """OTHER has no image input: an image request for MODEL skips it and gets MODEL's 503;
    a later target in the chain that can take it serves it."""

    def hook(s: Settings) -> None:
        two_models(s)
        s.models[OTHER].inputs = ["text"]
        third = EngineSpec(url=s.models[OTHER].engines[0].url)  # type: ignore[union-attr]
        s.models["third"] = type(s.models[MODEL])(
            engines=[third], chat_template=s.models[MODEL].chat_template, inputs=["text", "image"]
        )

    png = (
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
        "YPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
    )
    content = [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": png}}]
    engines = [FakeEngine(healthy=False), FakeEngine()]
    with trio.fail_after(30):
        async with running_gateway(engines, settings_hook=hook, wait_ready=False) as gw:
            await wait_until(lambda: ready(gw, OTHER) and ready(gw, "third"))
            msgs = [{"role": "user", "content": content}]
            r = await chat(gw, messages=msgs)
            assert r.status_code == 503, r.text
            gw.state.settings.models[MODEL].fallbacks = [OTHER, "third"]
            r = await chat(gw, messages=msgs)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "third"


async def test_fallback_chain_follows_the_fallbacks_own_fallbacks() -> None:
    def hook(s: Settings) -> None:
        two_models(s)
        s.models[OTHER].fallbacks = ["third"]
        third = EngineSpec(url=s.models[OTHER].engines[0].url)  # type: ignore[union-attr]
        s.models["third"] = type(s.models[MODEL])(
            engines=[third], chat_template=s.models[MODEL].chat_template
        )
        s.models[OTHER].engines = [EngineSpec(url="http://127.0.0.1:9")]  # never ready

    engines = [FakeEngine(healthy=False), FakeEngine(DefaultScript())]
    with trio.fail_after(30):
        async with running_gateway(engines, settings_hook=hook, wait_ready=False) as gw:
            await wait_until(lambda: ready(gw, "third"))
            r = await chat(gw)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "third"
