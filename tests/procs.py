"""Helpers for tests that run engines and the gateway as real subprocesses."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def stop_process(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL and reap."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie nobody reaped yet counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def python_env() -> dict[str, str]:
    """This environment with the checkout importable and no settings file named."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SIEPROXY_CONFIG", None)
    return env


def wait_line(proc: subprocess.Popen[bytes], log: Path, pattern: str, timeout: float) -> str:
    """The first group of ``pattern`` once the process's ``log`` has it (fails if it exits)."""
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return m.group(1)
        if proc.poll() is not None:
            pytest.fail(f"process exited ({proc.returncode}):\n{log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {pattern!r} within {timeout}s:\n{log.read_text()}")
        time.sleep(0.05)


def spawn_python(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``python ARGV`` from the checkout, its output into ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, env=python_env(),
            cwd=ROOT,
        )  # fmt: skip


def wait_ready(
    url: str,
    timeout: float,
    *,
    path: str = "/readyz",
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    """Until the server at ``url`` answers ``path`` with 200 (a gateway's ``/readyz``, an
    engine's ``/health``); fails, with ``log``, if ``proc`` exits first."""
    deadline = time.monotonic() + timeout

    def said() -> str:
        return "" if log is None else f":\n{log.read_text(errors='replace')}"

    while True:
        try:
            if httpx.get(url + path, timeout=60).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{url} exited ({proc.returncode}) before {path} answered{said()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{url} did not answer {path} within {timeout}s{said()}")
        time.sleep(0.2)


def serve_gateway(
    tmp_path: Path, *flags: str, timeout: float, launcher: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``sieproxy serve FLAGS`` on a free port, once ready: the process and its URL."""
    log = tmp_path / "gateway.log"
    start = ["-m", "sieproxy"] if launcher is None else ["-c", launcher]
    proc = spawn_python([*start, "serve", "--host", "127.0.0.1", "--port", "0", *flags], log)
    try:
        url = wait_line(proc, log, r"Running on (http://[0-9.]+:\d+)", 60)
        wait_ready(url, timeout, proc=proc, log=log)
    except BaseException:
        stop_process(proc)
        raise
    return proc, url
