"""``sieproxy serve`` as a real process: signals, its engine child, ports, start-up lines.

The embedded engine here is the scripted fake (``embedded_engine.kind = "fake"``), so each test
runs the real command line, the real child supervision and the real signal handling in a few
seconds, without torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import trio

from engine.fake import Call, FakeEngine, Plan, default_tokens
from tests.procs import alive, free_port

MODEL = "SmolLM2-135M-Instruct"
FAKE_ENGINE = """
[gateway]
shutdown_grace = {grace}

[embedded_engine]
enabled = true
kind = "fake"
model = "fake/fake-model"
extra_args = ["--itl-ms", "{itl_ms}", "--tokens", "{tokens}"]
"""


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def engine_pid(self) -> int:
        m = re.search(r"engine started \(pid (\d+)\)", self.text())
        assert m, self.text()
        return int(m.group(1))

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.text()
            try:
                if httpx.get(self.url + "/readyz", timeout=2).json().get("ready"):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"not ready after {timeout} s:\n{self.text()}")


def start(tmp: Path, name: str, *args: str, config: str | None) -> Gateway:
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "sieproxy", "serve", *args]
    if config is not None:
        path = tmp / f"{name}.toml"
        path.write_text(config)
        cmd += ["--config", str(path)]
    port = free_port()
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "SIEPROXY_CONFIG"}
    with log.open("wb") as out:
        # A process group of its own, like a command in a terminal: killpg is the Ctrl-C.
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Gateway(proc, log, f"http://127.0.0.1:{port}")


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[list[Gateway]]:
    started: list[Gateway] = []
    yield started
    for g in started:
        if g.proc.poll() is None:
            g.proc.kill()
            g.proc.wait(10)


@dataclass
class Stream:
    text: str = ""
    chunks: int = 0
    error: str | None = None
    first: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


def stream_in_thread(url: str, content: str = "hi") -> Stream:
    s = Stream()

    def run() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                for chunk in r.iter_text():
                    s.text += chunk
                    s.chunks += 1
                    s.first.set()
        except httpx.HTTPError as exc:
            s.error = repr(exc)
        finally:
            s.first.set()
            s.done.set()

    threading.Thread(target=run, daemon=True).start()
    return s


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_sigint_then_sigterm_drains_the_stream_like_tox(
    tmp_path: Path, gateways: list[Gateway]
) -> None:
    """Ctrl-C under tox: the terminal's SIGINT reaches the whole process group (the engine
    child too, unless it has a session of its own), then tox sends SIGTERM 0.3 s later. The
    stream still ends with [DONE]."""
    g = start(tmp_path, "gw", config=FAKE_ENGINE.format(grace=20, itl_ms=50, tokens=60))
    gateways.append(g)
    g.wait_ready()
    engine = g.engine_pid()
    s = stream_in_thread(g.url)
    assert s.first.wait(20) and s.error is None, s
    os.killpg(g.proc.pid, signal.SIGINT)
    time.sleep(0.3)
    g.proc.send_signal(signal.SIGTERM)
    assert s.done.wait(20), "the stream did not end"
    assert s.text.endswith("data: [DONE]\n\n"), s.text[-300:]
    assert g.proc.wait(20) == 0, g.text()
    out = g.text()
    assert "Traceback" not in out, out
    assert len(re.findall(r"SIGINT: shutting down", out)) == 1, out
    assert len(re.findall(r"SIGTERM during the drain", out)) == 1, out
    assert wait_gone(engine, 5), "the engine child outlived the gateway"


def test_second_sigint_stops_now_and_aborts_upstream(
    tmp_path: Path, gateways: list[Gateway]
) -> None:
    """A second Ctrl-C ends the drain at once: the generation is aborted upstream and the
    stream ends with the "shutting down" error event and [DONE]."""

    def script(call: Call) -> Plan:
        texts, ids = default_tokens(call.seed, 200)
        return Plan(tokens=texts, token_ids=ids, itl=0.1)  # 20 s

    fake = FakeEngine(script=script)
    ports: list[int] = []
    ready = threading.Event()
    stop = threading.Event()

    async def run_engine() -> None:
        async with trio.open_nursery() as nursery:
            ports.append(await nursery.start(fake.serve))
            ready.set()
            while not stop.is_set():
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    engine_thread = threading.Thread(target=trio.run, args=(run_engine,), daemon=True)
    engine_thread.start()
    try:
        assert ready.wait(10)
        config = (
            f'[gateway]\nshutdown_grace = 30\n[models."{MODEL}"]\n'
            f'engines = ["http://127.0.0.1:{ports[0]}"]\nchat_template = "{{{{ messages }}}}"\n'
        )
        g = start(tmp_path, "gw", config=config)
        gateways.append(g)
        g.wait_ready()
        s = stream_in_thread(g.url)
        assert s.first.wait(20) and s.error is None, s
        t0 = time.monotonic()
        os.killpg(g.proc.pid, signal.SIGINT)
        time.sleep(0.5)
        os.killpg(g.proc.pid, signal.SIGINT)
        g.proc.wait(10)
        assert time.monotonic() - t0 < 5, "the second SIGINT did not stop the gateway at once"
        assert s.done.wait(5)
        # stopped, but not silently: the error event, then [DONE]
        assert s.text.endswith("data: [DONE]\n\n"), s.text[-300:]
        last = json.loads(s.text.split("\n\n")[-3].removeprefix("data: "))
        assert last["error"]["code"] == "service_unavailable", last
        out = g.text()
        assert "Traceback" not in out, out
        assert "SIGINT again: stopping now" in out, out
        rids = {b["rid"] for p, b in fake.requests if p == "/generate"}
        assert rids and rids <= set(fake.aborts), (rids, fake.aborts)
    finally:
        stop.set()
        engine_thread.join(10)


def test_killed_gateway_takes_its_engine_with_it(tmp_path: Path, gateways: list[Gateway]) -> None:
    g = start(tmp_path, "gw", config=FAKE_ENGINE.format(grace=5, itl_ms=0, tokens=5))
    gateways.append(g)
    g.wait_ready()
    engine = g.engine_pid()
    assert alive(engine)
    g.proc.kill()
    g.proc.wait(10)
    assert wait_gone(engine, 15), "the engine survived its gateway's SIGKILL"


def test_two_instances_each_answer_from_their_own_engine(
    tmp_path: Path, gateways: list[Gateway]
) -> None:
    config = FAKE_ENGINE.format(grace=5, itl_ms=0, tokens=5)
    a = start(tmp_path, "a", config=config)
    b = start(tmp_path, "b", config=config)
    gateways += [a, b]
    a.wait_ready()
    b.wait_ready()
    engine_urls = []
    for g in (a, b):
        out = g.text()
        m = re.search(r"fake engine listening on (http://\S+)", out)
        assert m, out
        engine_urls.append(m.group(1))
        # the replica the gateway uses is the engine it started
        assert f"replica {m.group(1)} of {MODEL} is ready" in out, out
        assert "restarting" not in out, out
        r = httpx.post(
            g.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            timeout=20,
        )
        assert r.status_code == 200, r.text
    assert engine_urls[0] != engine_urls[1]
    fake_engine_reqs = [
        httpx.get(u + "/server_info", timeout=5).json()["launch_token"] for u in engine_urls
    ]
    assert all(fake_engine_reqs) and fake_engine_reqs[0] != fake_engine_reqs[1]


def test_a_taken_engine_port_is_refused_naming_the_holder(
    tmp_path: Path, gateways: list[Gateway]
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = FAKE_ENGINE.format(grace=5, itl_ms=0, tokens=5) + f"port = {port}\n"
        g = start(tmp_path, "gw", config=config)
        gateways.append(g)
        assert g.proc.wait(30) == 1
    out = g.text().strip()
    assert "Traceback" not in out, out
    assert len(out.splitlines()) == 1, out
    assert f"127.0.0.1:{port} is already in use" in out, out
    assert f"held by pid {os.getpid()}" in out, out
    assert "embedded_engine.port" in out, out


def test_a_taken_gateway_port_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "SIEPROXY_CONFIG"}
        cmd = [sys.executable, "-m", "sieproxy", "serve", "--host", "127.0.0.1"]
        r = subprocess.run(
            [*cmd, "--port", str(port)], capture_output=True, text=True, timeout=60, env=env
        )
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 1, out
    assert len(out.splitlines()) == 1 and "Traceback" not in out, out
    assert f"the gateway's port 127.0.0.1:{port} is already in use" in out, out
    assert "--port" in out


def test_start_up_lines(tmp_path: Path, gateways: list[Gateway]) -> None:
    """One "Running on" line, and a last line saying where the API is and what it serves."""
    g = start(tmp_path, "gw", config=FAKE_ENGINE.format(grace=5, itl_ms=0, tokens=5))
    gateways.append(g)
    g.wait_ready()
    deadline = time.monotonic() + 5
    while "ready: " not in g.text() and time.monotonic() < deadline:
        time.sleep(0.05)
    out = g.text()
    assert len(re.findall("Running on", out)) == 1, out
    assert f"ready: {g.url}/v1 — {MODEL}" in out, out


def test_with_exit_with_parent_a_killed_parent_leaves_nothing_running(tmp_path: Path) -> None:
    """``tox -e serve`` sets SIEPROXY_EXIT_WITH_PARENT=1: when tox is SIGKILLed, the gateway
    drains and stops by itself, and its engine with it."""
    config = tmp_path / "gw.toml"
    config.write_text(FAKE_ENGINE.format(grace=5, itl_ms=0, tokens=5))
    log = tmp_path / "gw.log"
    port = free_port()
    serve = [sys.executable, "-m", "sieproxy", "serve", "--config", str(config)]
    serve += ["--host", "127.0.0.1", "--port", str(port)]
    # a stand-in for tox: a parent process that runs the command and waits for it
    parent_code = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if k != "SIEPROXY_CONFIG"}
    env["SIEPROXY_EXIT_WITH_PARENT"] = "1"
    with log.open("wb") as out:
        parent = subprocess.Popen(
            [sys.executable, "-c", parent_code, *serve],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    g = Gateway(parent, log, f"http://127.0.0.1:{port}")
    try:
        g.wait_ready()
        engine = g.engine_pid()
        stat = Path(f"/proc/{engine}/stat").read_text()
        gateway = int(stat.rsplit(")", 1)[1].split()[1])  # the engine's parent
        assert gateway != parent.pid and alive(gateway)
        parent.kill()
        parent.wait(10)
        assert wait_gone(gateway, 15), g.text()
        assert wait_gone(engine, 15), g.text()
        out = g.text()
        assert "is gone: shutting down" in out and "Traceback" not in out, out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
