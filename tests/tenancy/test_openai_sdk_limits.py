"""The `openai` SDK against a limited key: a 429 it understands, its own retry, then success."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
import trio

from engine.fake import FakeEngine, Plan
from sieproxy.core.tenancy.quota import Bucket, TenantCounters
from sieproxy.settings.load import Settings
from tests.shell.harness import MODEL, running_gateway
from tests.tenancy.conftest import key_line, write_keys

KEY = "sk-test-sdk-canary-77aa"
MSGS = [{"role": "user", "content": "hi"}]


async def test_sdk_gets_429_retries_after_retry_after_and_succeeds(tmp_path: Path) -> None:
    def hook(s: Settings) -> None:
        s.gateway.keys_file = str(write_keys(tmp_path / "k", key_line(KEY, "team-a", rpm=120)))

    engine = FakeEngine(script=lambda call: Plan(tokens=["ok"]))
    async with running_gateway(engine, settings_hook=hook) as gw:
        # the tenant's requests are used up (two come back each second)
        gw.state.tenancy.limiter.local["team-a"] = TenantCounters(requests=Bucket(0.0, time.time()))
        url = gw.url + "/v1"

        def no_retry() -> openai.RateLimitError:
            client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=20)
            with pytest.raises(openai.RateLimitError) as exc:
                client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5)  # type: ignore[arg-type]
            return exc.value

        with trio.fail_after(30):
            err = await trio.to_thread.run_sync(no_retry)
        assert err.status_code == 429 and err.code == "rate_limit_exceeded"
        assert err.response.headers["retry-after"] == "1"
        assert err.response.headers["x-ratelimit-limit-requests"] == "120"
        assert KEY not in err.response.text
        gw.state.tenancy.limiter.local["team-a"] = TenantCounters(requests=Bucket(0.0, time.time()))

        def with_retry() -> tuple[openai.types.chat.ChatCompletion, dict[str, str], float]:
            client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=2, timeout=20)
            t0 = time.monotonic()
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=MSGS,  # type: ignore[arg-type]
                max_tokens=5,
            )
            return raw.parse(), dict(raw.headers), time.monotonic() - t0

        with trio.fail_after(30):
            done, headers, took = await trio.to_thread.run_sync(with_retry)
        assert done.choices[0].message.content == "ok"
        assert took >= 0.9  # it waited the Retry-After before its retry
        assert headers["x-ratelimit-limit-requests"] == "120"
        assert int(headers["x-ratelimit-remaining-requests"]) >= 0
        assert headers["x-ratelimit-reset-requests"].endswith(("s", "ms"))
        statuses = [s for s in gw.state.observer.tenant_requests._metrics]
        assert ("team-a", "429") in statuses and ("team-a", "200") in statuses
