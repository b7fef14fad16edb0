"""Tenant limits on the generation routes (per process): 429 with OpenAI's headers and a
truthful Retry-After, 400 for a request that can never fit, 404 for a model the key may not use,
concurrency at once, reserve and settle for whole, streamed, cancelled and failed requests."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from msgspec.structs import replace

from engine.fake import FakeEngine, Fault, Plan
from sieproxy.core.tenancy.quota import Limits
from sieproxy.settings.load import Settings
from tests.shell.harness import MODEL, Gateway, running_gateway
from tests.tenancy.conftest import key_line, write_keys

KEY = "sk-test-limited-canary-4f1d2c"
OTHER = "sk-test-other-key-9a8b7c"


def two_tokens(call: Any) -> Plan:
    return Plan(tokens=["Hel", "lo"], prompt_tokens=7)


class Clock:
    """The limiter's clock, moved by the test (Retry-After is checked without waiting)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def keyed(path: Path, **limits: Any) -> Callable[[Settings], None]:
    def hook(s: Settings) -> None:
        write_keys(path, key_line(KEY, "team-a", **limits),
                   key_line(OTHER, "team-b", models=["other-model"]))  # fmt: skip
        s.gateway.keys_file = str(path)
        s.models["other-model"] = replace(s.models[MODEL])  # team-b's only model

    return hook


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def chat(gw: Gateway, key: str = KEY, **body: Any) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    body.setdefault("max_tokens", 10)
    return await gw.client.post("/v1/chat/completions", json=body, headers=auth(key))


async def settled(gw: Gateway, tenant: str = "team-a") -> None:
    """Wait until every request of ``tenant`` was settled (it is, just after its last byte)."""
    with trio.fail_after(10):
        while gw.state.tenancy.limiter.local[tenant].inflight:
            await trio.sleep(0.01)


def tokens_level(gw: Gateway, tenant: str = "team-a") -> float:
    c = gw.state.tenancy.limiter.local[tenant]
    assert c.tokens is not None
    return c.tokens.level


async def test_over_rpm_429_with_headers_then_the_retry_after_it_passes(tmp_path: Path) -> None:
    clock = Clock()
    with trio.fail_after(30):
        engine = FakeEngine(script=two_tokens)
        async with running_gateway(
            engine, settings_hook=keyed(tmp_path / "k", rpm=2, tpm=1000)
        ) as gw:
            gw.state.tenancy.limiter.clock = clock
            first = await chat(gw)
            assert first.status_code == 200
            h = first.headers
            assert h["x-ratelimit-limit-requests"] == "2"
            assert h["x-ratelimit-remaining-requests"] == "1"
            assert h["x-ratelimit-reset-requests"] == "30s"
            assert h["x-ratelimit-limit-tokens"] == "1000"
            # the cap and the rendered prompt's estimate (a token per 4 bytes) are reserved
            assert int(h["x-ratelimit-remaining-tokens"]) == 1000 - 10 - 13
            assert (await chat(gw)).status_code == 200
            refused = await chat(gw)
            assert refused.status_code == 429
            err = refused.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
            assert "requests per minute (2)" in err["message"]
            assert refused.headers["Retry-After"] == "30"
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            assert KEY not in refused.text
            clock.now += 29.9
            assert (await chat(gw)).status_code == 429
            clock.now += 0.1  # exactly Retry-After after the refusal
            assert (await chat(gw)).status_code == 200
            # the other routes share the tenant's limits
            body = {"model": MODEL, "prompt": "x", "max_tokens": 5}
            r = await gw.client.post("/v1/completions", headers=auth(), json=body)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            body = {"model": MODEL, "input": "x", "max_output_tokens": 5}
            r = await gw.client.post("/v1/responses", headers=auth(), json=body)
            assert r.status_code == 429 and "Retry-After" in r.headers


