"""Configuration reload (SIGHUP on ``sieproxy serve``): engine lists and bearer tokens change
while serving; an invalid file changes nothing; other changes are reported, not applied."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import trio

from engine.fake import FakeEngine
from sieproxy.operations.lifecycle import reload_on_sighup
from sieproxy.operations.serve import reload_settings
from sieproxy.settings.load import ConfigError, Settings

from .harness import MODEL, TEMPLATE, Gateway, running_gateway
from .test_health import chat, gen_rids, served_by, wait_until


def only_first_engine(settings: Settings) -> None:
    m = settings.models[MODEL]
    m.engines = m.engines[:1]


def write_config(path: Path, gw: Gateway, engines: list[int], gateway: str = "") -> str:
    specs = ", ".join(
        f'{{url = "http://127.0.0.1:{gw.engines[i].port}", pool = "pool-{i % 2}"}}' for i in engines
    )
    path.write_text(
        f"[gateway]\n{gateway}\n[models.{MODEL}]\nengines = [{specs}]\n"
        f"chat_template = {json.dumps(TEMPLATE)}\n"
    )
    return str(path)


async def test_engines_are_added_and_removed(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_gateway(
            [FakeEngine(), FakeEngine()], settings_hook=only_first_engine
        ) as gw:
            pool = gw.state.pools[MODEL]
            assert [r.url for r in pool.replicas] == [f"http://127.0.0.1:{gw.engines[0].port}"]
            lines = reload_settings(gw.state, write_config(tmp_path / "a.toml", gw, [0, 1]))
            assert any("engines added" in line for line in lines)
            second = pool.replicas[1]
            await wait_until(lambda: second.ready)  # its health watcher started
            seen = set()
            for i in range(12):  # different prompts: different prefix keys
                r = await chat(gw, messages=[{"role": "user", "content": f"question {i}"}])
                assert r.status_code == 200, r.text
                seen.update(served_by(gw, r.headers["x-request-id"]))
            assert seen == {0, 1}

            first = pool.replicas[0]
            reload_settings(gw.state, write_config(tmp_path / "b.toml", gw, [1]))
            assert first.retired and [r.url for r in pool.replicas] == [second.url]
            before = len(gen_rids(gw.engines[0]))
            for _ in range(5):
                r = await chat(gw)
                assert r.status_code == 200, r.text
                assert served_by(gw, r.headers["x-request-id"]) == [1]
            assert len(gen_rids(gw.engines[0])) == before
            assert first.inflight == 0


async def test_tokens_change_and_a_bad_file_changes_nothing(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_gateway() as gw:
            assert (await chat(gw)).status_code == 200  # auth off
            path = write_config(tmp_path / "g.toml", gw, [0], 'auth = true\ntokens = ["tok-1"]\n')
            lines = reload_settings(gw.state, path)
            assert lines[0] == "auth on, 1 key(s) of 1 tenant(s)"
            assert (await chat(gw)).status_code == 401
            ok = await chat(gw, headers={"Authorization": "Bearer tok-1"})
            assert ok.status_code == 200, ok.text

            bad = tmp_path / "bad.toml"
            bad.write_text("[gateway]\nauth = 'yes please'\n")
            with pytest.raises(ConfigError):
                reload_settings(gw.state, str(bad))
            assert (await chat(gw, headers={"Authorization": "Bearer tok-1"})).status_code == 200


async def test_other_changes_are_reported_not_applied(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_gateway() as gw:
            path = write_config(tmp_path / "c.toml", gw, [0], "default_max_tokens = 7\n")
            lines = reload_settings(gw.state, path)
            assert "[gateway] settings other than auth and tokens need a restart" in lines
            assert gw.state.settings.gateway.default_max_tokens != 7


async def test_sighup_reloads(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with running_gateway() as gw:
            path = write_config(tmp_path / "s.toml", gw, [0], 'auth = true\ntokens = ["tok-2"]\n')
            before = gw.state.auth
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reload_on_sighup, gw.state, path)
                await trio.sleep(0.1)  # the signal receiver is installed
                os.kill(os.getpid(), signal.SIGHUP)
                await wait_until(lambda: gw.state.auth is not before)
                nursery.cancel_scope.cancel()
            assert (await chat(gw)).status_code == 401


def test_reload_keeps_the_embedded_engine_and_its_picked_port(tmp_path: Path) -> None:
    """``embedded_engine.port = 0`` is resolved once at start; a reload of the same file must
    not move the embedded model's replica to port 0, and a changed table needs a restart."""
    from sieproxy.operations.serve import build_state, claim_ports
    from sieproxy.settings.load import load_settings

    path = tmp_path / "e.toml"
    path.write_text('[embedded_engine]\nenabled = true\nkind = "fake"\n')
    settings = load_settings(str(path))
    settings.gateway.port = 0
    claim_ports(settings)
    port = settings.embedded_engine.port
    assert port > 0
    state = build_state(settings)
    pool = state.pools[settings.embedded_engine.served_name]
    assert [r.url for r in pool.replicas] == [f"http://127.0.0.1:{port}"]
    lines = reload_settings(state, str(path))
    assert [r.url for r in pool.replicas] == [f"http://127.0.0.1:{port}"], lines
    assert not any("embedded_engine" in line for line in lines), lines
    path.write_text('[embedded_engine]\nenabled = true\nkind = "fake"\nmodel = "other"\n')
    lines = reload_settings(state, str(path))
    assert "[embedded_engine] settings need a restart" in lines
    assert [r.url for r in pool.replicas] == [f"http://127.0.0.1:{port}"], lines
