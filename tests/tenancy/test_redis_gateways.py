"""Two gateways (as two processes would) sharing one Redis enforce one limit exactly, and
`sieproxy usage` reads what they recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from engine.fake import FakeEngine, Plan
from sieproxy.cli import main
from sieproxy.settings.load import Settings
from tests.shell.harness import MODEL, another_gateway, running_gateway
from tests.tenancy.conftest import RedisServer, key_line, write_keys

KEY = "sk-test-shared-canary-31c2"


async def test_two_gateways_share_one_limit_and_usage(
    tmp_path: Path, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    def hook(s: Settings) -> None:
        s.gateway.keys_file = str(write_keys(tmp_path / "k", key_line(KEY, "team-a", rpm=5)))
        s.gateway.redis_url = redis_server.url

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    headers = {"Authorization": f"Bearer {KEY}"}
    with trio.fail_after(60):
        engine = FakeEngine(script=lambda call: Plan(tokens=["a", "b"], prompt_tokens=4))
        async with running_gateway(engine, settings_hook=hook) as one, another_gateway(one) as two:
            statuses = []
            for i in range(12):
                gw = one if i % 2 else two
                r = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
                statuses.append(r.status_code)
            assert statuses.count(200) == 5 and statuses.count(429) == 7

            def recorded() -> float:  # each request is recorded just after its last byte
                return sum(
                    sample.value
                    for gw in (one, two)
                    for metric in gw.state.observer.tenant_requests.collect()
                    for sample in metric.samples
                    if sample.name.endswith("_total")
                )

            with trio.fail_after(10):
                while recorded() < 12:
                    await trio.sleep(0.01)
            for gw in (one, two):
                assert gw.state.tenancy.limiter.redis_up and not gw.state.tenancy.limiter.local
                with trio.fail_after(10):
                    while not await gw.state.tenancy.limiter.flush_usage():
                        await trio.sleep(0.05)
            metrics = (await one.client.get("/metrics")).text
            assert "sieproxy_tenant_redis_up 1.0" in metrics

    def usage() -> int:
        return main(["usage", "--redis-url", redis_server.url, "--since", "10m", "--json"])

    assert await trio.to_thread.run_sync(usage) == 0
    got = json.loads(capsys.readouterr().out)["tenants"]["team-a"]
    assert got == {
        "requests": 5,
        "prompt_tokens": 20,
        "completion_tokens": 10,
        "rejected_requests": 7,
    }
