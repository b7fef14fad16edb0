"""Replica health: background checks, circuit breaker, /readyz and 503 "model loading".

Several scripted fake engines behind a real gateway on loopback. A "killed" replica is a
:class:`KillableEngine` whose server task is cancelled (listener and every open connection
closed, so even the gateway's keep-alive connections break) and which can be served again on
the same port.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from engine._http import HTTPConnection, HTTPRequest
from engine.fake import Call, DefaultScript, FakeEngine, Fault, Plan
from sieproxy.fleet.pool import Replica
from sieproxy.settings.load import Settings

from .harness import MODEL, Gateway, least_loaded, running_gateway

# ---------------------------------------------------------------------------- helpers


class KillableEngine(FakeEngine):
    """A fake engine that can be killed (everything closed) and served again on its port."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._scope: trio.CancelScope | None = None
        self._revive = trio.Event()
        self.alive = False
        self.hang_health = False

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        while True:
            with trio.CancelScope() as scope:
                self._scope = scope
                self.alive = True
                await super().serve(host, port, task_status=task_status)
            self.alive = False
            port = self.port
            task_status = trio.TASK_STATUS_IGNORED
            await self._revive.wait()

    def kill(self) -> None:
        assert self._scope is not None
        self._revive = trio.Event()
        self.close_listener()
        self._scope.cancel()

    def revive(self) -> None:
        self._revive.set()

    async def _handle(self, conn: HTTPConnection, req: HTTPRequest) -> None:
        if req.path == "/health" and self.hang_health:
            await trio.sleep_forever()
        await super()._handle(conn, req)


class Switch:
    """A script that injects ``fault`` (when set) into the default plan."""

    def __init__(self, base: Callable[[Call], Plan] | None = None) -> None:
        self.base = base or DefaultScript()
        self.fault: Fault | None = None

    def __call__(self, call: Call) -> Plan:
        plan = self.base(call)
        return dataclasses.replace(plan, fault=self.fault) if self.fault is not None else plan


def gen_rids(engine: FakeEngine) -> list[str]:
    return [b["rid"] for p, b in engine.requests if p == "/generate" and isinstance(b, dict)]


def served_by(gw: Gateway, request_id: str) -> list[int]:
    """Indexes of the engines that received a candidate of ``request_id``."""
    return [
        i
        for i, e in enumerate(gw.engines)
        if any(r.rsplit("-", 1)[0] == request_id for r in gen_rids(e))
    ]


_seq = [0]


async def chat(
    gw: Gateway,
    *,
    headers: dict[str, str] | None = None,
    request_id: str | None = None,
    **body: Any,
) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    body.setdefault("max_tokens", 3)
    if request_id is None:
        _seq[0] += 1
        request_id = f"t{_seq[0]}"
    h = {"X-Request-Id": request_id, **(headers or {})}
    return await gw.client.post("/v1/chat/completions", json=body, headers=h)


async def find_key(gw: Gateway, index: int, prefix: str = "key") -> str:
    """A routing_key whose affinity replica is engine ``index`` (found by probing)."""
    for i in range(200):
        key = f"{prefix}-{i}"
        r = await chat(gw, routing_key=key)
        assert r.status_code == 200, r.text
        if served_by(gw, r.headers["x-request-id"]) == [index]:
            return key
    raise AssertionError("no key maps to that replica")


def replica(gw: Gateway, index: int) -> Replica:
    return gw.state.pools[MODEL].replicas[index]


def up(gw: Gateway, index: int) -> bool:
    return replica(gw, index).available(trio.current_time())


async def wait_until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


async def scrape(gw: Gateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = await gw.client.get("/metrics")
    assert r.status_code == 200
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
           **labels: str) -> float | None:  # fmt: skip
    return metrics.get((name, tuple(sorted(labels.items()))))


# ---------------------------------------------------------------------------- tests


async def test_killed_replica_taken_out_and_restored() -> None:
    with trio.fail_after(20):
        engines = [KillableEngine(), KillableEngine()]
        async with running_gateway(engines) as gw:
            a_url = replica(gw, 0).url
            b_url = replica(gw, 1).url
            key = await find_key(gw, 0)
            m = await scrape(gw)
            assert sample(m, "sieproxy_replica_up", model=MODEL, replica=a_url) == 1.0

            engines[0].kill()
            await wait_until(lambda: not up(gw, 0))
            assert up(gw, 1)
            ready = await gw.client.get("/readyz")
            assert ready.status_code == 200
            assert ready.json()["models"] == {MODEL: True}
            m = await scrape(gw)
            assert sample(m, "sieproxy_replica_up", model=MODEL, replica=a_url) == 0.0
            assert sample(m, "sieproxy_replica_up", model=MODEL, replica=b_url) == 1.0

            before = len(gen_rids(engines[0]))
            for _ in range(5):
                r = await chat(gw, routing_key=key)
                assert r.status_code == 200, r.text
                assert served_by(gw, r.headers["x-request-id"]) == [1]
            assert len(gen_rids(engines[0])) == before

            engines[0].revive()
            await wait_until(lambda: up(gw, 0))
            m = await scrape(gw)
            assert sample(m, "sieproxy_replica_up", model=MODEL, replica=a_url) == 1.0
            r = await chat(gw, routing_key=key)
            assert r.status_code == 200, r.text
            assert served_by(gw, r.headers["x-request-id"]) == [0]


