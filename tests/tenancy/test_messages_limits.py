"""Tenant limits on the Messages routes: the key (``x-api-key`` or ``Authorization``) names the
tenant, its limits are the ones chat's requests count against, and a refusal is Anthropic's
``rate_limit_error`` envelope with ``Retry-After`` and the ``anthropic-ratelimit-*`` headers
(also on successful answers), which the ``anthropic`` SDK raises as ``RateLimitError``."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import trio

from engine.fake import FakeEngine
from tests.shell.harness import MODEL, Gateway, running_gateway
from tests.tenancy.test_limits_http import KEY, OTHER, Clock, chat, keyed, settled, two_tokens

PATH = "/v1/messages"
USER = [{"role": "user", "content": "hi"}]


async def messages(gw: Gateway, headers: dict[str, str], **body: Any) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 10, "messages": USER, **body}
    return await gw.client.post(PATH, json=body, headers=headers)


def reset_at(clock: Clock, seconds: float) -> str:
    return datetime.fromtimestamp(math.ceil(clock.now + seconds), UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )


async def test_a_keys_limits_apply_to_messages_with_anthropics_429(tmp_path: Path) -> None:
    clock = Clock()
    with trio.fail_after(30):
        engine = FakeEngine(script=two_tokens)
        async with running_gateway(
            engine, settings_hook=keyed(tmp_path / "k", rpm=3, tpm=1000)
        ) as gw:
            gw.state.tenancy.limiter.clock = clock
            first = await messages(gw, {"x-api-key": KEY})
            assert first.status_code == 200, first.text
            h = first.headers
            assert h["anthropic-ratelimit-requests-limit"] == "3"
            assert h["anthropic-ratelimit-requests-remaining"] == "2"
            assert h["anthropic-ratelimit-requests-reset"] == reset_at(clock, 20)
            assert h["anthropic-ratelimit-tokens-limit"] == "1000"
            assert int(h["anthropic-ratelimit-tokens-remaining"]) < 1000 - 10
            assert not any(k.startswith("x-ratelimit-") for k in h)
            await settled(gw)
            # the same tenant through Authorization, and through chat: one set of limits
            streamed = await messages(gw, {"Authorization": f"Bearer {KEY}"}, stream=True)
            assert streamed.status_code == 200
            assert streamed.headers["anthropic-ratelimit-requests-remaining"] == "1"
            assert (await chat(gw)).status_code == 200
            await settled(gw)
            for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
                refused = await messages(gw, headers, stream=True)
                assert refused.status_code == 429
                assert refused.headers["content-type"].startswith("application/json")
                body = refused.json()
                assert body["type"] == "error" and set(body) == {"type", "error"}
                assert body["error"]["type"] == "rate_limit_error"
                assert "requests per minute (3)" in body["error"]["message"]
                h = refused.headers
                assert h["Retry-After"] == "20"
                assert h["anthropic-ratelimit-requests-remaining"] == "0"
                assert h["anthropic-ratelimit-requests-reset"] == reset_at(clock, 60)
                assert not any(k.startswith("x-ratelimit-") for k in h)
                assert KEY not in refused.text
            # count_tokens counts against the same limits, in the same envelope
            r = await gw.client.post(
                PATH + "/count_tokens", json={"model": MODEL, "messages": USER},
                headers={"x-api-key": KEY},
            )  # fmt: skip
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            clock.now += 20  # exactly Retry-After after the refusal
            assert (await messages(gw, {"x-api-key": KEY})).status_code == 200
            # a model the key may not use: Anthropic's not-found, as for an unknown model
            r = await messages(gw, {"x-api-key": OTHER})
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("limit", ["requests", "tokens"])
async def test_the_anthropic_sdk_raises_rate_limit_error(tmp_path: Path, limit: str) -> None:
    clock = Clock()
    limits = {"rpm": 1} if limit == "requests" else {"tpm": 100}
    with trio.fail_after(30):
        async with running_gateway(
            FakeEngine(script=two_tokens), settings_hook=keyed(tmp_path / "k", **limits)
        ) as gw:
            gw.state.tenancy.limiter.clock = clock
            client = anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=20)
            ok = await messages(gw, {"x-api-key": KEY}, max_tokens=80)  # spends the budget
            assert ok.status_code == 200
            await settled(gw)

            def create() -> Any:
                return client.messages.create(model=MODEL, max_tokens=80, messages=USER)

            with pytest.raises(anthropic.RateLimitError) as caught:
                await trio.to_thread.run_sync(create, abandon_on_cancel=True)
            err = caught.value
            assert err.status_code == 429
            assert err.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
            assert int(err.response.headers["retry-after"]) >= 1
