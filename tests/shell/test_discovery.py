"""Engine discovery (sieproxy/fleet/discovery.py): a DNS name whose addresses come and go adds and
drains replicas without dropping a stream; an engines file's change applies; a reload keeps
what the names resolved to.

The fake engines listen on one port at different loopback addresses (127.0.0.1, .2, .3), and
the resolver is scripted (``sieproxy.fleet.discovery.resolve`` replaced), so a name "resolves"
to any subset of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

import sieproxy.fleet.discovery
from engine.fake import Call, DefaultScript, FakeEngine, Plan
from sieproxy.fleet.discovery import NameGone
from sieproxy.operations.serve import build_app, reload_settings, serve
from sieproxy.settings.load import EngineSpec, Settings

from .harness import MODEL, TEMPLATE, Gateway, least_loaded, settings_for, sse_events
from .test_health import chat, served_by, wait_until

NAME = "fleet.test"
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


class Dns:
    """A scripted resolver: ``answers[host]`` is a list of addresses, or an exception."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str] | Exception] = {}
        self.calls = 0

    async def __call__(self, host: str, port: int | None) -> list[str]:
        self.calls += 1
        answer = self.answers.get(host, NameGone(host))
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


class Held(Sequence[float]):
    """Inter-token gaps of ``slow`` seconds until :meth:`release`, then none: a stream that
    lasts exactly as long as the test needs it to, however loaded the machine is."""

    def __init__(self, count: int, slow: float = 0.5) -> None:
        self.count, self.slow, self.released = count, slow, False

    def release(self) -> None:
        self.released = True

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> float:  # type: ignore[override]
        return 0.0 if self.released else self.slow


def held_for(prefix: str, held: Held) -> Callable[[Call], Plan]:
    """The default script, with ``held`` gaps for the requests whose rid starts with ``prefix``."""
    default = DefaultScript()

    def script(call: Call) -> Plan:
        plan = default(call)
        return dataclasses.replace(plan, itl=held) if call.rid.startswith(prefix) else plan

    return script


