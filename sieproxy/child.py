"""Supervise the embedded CPU engine as a child process of the gateway.

The gateway never imports ``engine``: it starts ``python -m engine serve ...`` and talks to it
over the wire like any other engine. The child is restarted with exponential backoff when it
exits, and terminated (SIGTERM, then SIGKILL after a grace period) when the gateway stops.

The child is tied to this process in three ways:

- it runs in a session of its own, so a terminal's Ctrl-C (SIGINT to the whole foreground
  process group) reaches the gateway only: the gateway drains its streams first and stops the
  engine after them;
- it inherits the read end of a pipe whose write end only the gateway holds (its number in
  ``$SIEPROXY_PARENT_FD``); the engine stops itself when the pipe reaches end-of-file, which
  happens when the gateway is gone however it died (SIGKILL included);
- it gets a random per-launch token in ``$SIEPROXY_ENGINE_LAUNCH_TOKEN`` and reports it in
  ``/server_info``, so the gateway can tell its own engine from another process answering on
  the same port (see ``ModelPool.launch_token``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import trio

__all__ = [
    "LAUNCH_TOKEN_ENV",
    "PARENT_FD_ENV",
    "PortInUse",
    "claim_port",
    "engine_argv",
    "supervise_child",
]

log = logging.getLogger("sieproxy.child")

#: The environment variable naming the pipe the child watches for its parent's death.
PARENT_FD_ENV = "SIEPROXY_PARENT_FD"
#: The environment variable carrying the per-launch token the child reports in /server_info.
LAUNCH_TOKEN_ENV = "SIEPROXY_ENGINE_LAUNCH_TOKEN"


async def supervise_child(
    argv: list[str],
    *,
    name: str = "engine",
    env: Mapping[str, str] | None = None,
    backoff: float = 1.0,
    backoff_max: float = 30.0,
    stop_grace: float = 10.0,
) -> None:
    """Run ``argv`` forever (restarting on exit) until cancelled; then stop it cleanly."""
    delay = backoff
    while True:
        started = trio.current_time()
        watch_r, watch_w = os.pipe()  # both ends non-inheritable; only watch_r is passed on
        try:
            child_env = {**(os.environ if env is None else env), PARENT_FD_ENV: str(watch_r)}
            proc = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                env=child_env,
                pass_fds=(watch_r,),
                start_new_session=True,
            )
        except BaseException:
            os.close(watch_w)
            raise
        finally:
            os.close(watch_r)
        log.info("%s started (pid %s)", name, proc.pid)
        try:
            code = await proc.wait()
        except BaseException:
            with trio.move_on_after(stop_grace + 1, shield=True):
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)
                    with trio.move_on_after(stop_grace):
                        await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            _kill_group(proc.pid)  # anything the child left in its session
            raise
        finally:
            os.close(watch_w)
        _kill_group(proc.pid)
        log.warning("%s exited with code %s; restarting in %.1fs", name, code, delay)
        if trio.current_time() - started > 60:
            delay = backoff
        await trio.sleep(delay)
        delay = min(backoff_max, delay * 2)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def engine_argv(
    model: str,
    host: str,
    port: int,
    served_name: str,
    extra: list[str],
    *,
    kind: str = "cpu",
) -> list[str]:
    """The embedded engine's command line: the CPU engine, or the scripted fake engine."""
    if kind == "fake":
        own = ["fake", "--model-path", model]
    else:
        own = ["serve", "--model", model]
    return [
        sys.executable,
        "-m",
        "engine",
        *own,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_name,
        *extra,
    ]


class PortInUse(Exception):
    """A port the gateway must bind (or give its engine) is taken; the message says by what."""


def claim_port(host: str, port: int) -> int:
    """Check that ``host:port`` can be bound now; port 0 picks a free port. Returns the port.

    Raises :class:`PortInUse` naming the process that listens there when it can be found
    (Linux: ``/proc``), so a second instance refuses clearly instead of talking to the first.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Hypercorn binds
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise PortInUse(f"{host}:{port} cannot be bound: {exc.strerror}") from None
            raise PortInUse(f"{host}:{port} is already in use ({port_holder(port)})") from None
        return int(s.getsockname()[1])


def port_holder(port: int) -> str:
    """Best effort: "held by pid N (command)" for the process listening on ``port``."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                # local address "HEX:PORT", state 0A = LISTEN, inode in column 10
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    if inodes:
        targets = {f"socket:[{i}]" for i in inodes}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for fd in (proc / "fd").iterdir():
                    if os.readlink(fd) in targets:
                        raw = (proc / "cmdline").read_bytes().replace(b"\0", b" ").strip()
                        return f"held by pid {proc.name}: {raw.decode(errors='replace')[:120]}"
    return "held by another process"
