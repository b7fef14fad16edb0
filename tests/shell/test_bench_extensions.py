"""What benchmark tools (guidellm, ``vllm bench serve``, AIPerf) send, through the gateway:
``GET /health``, ``ignore_eos`` and ``stream_options.continuous_usage_stats`` (SIE extensions,
docs/API.md), on chat and legacy completions, in both engine protocols."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from engine.fake import DefaultScript, FakeEngine

from .harness import MODEL, running_gateway


def _events(text: str) -> list[Any]:
    out = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]]


async def test_health_is_an_alias_of_healthz() -> None:
    async with running_gateway() as gw:
        with trio.fail_after(20):
            a, b = await gw.client.get("/health"), await gw.client.get("/healthz")
        assert a.status_code == b.status_code == 200 and a.json() == b.json()


@pytest.mark.parametrize("protocol", ["sglang", "openai"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_what_guidellm_sends_is_served(protocol: str, path: str) -> None:
    engine = FakeEngine(DefaultScript(tokens=8))
    body: dict[str, Any] = {
        "model": MODEL, "max_tokens": 5, "stop": None, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    if path == "/v1/completions":
        body["prompt"] = "Once upon a time"
    else:
        body["messages"] = [{"role": "user", "content": "Once upon a time"}]
    async with running_gateway(engine, protocol=protocol) as gw:
        with trio.fail_after(20):
            r = await gw.client.post(path, json=body)
        assert r.status_code == 200, r.text
        chunks = _events(r.text)
        assert all(c["usage"] is not None for c in chunks)  # the running usage on each
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0
        (_, sent), *_ = [(p, b) for p, b in engine.requests if p != "/abort_request"]
        if protocol == "sglang":
            assert sent["sampling_params"]["ignore_eos"] is True
        else:
            assert sent["ignore_eos"] is True
