"""Sampling defaults on the real model: a request that leaves temperature and top_p unset is
sampled at the model's defaults (SmolLM2: 0.2 / 0.9), and explicit values win."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from .conftest import MODEL, CpuGateway

pytestmark = pytest.mark.model


async def _text(gw: CpuGateway, **sampling: Any) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
        "max_tokens": 24,
        "seed": 7,
        **sampling,
    }
    with trio.fail_after(120):
        r = await gw.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


async def test_unset_temperature_uses_the_model_default(gw: CpuGateway) -> None:
    info = (await gw.client.get(gw.engine.url + "/model_info")).json()
    assert info["preferred_sampling_params"] == {"temperature": 0.2, "top_p": 0.9}
    unset = await _text(gw)
    assert unset == await _text(gw, temperature=0.2, top_p=0.9)  # same seed, same draws
    assert unset != await _text(gw, temperature=1.5, top_p=1.0)  # an explicit value wins