async def test_unhealthy_replica_out_of_rotation_and_back() -> None:
    with trio.fail_after(20):
        engines = [FakeEngine(), FakeEngine()]
        async with running_gateway(engines, settings_hook=least_loaded) as gw:
            engines[0].healthy = False
            await wait_until(lambda: not up(gw, 0))
            ids = []
            for _ in range(6):
                r = await chat(gw)
                assert r.status_code == 200, r.text
                ids.append(r.headers["x-request-id"])
            assert all(served_by(gw, i) == [1] for i in ids)
            assert (await gw.client.get("/readyz")).status_code == 200
            engines[0].healthy = True
            await wait_until(lambda: up(gw, 0))
            ids = []
            for _ in range(4):
                r = await chat(gw)
                ids.append(r.headers["x-request-id"])
            # back in rotation (idle ties go to the replica that served less so far)
            assert 0 in {served_by(gw, i)[0] for i in ids}


async def test_health_checks_run_without_traffic() -> None:
    with trio.fail_after(10):
        engines = [FakeEngine(), FakeEngine()]
        async with running_gateway(engines):
            before = [e.statistics().health_checks for e in engines]
            await trio.sleep(0.5)
            after = [e.statistics().health_checks for e in engines]
            assert all(b - a >= 2 for a, b in zip(before, after, strict=True))
            assert all(gen_rids(e) == [] for e in engines)