@contextlib.asynccontextmanager
async def fleet(
    engines: list[FakeEngine], hook: Callable[[Settings, int], None]
) -> AsyncIterator[Gateway]:
    """A gateway in front of ``engines``, engine i on ``HOSTS[i]``, all on one port."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(engines[0].serve, HOSTS[0], 0))
        for e, host in zip(engines[1:], HOSTS[1:], strict=False):
            await nursery.start(partial(e.serve, host, port))
        settings = settings_for([port])
        least_loaded(settings)  # identical test prompts spread over the replicas
        hook(settings, port)
        app = build_app(settings)
        stop = trio.Event()
        binds = await nursery.start(partial(serve, settings, shutdown_trigger=stop, app=app))
        async with httpx.AsyncClient(base_url=binds[0], timeout=30.0) as client:
            yield Gateway(binds[0], client, engines, app.extensions["sieproxy"], stop)
        stop.set()
        nursery.cancel_scope.cancel()


def urls(gw: Gateway) -> list[str]:
    return [r.url for r in gw.state.pools[MODEL].replicas]


def dns_entry(interval: float = 0.05) -> Callable[[Settings, int], None]:
    def hook(s: Settings, port: int) -> None:
        s.models[MODEL].engines = [
            EngineSpec(url=f"http://{NAME}:{port}", discover="dns", interval=interval)
        ]

    return hook


async def test_dns_name_gains_and_loses_addresses_without_dropping_a_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dns = Dns()
    dns.answers[NAME] = [HOSTS[0]]
    monkeypatch.setattr(sieproxy.fleet.discovery, "resolve", dns)
    held = Held(40)
    engines = [FakeEngine(held_for("long", held)), FakeEngine(held_for("long", held)),
               FakeEngine(healthy=False)]  # fmt: skip
    with trio.fail_after(30):
        async with fleet(engines, dns_entry()) as gw:
            pool = gw.state.pools[MODEL]
            port = engines[0].port
            await wait_until(lambda: pool.any_ready())
            assert urls(gw) == [f"http://127.0.0.1:{port}"]  # never the name itself

            # An address appears: a replica that takes requests once its check passed.
            dns.answers[NAME] = HOSTS[:2]
            await wait_until(lambda: len(urls(gw)) == 2 and all(r.ready for r in pool.replicas))
            seen: set[int] = set()
            for i in range(8):
                r = await chat(gw, max_tokens=1, request_id=f"grow{i}")
                assert r.status_code == 200, r.text
                seen.update(served_by(gw, f"grow{i}"))
            assert seen == {0, 1}

            # A stream runs on the second address when it vanishes and a third appears (not
            # healthy yet): the stream finishes there, nothing new reaches either.
            result: list[httpx.Response] = []

            async def long() -> None:
                result.append(await chat(gw, stream=True, max_tokens=40, request_id="long"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(long)
                # By its rid: a short request's rid can linger on the other engine for a moment.
                await wait_until(lambda: any("long-0" in e.running for e in engines[:2]))
                busy = 0 if "long-0" in engines[0].running else 1
                dns.answers[NAME] = [HOSTS[1 - busy], HOSTS[2]]
                gone = f"http://{HOSTS[busy]}:{port}"
                await wait_until(lambda: gone not in urls(gw) and len(urls(gw)) == 2)
                assert "long-0" in engines[busy].running  # still streaming, out of the pool
                for i in range(4):
                    r = await chat(gw, max_tokens=1, request_id=f"drain{i}")
                    assert r.status_code == 200, r.text
                    assert served_by(gw, f"drain{i}") == [1 - busy]  # the third is not ready
                held.release()
            events = sse_events(result[0].text)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            text = "".join(
                e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
            )
            assert len(text.split()) == 40
            # Recorded after the engine's last write: the client may have read the end first.
            await engines[busy].wait_for(lambda: "long-0" in engines[busy].outcomes)
            assert engines[busy].outcomes["long-0"] == "finished"

            # The third address joins once its health check passes.
            engines[2].healthy = True
            await wait_until(lambda: all(r.ready for r in pool.replicas))
            seen = set()
            for i in range(8):
                r = await chat(gw, max_tokens=1, request_id=f"third{i}")
                assert r.status_code == 200, r.text
                seen.update(served_by(gw, f"third{i}"))
            assert 2 in seen and busy not in seen


async def test_a_name_gone_drains_and_a_failing_resolver_keeps_the_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dns = Dns()
    dns.answers[NAME] = HOSTS[:2]
    monkeypatch.setattr(sieproxy.fleet.discovery, "resolve", dns)
    with trio.fail_after(30):
        async with fleet([FakeEngine(), FakeEngine()], dns_entry()) as gw:
            await wait_until(lambda: len(urls(gw)) == 2)
            dns.answers[NAME] = OSError("temporary failure in name resolution")
            calls = dns.calls
            await wait_until(lambda: dns.calls >= calls + 3)
            assert len(urls(gw)) == 2  # a resolver outage does not empty the fleet
            del dns.answers[NAME]  # NXDOMAIN: the name has no address
            await wait_until(lambda: urls(gw) == [])
            r = await chat(gw)
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"


async def test_engines_file_change_applies(tmp_path: Path) -> None:
    path = tmp_path / "engines.txt"

    def hook(s: Settings, port: int) -> None:
        path.write_text(f"# the fleet\nhttp://127.0.0.1:{port} pool=pool-0\n")
        s.models[MODEL].engines = []
        s.models[MODEL].engines_file = str(path)

    with trio.fail_after(30):
        async with fleet([FakeEngine(), FakeEngine()], hook) as gw:
            port = gw.engines[0].port
            pool = gw.state.pools[MODEL]
            assert urls(gw) == [f"http://127.0.0.1:{port}"]
            await wait_until(pool.any_ready)
            assert (await chat(gw, request_id="f0")).status_code == 200
            assert served_by(gw, "f0") == [0]

            path.write_text(f"http://127.0.0.2:{port} pool=pool-1\n")
            await wait_until(lambda: urls(gw) == [f"http://127.0.0.2:{port}"])
            await wait_until(pool.any_ready)
            r = await chat(gw, request_id="f1", headers={"X-SIE-Pool": "pool-1"})
            assert r.status_code == 200, r.text
            assert served_by(gw, "f1") == [1]

            path.write_text("not a url\n")  # a bad file keeps the last list
            await trio.sleep(2.5 * sieproxy.fleet.discovery.FILE_POLL)
            assert urls(gw) == [f"http://127.0.0.2:{port}"]


async def test_reload_keeps_resolved_addresses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dns = Dns()
    dns.answers[NAME] = HOSTS[:2]
    monkeypatch.setattr(sieproxy.fleet.discovery, "resolve", dns)
    with trio.fail_after(30):
        async with fleet([FakeEngine(), FakeEngine()], dns_entry(interval=60)) as gw:
            port = gw.engines[0].port
            await wait_until(lambda: len(urls(gw)) == 2)
            before = list(gw.state.pools[MODEL].replicas)
            conf = tmp_path / "g.toml"
            conf.write_text(
                f"[models.{MODEL}]\n"
                f'engines = [{{ url = "http://{NAME}:{port}", discover = "dns", interval = 60 }}]\n'
                f"chat_template = {json.dumps(TEMPLATE)}\n"
            )
            lines = reload_settings(gw.state, str(conf))
            assert not any("engines added" in line for line in lines), lines
            assert gw.state.pools[MODEL].replicas == before  # same replicas, state kept
            # The reload resolves the names again at once (the interval is a minute).
            dns.answers[NAME] = HOSTS[:1]
            reload_settings(gw.state, str(conf))
            await wait_until(lambda: urls(gw) == [f"http://127.0.0.1:{port}"])


async def test_a_reload_during_a_resolution_drops_the_entry_cleanly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dns = Dns()
    dns.answers[NAME] = HOSTS[:2]
    release = trio.Event()
    blocked = trio.Event()

    async def slow(host: str, port: int | None) -> list[str]:
        if dns.calls:  # the second resolution waits until the test releases it
            blocked.set()
            await release.wait()
        return await dns(host, port)

    monkeypatch.setattr(sieproxy.fleet.discovery, "resolve", slow)
    with trio.fail_after(30):
        async with fleet([FakeEngine(), FakeEngine()], dns_entry()) as gw:
            port = gw.engines[0].port
            await wait_until(lambda: len(urls(gw)) == 2)
            await blocked.wait()
            conf = tmp_path / "g.toml"
            conf.write_text(
                f'[models.{MODEL}]\nengines = ["http://127.0.0.1:{port}"]\n'
                f"chat_template = {json.dumps(TEMPLATE)}\n"
            )
            reload_settings(gw.state, str(conf))  # the DNS entry is gone mid-resolution
            assert urls(gw) == [f"http://127.0.0.1:{port}"]
            release.set()
            await trio.sleep(0.2)
            assert urls(gw) == [f"http://127.0.0.1:{port}"]
            assert (await chat(gw)).status_code == 200
