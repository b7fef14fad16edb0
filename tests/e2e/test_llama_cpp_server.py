"""The gateway in front of an OpenAI-compatible server written by someone else: llama.cpp's, as
``llama-cpp-python`` serves it, on the default model's GGUF (``protocol = "openai"``,
docs/CONFIGURATION.md, "The OpenAI-compatible protocol"), in both renderings: the engine's own
(``render = "engine"``: chat to its ``/v1/chat/completions``) and the gateway's
(``render = "gateway"``: the gateway's template, the prompt to its ``/v1/completions``).

What the fake engine's OpenAI mode cannot prove is checked here against a real one: its
``/v1/completions`` stream as it really is (no ``/health``: the probe falls back to
``/v1/models``; no usage chunk unless asked; logprobs in the legacy shape), through the
``openai`` SDK, with the gateway's own template, fan-out, best_of ranking, stop strings and
usage. llama.cpp's server generates one request at a time, so the candidates of one request
queue there (``--interrupt_requests False``); the limits below leave room for that.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("llama_cpp.server.app")
openai = pytest.importorskip("openai")
import trio  # noqa: E402

from engine.cpu.model_store import resolve_model  # noqa: E402
from sieproxy.operations.serve import build_app, serve  # noqa: E402
from sieproxy.settings.load import EngineSpec, GatewaySettings, ModelSettings, Settings  # noqa: E402
from tests.procs import serve_gateway, stop_process  # noqa: E402

from .conftest import LLAMA_TIMEOUT, MODEL, llama_ready  # noqa: E402

pytestmark = pytest.mark.model


class Gateway:
    def __init__(self, url: str, state: object) -> None:
        self.url = url
        self.state = state


@contextlib.asynccontextmanager
async def _gateway(engine: str, render: str) -> AsyncIterator[Gateway]:
    # The engine first: idle again after the previous test (its answer is the readiness).
    assert await trio.to_thread.run_sync(llama_ready, engine), "llama.cpp server is gone"
    # Candidates of one request queue at llama.cpp's server (one generation at a time), and a
    # health check waits there behind them: the limits are guards for a loaded machine.
    settings = Settings(
        gateway=GatewaySettings(
            host="127.0.0.1", port=0, access_log=False, token_gap_timeout=LLAMA_TIMEOUT,
            admission_wait=LLAMA_TIMEOUT, health_timeout=LLAMA_TIMEOUT,
        ),
        models={
            MODEL: ModelSettings(
                engines=[EngineSpec(url=engine, protocol="openai")],
                render=render,
                # Gateway rendering needs the model's template here.
                tokenizer=str(resolve_model("default")) if render == "gateway" else None,
            )
        },
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        app = build_app(settings)
        stop = trio.Event()
        binds = await nursery.start(partial(serve, settings, shutdown_trigger=stop, app=app))
        state = app.extensions["sieproxy"]
        with trio.fail_after(LLAMA_TIMEOUT):  # until the gateway's first health check passed
            while not state.pools[MODEL].any_ready():
                await trio.sleep(0.05)
        yield Gateway(binds[0], app.extensions["sieproxy"])
        stop.set()
        nursery.cancel_scope.cancel()


@pytest.fixture(params=["engine", "gateway"])
async def gw(llama_server: str, request: pytest.FixtureRequest) -> AsyncIterator[Gateway]:
    async with _gateway(llama_server, request.param) as g:
        yield g


QUESTION = [{"role": "user", "content": "Name three colours."}]


async def test_the_openai_sdk_sync_and_async_through_llama_cpp(gw: Gateway) -> None:
    def sync_calls() -> tuple[object, object]:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16)
        text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8)
        return chat, text

    chat, text = await trio.to_thread.run_sync(sync_calls)
    assert chat.choices[0].message.content  # type: ignore[attr-defined]
    assert chat.choices[0].finish_reason in ("stop", "length")  # type: ignore[attr-defined]
    # Without a usage chunk from the engine, the gateway's own count (docs/CONFIGURATION.md).
    usage = chat.usage  # type: ignore[attr-defined]
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert text.choices[0].text and text.usage.completion_tokens <= 8  # type: ignore[attr-defined]

    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    async with client.chat.completions.stream(  # a stop string: the helper refuses "length"
        model=MODEL, messages=QUESTION, max_tokens=64, n=2, stop=[".", "\n"]
    ) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    assert sorted(c.index for c in final.choices) == [0, 1]
    assert all(c.finish_reason == "stop" for c in final.choices)


async def test_n_4_streams_in_the_contracts_order(gw: Gateway) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 6, "n": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with httpx.AsyncClient(base_url=gw.url, timeout=LLAMA_TIMEOUT) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    events = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finished: list[int] = []
    for raw in events[:-2]:
        for choice in httpx.Response(200, content=raw).json()["choices"]:
            assert choice["index"] not in finished  # nothing after a choice's finish
            if choice["finish_reason"] is not None:
                finished.append(choice["index"])
    assert sorted(finished) == [0, 1, 2, 3]
    usage = httpx.Response(200, content=events[-2]).json()["usage"]
    assert usage["completion_tokens"] >= 4  # the four candidates' (no prompt count: above)


async def test_best_of_ranks_by_llama_cpps_logprobs_and_a_stop_string_cuts(gw: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gw.url, timeout=LLAMA_TIMEOUT) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": QUESTION, "max_tokens": 8, "best_of": 3,
                  "temperature": 1.0, "seed": 7, "logprobs": True},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        assert choice["logprobs"]["content"]  # llama.cpp's logprobs, which ranked it
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 16, "stop": ["7"],
                  "temperature": 0},
        )  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "7" not in choice["text"] and re.search(r"5", choice["text"]), choice
    assert choice["finish_reason"] == "stop"


ABORTED = re.compile(r'sieproxy_upstream_aborts_total\{[^}]*cause="client"[^}]*\} 1\.0')


async def test_a_client_that_leaves_closes_the_upstream_connection(gw: Gateway) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    async with (
        httpx.AsyncClient(base_url=gw.url, timeout=LLAMA_TIMEOUT) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        async for _ in r.aiter_lines():
            break  # the first event: then the client leaves
    async with httpx.AsyncClient(base_url=gw.url, timeout=LLAMA_TIMEOUT) as client:
        with trio.fail_after(LLAMA_TIMEOUT):  # counted once its connection was closed (the abort)
            while not ABORTED.search((await client.get("/metrics")).text):
                await trio.sleep(0.1)
        # The engine is free again: llama.cpp serves one request at a time.
        r = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        )
    assert r.status_code == 200, r.text


def test_serve_engine_flag_fronts_llama_cpps_server(llama_server: str, tmp_path: Path) -> None:
    """``sieproxy serve --engine URL/v1``, no configuration file: the gateway finds an
    OpenAI-compatible server (no ``/model_info``; ``/v1/models`` lists ``smol``), serves the
    model under that id and passes chat through to it (``render = "engine"``)."""
    proc, url = serve_gateway(tmp_path, "--engine", llama_server + "/v1", timeout=LLAMA_TIMEOUT)
    try:
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=LLAMA_TIMEOUT)
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4
        )
        assert r.choices[0].message.content and r.usage and r.usage.completion_tokens <= 4
    finally:
        stop_process(proc)