async def test_hanging_health_check_times_out(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sieproxy.pool")

    def hook(s: Settings) -> None:
        s.gateway.health_timeout = 0.2

    with trio.fail_after(10):
        engines = [KillableEngine(), KillableEngine()]
        async with running_gateway(engines, settings_hook=hook) as gw:
            engines[0].hang_health = True
            await wait_until(lambda: not up(gw, 0), timeout=3)
            assert up(gw, 1)
            r = await chat(gw)
            assert r.status_code == 200
            assert served_by(gw, r.headers["x-request-id"]) == [1]
            engines[0].hang_health = False
            await wait_until(lambda: up(gw, 0), timeout=3)
            url = replica(gw, 0).url
    # one line per transition, naming the replica and the reason
    lines = [r.getMessage() for r in caplog.records if url in r.getMessage()]
    out = [ln for ln in lines if "is not ready" in ln]
    assert out == [f"replica {url} of {MODEL} is not ready: its check took longer than 0.2 s"]
    assert lines[-1] == f"replica {url} of {MODEL} is ready"


async def test_model_loading_503_then_ready() -> None:
    with trio.fail_after(10):
        engines = [FakeEngine(healthy=False), FakeEngine(healthy=False)]
        async with running_gateway(engines, wait_ready=False, retry_after=3) as gw:
            await trio.sleep(0.2)  # several failed checks
            ready = await gw.client.get("/readyz")
            assert ready.status_code == 503
            assert ready.headers["retry-after"] == "3"
            assert ready.json()["models"] == {MODEL: False}
            r = await chat(gw)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "3"
            err = r.json()["error"]
            assert err["code"] == "model_loading"
            assert "loading" in err["message"]
            assert all(gen_rids(e) == [] for e in engines)

            engines[1].healthy = True
            await wait_until(lambda: up(gw, 1))
            ready = await gw.client.get("/readyz")
            assert ready.status_code == 200
            assert ready.json()["models"] == {MODEL: True}
            r = await chat(gw)
            assert r.status_code == 200, r.text


async def test_discovered_template_that_does_not_compile_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A template read from the engine's /model_info directory cannot be checked at load: one
    that is not valid Jinja is logged as an error and the plain rendering serves (as for a
    directory holding no template), instead of a 500 on every chat request."""
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")

    def hook(s: Settings) -> None:
        s.models[MODEL].chat_template = None  # discover it from the engine

    caplog.set_level(logging.INFO, logger="sieproxy")
    with trio.fail_after(10):
        engine = FakeEngine(model_path=str(tmp_path))
        async with running_gateway(engine, settings_hook=hook) as gw:
            r = await chat(gw)
            assert r.status_code == 200, r.text
            (body,) = [b for p, b in engine.requests if p == "/generate"]
            assert body["text"] == "<|user|>\nhi\n<|assistant|>\n"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert [m for m in errors if f"model {MODEL}: the chat template is not valid Jinja" in m]


async def test_every_replica_down_is_model_loading() -> None:
    with trio.fail_after(15):
        engines = [KillableEngine(), KillableEngine()]
        async with running_gateway(engines) as gw:
            for e in engines:
                e.kill()
            await wait_until(lambda: not up(gw, 0) and not up(gw, 1))
            ready = await gw.client.get("/readyz")
            assert ready.status_code == 503
            assert "retry-after" in ready.headers
            r = await chat(gw)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "model_loading"
            assert "retry-after" in r.headers
            engines[1].revive()
            await wait_until(lambda: up(gw, 1))
            assert (await gw.client.get("/readyz")).status_code == 200
            assert (await chat(gw)).status_code == 200


async def test_failing_requests_open_breaker_and_a_passing_check_closes_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """breaker_failures = 2, breaker_backoff = 30: two failed requests in a row take the replica
    out even though its /health passes (checks do not reset the streak), and the next check
    that passes puts it back at once (docs/CONFIGURATION.md), not after 30 s. Half-open: while
    its requests still fail, one failure takes it out again."""
    caplog.set_level(logging.INFO, logger="sieproxy.pool")
    with trio.fail_after(20):
        script = Switch()
        engines = [FakeEngine(script=script), FakeEngine()]
        async with running_gateway(
            engines, breaker_failures=2, breaker_backoff=30.0, breaker_backoff_max=60.0
        ) as gw:
            key = await find_key(gw, 0)
            url = replica(gw, 0).url
            script.fault = Fault.http_error(503)
            for _ in range(2):
                r = await chat(gw, routing_key=key)
                assert r.status_code == 200, r.text  # retried on the other replica
                assert served_by(gw, r.headers["x-request-id"]) == [0, 1]
            # (not "up" here: a check 0.05 s later may already have closed it again)
            assert f"replica {url} of {MODEL} taken out for 30.0 s after 2 failed requests" in [
                r.getMessage() for r in caplog.records
            ], "two failed requests in a row must open the breaker"
            opened = trio.current_time()
            # health_interval is 0.05 s: the next passing check closes it, well before 30 s.
            await wait_until(lambda: up(gw, 0), timeout=5)
            assert trio.current_time() - opened < 5
            r = await chat(gw, routing_key=key)  # half-open: one more failure re-opens it
            assert r.status_code == 200, r.text
            assert served_by(gw, r.headers["x-request-id"]) == [0, 1]
            assert f"replica {url} of {MODEL} taken out for 60.0 s after 2 failed requests" in [
                r.getMessage() for r in caplog.records
            ]
            script.fault = None
            await wait_until(lambda: up(gw, 0), timeout=5)
            r = await chat(gw, routing_key=key)
            assert r.status_code == 200, r.text
            assert served_by(gw, r.headers["x-request-id"]) == [0]
    lines = [r.getMessage() for r in caplog.records if r.name == "sieproxy.pool"]
    assert f"replica {url} of {MODEL} taken out for 30.0 s after 2 failed requests" in lines
    assert f"replica {url} of {MODEL} taken out for 60.0 s after 2 failed requests" in lines
    assert lines.count(f"replica {url} of {MODEL} is back: a health check passed") == 2


async def test_client_errors_do_not_open_breaker() -> None:
    """An engine 400 (e.g. prompt too long) is the client's fault, not the replica's."""

    def script(call: Call) -> Plan:
        plan = DefaultScript()(call)
        if isinstance(call.prompt, str) and "TOO-LONG" in call.prompt:
            return dataclasses.replace(plan, fault=Fault.http_error(400))
        return plan

    def hook(s: Settings) -> None:
        s.gateway.health_interval = 30.0  # only request outcomes move the breaker here

    with trio.fail_after(15):
        async with running_gateway(FakeEngine(script=script), settings_hook=hook) as gw:
            for _ in range(3):  # breaker_failures (3) engine 400s in a row
                r = await chat(gw, messages=[{"role": "user", "content": "TOO-LONG"}])
                assert r.status_code == 400, r.text
            assert up(gw, 0), "three client errors took the only replica out"
            r = await chat(gw)
            assert r.status_code == 200, r.text


async def test_embedded_engine_must_report_its_launch_token(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A process answering on the embedded engine's port without the gateway's per-launch
    token (another instance's engine, say) is never used; the engine reporting it is."""
    from sieproxy.fleet.client import EngineClient
    from sieproxy.fleet.pool import ModelPool
    from sieproxy.settings.load import EngineSpec, GatewaySettings

    caplog.set_level(logging.INFO, logger="sieproxy.pool")
    monkeypatch.delenv("SIEPROXY_ENGINE_LAUNCH_TOKEN", raising=False)
    g = GatewaySettings(health_interval=0.05, health_timeout=2)
    engine = FakeEngine()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(engine.serve)
            pool = ModelPool(MODEL, [EngineSpec(url=f"http://127.0.0.1:{port}")], g)
            pool.launch_token = "ours"
            client = EngineClient(g)
            nursery.start_soon(pool.run_health_checks, client)

            def refusals() -> list[logging.LogRecord]:
                return [r for r in caplog.records if "not this gateway's engine" in r.message]

            while not refusals():
                await trio.sleep(0.02)
            await trio.sleep(0.5)  # about ten more checks
            assert not pool.replicas[0].ready
            assert len(refusals()) == 1, refusals()  # logged once, not at every check
            monkeypatch.setenv("SIEPROXY_ENGINE_LAUNCH_TOKEN", "ours")
            while not pool.replicas[0].ready:
                await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        await client.aclose()
