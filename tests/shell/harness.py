"""A real gateway (Hypercorn on a loopback port) in front of scripted fake engines."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import h11
import httpx
import pytest
import trio

import sieproxy.operations.serve
from engine.fake import FakeEngine
from sieproxy.front.app import GatewayState
from sieproxy.operations.serve import build_app, hypercorn_config, serve
from sieproxy.settings.load import (
    EngineSpec,
    GatewaySettings,
    ModelSettings,
    Settings,
    env_fast_paths,
)
from sieproxy.surfaces import SURFACES, Surface

MODEL = "test-model"

#: A tiny ChatML-style template, so rendering is real but predictable.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Gateway:
    url: str
    client: httpx.AsyncClient
    engines: list[FakeEngine]
    state: GatewayState
    stop: trio.Event
    extra: dict[str, Any] = field(default_factory=dict)

    async def chat(self, **body: Any) -> httpx.Response:
        body.setdefault("model", MODEL)
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
        return await self.client.post("/v1/chat/completions", json=body)


def host_port(gw: Gateway) -> tuple[str, int]:
    """The gateway's address, for raw-socket clients."""
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def exchange(
    sock: trio.SocketStream, conn: h11.Connection, req: Any, data: bytes
) -> tuple[h11.Response, bytes]:
    """One request/response on a kept-alive connection, parsed strictly by h11 (client side)."""
    await sock.send_all(
        conn.send(req) + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage())
    )
    head: h11.Response | None = None
    body = bytearray()
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            got = await sock.receive_some(65536)
            assert got, "the server closed the connection mid-response"
            conn.receive_data(got)
        elif isinstance(ev, h11.Response):
            head = ev
        elif isinstance(ev, h11.Data):
            body += ev.data
        elif isinstance(ev, h11.EndOfMessage):
            assert head is not None
            conn.start_next_cycle()
            return head, bytes(body)


def short_keep_alive(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Gateways that ``serve`` starts in this test close a connection idle for ``seconds``
    (Hypercorn's ``keep_alive_timeout``, 75 s in production)."""

    def config(settings: Settings) -> Any:
        cfg = hypercorn_config(settings)
        cfg.keep_alive_timeout = seconds
        return cfg

    monkeypatch.setattr(sieproxy.operations.serve, "hypercorn_config", config)


def connection_tasks() -> int:
    """Hypercorn connection tasks alive in this Trio run (one per open client connection)."""
    found = 0
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        if task.name.endswith("_run_handler"):
            found += 1
        todo += [t for n in task.child_nurseries for t in n.child_tasks]
    return found


#: The harness's ``protocol`` values: the engines' protocol and the model's ``render``.
#: ``"openai"`` is the gateway-rendered mode (``/v1/completions``); ``"openai-chat"`` the
#: engine-rendered one (``/v1/chat/completions``, the default for OpenAI engines).
PROTOCOL_MODES: dict[str, tuple[str, str | None]] = {
    "sglang": ("sglang", None),
    "openai": ("openai", "gateway"),
    "openai-chat": ("openai", "engine"),
}


def settings_for(ports: list[int], protocol: str = "sglang", **gateway: Any) -> Settings:
    protocol, render = PROTOCOL_MODES[protocol]
    fast = env_fast_paths()  # SIEPROXY_FAST_PATHS=0: the suite's run with the fast paths off
    if fast is not None:
        gateway.setdefault("fast_paths", fast)
    g = GatewaySettings(
        host="127.0.0.1",
        port=0,
        health_interval=0.05,
        health_timeout=2.0,
        access_log=False,
        **gateway,
    )
    specs: list[str | EngineSpec] = [
        EngineSpec(
            url=f"http://127.0.0.1:{p}",
            pool=f"pool-{i % 2}",
            machine_profile=f"profile-{i}",
            protocol=protocol,
        )
        for i, p in enumerate(ports)
    ]
    models = {
        MODEL: ModelSettings(
            engines=specs,
            chat_template=TEMPLATE,
            inputs=["text", "image"],
            lora_paths={"my-adapter": "/adapters/my-adapter"},
            render=render,
        )
    }
    return Settings(gateway=g, models=models)


def least_loaded(s: Settings) -> None:
    """A ``settings_hook``: the models route by load alone (``routing = "least_loaded"``), for
    tests of spreading identical prompts, which the default routing keeps on one replica."""
    for m in s.models.values():
        m.routing = "least_loaded"


def no_resumes(s: Settings) -> None:
    """A ``settings_hook``: ``max_resumes = 0`` for every model, so a stream broken after output
    ends with its error (the tests of that path; tests/shell/test_resume.py has the resumes,
    the default)."""
    for m in s.models.values():
        m.max_resumes = 0


@contextlib.asynccontextmanager
async def running_gateway(
    engines: list[FakeEngine] | FakeEngine | None = None,
    *,
    settings_hook: Callable[[Settings], None] | None = None,
    wait_ready: bool = True,
    protocol: str = "sglang",
    surfaces: tuple[Surface, ...] = SURFACES,
    **gateway: Any,
) -> AsyncIterator[Gateway]:
    if engines is None:
        engines = [FakeEngine()]
    if isinstance(engines, FakeEngine):
        engines = [engines]
    async with trio.open_nursery() as nursery:
        ports = [await nursery.start(e.serve) for e in engines]
        settings = settings_for(ports, protocol, **gateway)
        if settings_hook is not None:
            settings_hook(settings)
        async with _serving(settings, engines, wait_ready, surfaces) as gw:
            yield gw
        nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def another_gateway(gw: Gateway) -> AsyncIterator[Gateway]:
    """A second gateway on ``gw``'s engines and configuration, sharing nothing else with it (as
    another process or host would)."""
    async with _serving(gw.state.settings, gw.engines, True) as other:
        yield other


@contextlib.asynccontextmanager
async def _serving(
    settings: Settings,
    engines: list[FakeEngine],
    wait_ready: bool,
    surfaces: tuple[Surface, ...] = SURFACES,
) -> AsyncIterator[Gateway]:
    async with trio.open_nursery() as nursery:
        app = build_app(settings, surfaces)
        stop = trio.Event()
        binds = await nursery.start(partial(serve, settings, shutdown_trigger=stop, app=app))
        url = binds[0]
        timeout = httpx.Timeout(30.0)
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            gw = Gateway(url, client, engines, app.extensions["sieproxy"], stop)
            if wait_ready:
                with trio.fail_after(10):
                    while (await client.get("/readyz")).status_code != 200:
                        await trio.sleep(0.02)
            yield gw
        stop.set()
        nursery.cancel_scope.cancel()


def sse_events(text: str) -> list[Any]:
    """Decode an SSE body into JSON objects (``"[DONE]"`` kept as the string)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