async def test_tokens_reserved_then_settled_whole_and_streamed(tmp_path: Path) -> None:
    clock = Clock()
    with trio.fail_after(30):
        engine = FakeEngine(script=two_tokens)
        async with running_gateway(engine, settings_hook=keyed(tmp_path / "k", tpm=1000)) as gw:
            gw.state.tenancy.limiter.clock = clock
            r = await chat(gw, max_tokens=300, n=2)
            assert r.status_code == 200
            used = r.json()["usage"]["total_tokens"]
            assert used == 7 + 2 * 2
            await settled(gw)
            assert tokens_level(gw) == pytest.approx(1000 - used)  # the rest given back
            r = await chat(gw, max_tokens=100, stream=True)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            await settled(gw)
            assert r.headers["x-ratelimit-limit-tokens"] == "1000"
            assert tokens_level(gw) == pytest.approx(1000 - used - 9)
            # a request reserving more than is left waits; one that fits passes
            r = await chat(gw, max_tokens=975)  # 988 of the 980 left
            assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"
            assert 0 < int(r.headers["Retry-After"]) <= 60
            assert (await chat(gw, max_tokens=900)).status_code == 200


async def test_a_request_larger_than_the_budget_is_a_400(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_gateway(
            FakeEngine(), settings_hook=keyed(tmp_path / "k", tpm=100)
        ) as gw:
            r = await chat(gw, max_tokens=60, n=2)
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["param"] == "max_tokens" and err["code"] == "tokens_limit_exceeded"
            assert "100 tokens per minute" in err["message"] and "Retry-After" not in r.headers
            r = await chat(gw, max_completion_tokens=200)
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
            assert "team-a" not in gw.state.tenancy.limiter.local  # nothing taken
            assert not gw.engines[0].requests or all(
                p != "/generate" for p, _ in gw.engines[0].requests
            )


async def test_a_model_the_key_may_not_use_is_not_found(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_gateway(FakeEngine(), settings_hook=keyed(tmp_path / "k")) as gw:
            forbidden = await chat(gw, key=OTHER)
            unknown = await chat(gw, key=KEY, model="no-such-model")
            assert forbidden.status_code == unknown.status_code == 404
            expected = unknown.json()["error"]
            expected["message"] = expected["message"].replace("no-such-model", MODEL)
            assert forbidden.json() == {"error": expected}
            # even with a body that would not validate
            bad = await chat(gw, key=OTHER, temperature="hot")
            assert bad.status_code == 404
            models = await gw.client.get("/v1/models", headers=auth(OTHER))
            assert [m["id"] for m in models.json()["data"]] == ["other-model"]
            assert (
                await gw.client.get(f"/v1/models/{MODEL}", headers=auth(OTHER))
            ).status_code == 404
            assert (
                await gw.client.get(f"/v1/models/{MODEL}", headers=auth(KEY))
            ).status_code == 200


async def test_over_concurrency_is_429_at_once(tmp_path: Path) -> None:
    release = trio.Event()
    slow = Plan(tokens=["a", "b"], ttft=30.0)
    with trio.fail_after(30):
        engine = FakeEngine(
            script=lambda call: slow if "hold" in str(call.prompt) else Plan(tokens=["a"])
        )
        async with running_gateway(
            engine, settings_hook=keyed(tmp_path / "k", concurrency=1)
        ) as gw:
            async with trio.open_nursery() as nursery:

                async def held() -> None:
                    with trio.move_on_after(60) as scope:
                        nursery.cancel_scope.shield = False
                        await chat(gw, messages=[{"role": "user", "content": "hold"}])
                    release.set()
                    del scope

                held_scope = trio.CancelScope()

                async def run_held() -> None:
                    with held_scope:
                        await held()

                nursery.start_soon(run_held)
                await engine.wait_for(lambda: bool(engine.running))
                t0 = trio.current_time()
                r = await chat(gw)
                assert r.status_code == 429 and trio.current_time() - t0 < 5
                assert r.json()["error"]["message"].find("concurrent requests (1)") > 0
                assert r.headers["Retry-After"] == "1"
                held_scope.cancel()  # the client leaves: its slot is freed
            with trio.fail_after(10):
                while gw.state.tenancy.limiter.local["team-a"].inflight:
                    await trio.sleep(0.01)
            assert (await chat(gw)).status_code == 200


async def test_cancelled_and_failed_requests_settle_to_what_was_produced(tmp_path: Path) -> None:
    clock = Clock()
    plans = {
        "cut": Plan(tokens=["t"] * 50, itl=[0.0] * 5 + [30.0] + [0.0] * 44, prompt_tokens=7),
        "fail": Plan(tokens=["x"], fault=Fault.http_error(500)),
    }
    with trio.fail_after(30):
        engine = FakeEngine(
            script=lambda call: plans["cut" if "cut" in str(call.prompt) else "fail"]
        )
        async with running_gateway(engine, settings_hook=keyed(tmp_path / "k", tpm=10_000)) as gw:
            gw.state.tenancy.limiter.clock = clock
            r = await chat(gw, messages=[{"role": "user", "content": "fail"}], max_tokens=500)
            assert r.status_code >= 500
            await settled(gw)
            assert tokens_level(gw) == 10_000  # nothing produced: all given back
            async with gw.client.stream(
                "POST", "/v1/chat/completions", headers=auth(),
                json={"model": MODEL, "stream": True, "max_tokens": 500,
                      "messages": [{"role": "user", "content": "cut"}]},
            ) as resp:  # fmt: skip
                got = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        got += 1
                    if got == 5:
                        break  # the client leaves mid-stream
            await engine.wait_for(lambda: not engine.running)
            with trio.fail_after(10):
                while gw.state.tenancy.limiter.local["team-a"].inflight:
                    await trio.sleep(0.01)
            used = 10_000 - tokens_level(gw)
            # what the engine produced before the abort (5 or 6 tokens) plus the prompt
            assert 5 + 1 <= used <= 6 + 7, used


async def test_keys_file_change_is_picked_up_and_a_bad_one_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.jsonl"
    with trio.fail_after(30):
        async with running_gateway(FakeEngine(script=two_tokens), settings_hook=keyed(path)) as gw:
            assert (await chat(gw)).status_code == 200
            new = "sk-test-new-key-5e6f"
            write_keys(path, key_line(new, "team-c", rpm=1))
            with trio.fail_after(10):  # picked up within a few seconds
                while (await chat(gw, key=new)).status_code != 200:
                    await trio.sleep(0.2)
            assert (await chat(gw, key=KEY)).status_code == 401
            assert (await chat(gw, key=new)).status_code == 429  # its limits came with it
            write_keys(path, key_line(KEY, "team-a"), key_line(KEY, "team-b"))
            with trio.fail_after(10):
                while "keys file not reloaded" not in caplog.text:
                    await trio.sleep(0.1)
            assert "line 2: the same key (hash) as line 1" in caplog.text
            assert (await chat(gw, key=KEY)).status_code == 401  # the running keys stayed
            entry = gw.state.auth.check(f"Bearer {new}".encode())
            assert entry is not None and entry.tenant.limits == Limits(rpm=1)


async def test_the_canary_key_never_reaches_logs_metrics_or_bodies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")

    def hook(s: Settings) -> None:
        keyed(tmp_path / "k", rpm=1, tpm=50, concurrency=1)(s)
        s.gateway.access_log = True

    with trio.fail_after(30):
        async with running_gateway(FakeEngine(script=two_tokens), settings_hook=hook) as gw:
            bodies = [await chat(gw), await chat(gw), await chat(gw, max_tokens=100),
                      await chat(gw, model="other"), await chat(gw, key=KEY + "x")]  # fmt: skip
            assert [b.status_code for b in bodies] == [200, 429, 400, 404, 401]
            metrics = (await gw.client.get("/metrics")).text
            assert 'sieproxy_tenant_requests_total{status="200",tenant="team-a"} 1.0' in metrics
            assert (
                'sieproxy_tenant_rejections_total{limit="requests",tenant="team-a"} 1.0' in metrics
            )
            assert (
                'sieproxy_tenant_rejections_total{limit="too_large",tenant="team-a"} 1.0' in metrics
            )
            digest = hashlib.sha256(KEY.encode()).hexdigest()
            for text in [
                metrics,
                caplog.text,
                *(b.text for b in bodies),
                *(str(b.headers) for b in bodies),
            ]:
                assert KEY not in text and digest not in text
            assert '"tenant":"team-a"' in caplog.text
