"""Graceful shutdown: in-flight streams finish within shutdown_grace, the rest are aborted
upstream, and no engine is left generating once serve() has returned.

The harness's ``running_gateway`` does not say when ``serve()`` returns, so this file drives the
gateway itself (same wiring as the harness).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from engine.fake import Call, FakeEngine, Plan, default_tokens
from sieproxy.front.app import GatewayState
from sieproxy.operations.serve import build_app, serve

from .harness import MODEL, settings_for, sse_events


@dataclass
class Served:
    url: str
    client: httpx.AsyncClient
    engines: list[FakeEngine]
    state: GatewayState
    stop: trio.Event
    done: trio.Event
    stopped_at: list[float] = field(default_factory=list)


@contextlib.asynccontextmanager
async def gateway(engines: list[FakeEngine], **gw: Any) -> AsyncIterator[Served]:
    async with trio.open_nursery() as nursery:
        ports = [await nursery.start(e.serve) for e in engines]
        access_log = gw.pop("access_log", False)
        settings = settings_for(ports, **gw)
        settings.gateway.access_log = access_log
        app = build_app(settings)
        stop = trio.Event()
        done = trio.Event()

        async def run(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await serve(settings, shutdown_trigger=stop, app=app, task_status=task_status)
            finally:
                done.set()

        binds = await nursery.start(run)
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as client:
            s = Served(binds[0], client, engines, app.extensions["sieproxy"], stop, done)
            with trio.fail_after(10):
                while (await client.get("/readyz")).status_code != 200:
                    await trio.sleep(0.02)
            yield s
        stop.set()
        nursery.cancel_scope.cancel()


def script(call: Call) -> Plan:
    """Prompts saying "long" run 10 s; others finish in about half a second."""
    count = 100 if isinstance(call.prompt, str) and "long" in call.prompt else 5
    texts, ids = default_tokens(call.seed, count)
    return Plan(tokens=texts, token_ids=ids, itl=0.1)


@dataclass
class Outcome:
    status: int | None = None
    text: str = ""
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.text.endswith("data: [DONE]\n\n")


async def stream(
    s: Served,
    rid: str,
    content: str,
    out: dict[str, Outcome],
    *,
    streaming: bool = True,
    n: int = 1,
) -> None:
    o = out[rid] = Outcome()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 200,
        "stream": streaming,
        "n": n,
    }
    try:
        async with s.client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
        ) as r:
            o.status = r.status_code
            async for chunk in r.aiter_text():
                o.text += chunk
    except httpx.HTTPError as exc:
        o.error = repr(exc)


def all_rids(engines: list[FakeEngine]) -> set[str]:
    return {b["rid"] for e in engines for p, b in e.requests if p == "/generate"}


async def test_graceful_shutdown_finishes_short_and_aborts_long(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sieproxy.access")
    with trio.fail_after(20):
        engines = [FakeEngine(script=script), FakeEngine(script=script)]
        grace = 1.5
        async with gateway(engines, shutdown_grace=grace, access_log=True) as s:
            out: dict[str, Outcome] = {}
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(stream, s, f"short{i}", "short please", out)
                    nursery.start_soon(stream, s, f"long{i}", "long please", out)
                nursery.start_soon(
                    partial(stream, s, "longunary", "long please", out, streaming=False)
                )
                with trio.fail_after(5):
                    while sum(len(e.running) for e in engines) < 5:
                        await trio.sleep(0.01)
                t0 = trio.current_time()
                s.stop.set()
                await trio.sleep(0.2)
                # a request arriving while draining is refused (503, or no connection at all)
                async with httpx.AsyncClient(base_url=s.url, timeout=5) as late:
                    try:
                        r = await late.post(
                            "/v1/chat/completions",
                            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                        )
                    except httpx.HTTPError:
                        pass
                    else:
                        assert r.status_code == 503
                        assert "retry-after" in r.headers
                with trio.fail_after(grace + 3):
                    await s.done.wait()
                elapsed = trio.current_time() - t0
            assert elapsed < grace + 1.5, elapsed
            assert elapsed >= grace - 0.1, "long streams were cut before the grace ended"

            for i in range(2):
                short = out[f"short{i}"]
                assert short.status == 200 and short.error is None, short
                assert short.done, short.text[-200:]
                assert "error" not in sse_events(short.text)[-2]
                long = out[f"long{i}"]
                assert long.status == 200 and long.error is None, long
                # cut at the grace's end, but not silently: an error event, then [DONE]
                assert long.done, long.text[-300:]
                events = sse_events(long.text)
                assert events[-1] == "[DONE]"
                assert events[-2]["error"]["code"] == "service_unavailable", events[-2]
                assert "shutting down" in events[-2]["error"]["message"]
                assert not any("finish_reason" in json.dumps(e) and '"stop"' in json.dumps(e)
                               for e in events[:-2] if isinstance(e, dict))
            unary = out["longunary"]
            assert unary.status == 503 and unary.error is None, unary
            assert json.loads(unary.text)["error"]["code"] == "service_unavailable"

            cut = {"long0-0", "long1-0", "longunary-0"}
            aborted = {rid for e in engines for rid in e.aborts}
            assert cut <= aborted, f"not aborted upstream: {cut - aborted}"
            assert not ({"short0-0", "short1-0"} & aborted)
            assert all_rids(engines) >= cut
            # nothing left generating upstream
            with trio.fail_after(1):
                for e in engines:
                    await e.wait_for(lambda e=e: not e.running)
            assert all(e.statistics().running == 0 for e in engines)
            assert not s.state.active

            # The access log gives each request's real outcome: the shutdown ended the long ones
            # with a 503 (an error event after the 200 counts under its error status), and their
            # end was sent, so none of them was cut.
            access = [r for r in caplog.records if r.name == "sieproxy.access"]
            lines = [json.loads(r.getMessage()) for r in access]
            logged = {ln["request_id"]: (ln["status"], ln["outcome"]) for ln in lines}
            assert {k: v for k, v in logged.items() if k in out} == {
                "short0": (200, "complete"),
                "short1": (200, "complete"),
                "long0": (503, "complete"),
                "long1": (503, "complete"),
                "longunary": (503, "complete"),
            }, lines


async def test_shutdown_returns_as_soon_as_streams_finish() -> None:
    """serve() returns once the in-flight streams are done, not after the whole grace period
    (clients such as the test's httpx pool hold idle keep-alive connections meanwhile)."""
    with trio.fail_after(20):
        engines = [FakeEngine(script=script)]
        async with gateway(engines, shutdown_grace=6) as s:
            out: dict[str, Outcome] = {}
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(stream, s, f"s{i}", "short", out)
                with trio.fail_after(5):
                    while len(engines[0].running) < 3:
                        await trio.sleep(0.01)
                t0 = trio.current_time()
                s.stop.set()
                with trio.move_on_after(3):
                    await s.done.wait()
                assert s.done.is_set(), (
                    f"serve() still running {trio.current_time() - t0:.1f} s after stop, "
                    "though every stream ended after about 0.5 s"
                )
            assert all(o.done and o.status == 200 for o in out.values()), out
            assert engines[0].aborts == []
            assert not engines[0].running


async def test_readyz_reports_draining() -> None:
    with trio.fail_after(20):
        engines = [FakeEngine(script=script)]
        async with gateway(engines, shutdown_grace=2) as s:
            out: dict[str, Outcome] = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream, s, "keep", "long", out)
                with trio.fail_after(5):
                    while not engines[0].running:
                        await trio.sleep(0.01)
                s.stop.set()
                await trio.sleep(0.1)
                assert s.state.draining
                with trio.fail_after(5):
                    await s.done.wait()
            assert engines[0].aborts == ["keep-0"]
            assert not engines[0].running


async def test_grace_end_ends_a_several_candidate_stream_with_an_error_event() -> None:
    """n > 1 (a task per candidate): at the grace's end both candidates are aborted upstream
    and the stream ends with the "shutting down" error event and [DONE], not a cut."""
    with trio.fail_after(20):
        engines = [FakeEngine(script=script)]
        async with gateway(engines, shutdown_grace=1) as s:
            out: dict[str, Outcome] = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(stream, s, "two", "long", out, n=2))
                with trio.fail_after(5):
                    while len(engines[0].running) < 2:
                        await trio.sleep(0.01)
                s.stop.set()
                with trio.fail_after(5):
                    await s.done.wait()
            o = out["two"]
            assert o.status == 200 and o.error is None and o.done, o
            events = sse_events(o.text)
            assert events[-2]["error"]["code"] == "service_unavailable", events[-2]
            assert set(engines[0].aborts) == {"two-0", "two-1"}
