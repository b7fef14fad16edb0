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

A child that exits before it was ever ready (``ready``: its replica passed a health check) failed
to start: the first such exit is logged once as an error with the child's last lines of stderr
(which is relayed to the gateway's own stderr as it comes), later ones as one warning line each;
after ``max_failed_starts`` in a row it is not restarted again and ``on_failed`` gets the reason
(the model is then ``failed``: its requests are answered ``503 engine_failed``, ``/readyz``
names it). A child that was ready and exits is restarted, its count of failed starts reset.
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
from collections import deque
from collections.abc import Callable, Mapping
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


#: Lines of a child's stderr kept for the report of a failed start.
TAIL_LINES = 20


async def supervise_child(
    argv: list[str],
    *,
    name: str = "engine",
    env: Mapping[str, str] | None = None,
    backoff: float = 1.0,
    backoff_max: float = 30.0,
    stop_grace: float = 10.0,
    ready: Callable[[], bool] | None = None,
    max_failed_starts: int = 3,
    on_failed: Callable[[str], None] | None = None,
) -> None:
    """Run ``argv`` forever (restarting on exit) until cancelled; then stop it cleanly. With
    ``ready``, a child that exits before it was ready counts as a failed start, and after
    ``max_failed_starts`` in a row it stays down (module docstring)."""
    delay = backoff
    failed = 0
    while True:
        started = trio.current_time()
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        watch_r, watch_w = os.pipe()  # both ends non-inheritable; only watch_r is passed on
        try:
            child_env = {**(os.environ if env is None else env), PARENT_FD_ENV: str(watch_r)}
            proc = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
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
            async with trio.open_nursery() as nursery:
                assert proc.stderr is not None
                relayed = trio.Event()
                nursery.start_soon(_relay, proc.stderr, tail, relayed)
                code = await proc.wait()
                with trio.move_on_after(1.0):  # the rest of its stderr (a grandchild may hold it)
                    await relayed.wait()
                nursery.cancel_scope.cancel()
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
        if ready is not None and not ready():
            failed += 1
            if failed >= max_failed_starts:
                reason = (f"the engine exited during start-up {failed} times in a row "
                          f"(last exit code {code})")  # fmt: skip
                log.error("%s: %s; it stays down", name, reason)
                if on_failed is not None:
                    on_failed(reason)
                return
            if failed == 1:
                lines = "\n".join(tail) or "(nothing on stderr)"
                log.error("%s exited during start-up (code %s; restarting in %.1fs); its last "
                          "lines:\n%s", name, code, delay, lines)  # fmt: skip
            else:
                log.warning("%s exited during start-up again (code %s): failed start %d of "
                            "%d; restarting in %.1fs",
                            name, code, failed, max_failed_starts, delay)  # fmt: skip
        else:
            failed = 0
            log.warning("%s exited with code %s; restarting in %.1fs", name, code, delay)
        if trio.current_time() - started > 60:
            delay = backoff
        await trio.sleep(delay)
        delay = min(backoff_max, delay * 2)


async def _relay(stream: trio.abc.ReceiveStream, tail: deque[str], done: trio.Event) -> None:
    """Copy the child's stderr to ours as it comes, keeping its last lines in ``tail``; ``done``
    at its end."""
    partial_line = b""
    with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError, OSError):
        while data := await stream.receive_some(65536):
            with contextlib.suppress(OSError):
                os.write(2, data)
            lines = (partial_line + data).split(b"\n")
            partial_line = lines.pop()
            tail.extend(ln.decode(errors="replace").rstrip() for ln in lines if ln.strip())
    if partial_line.strip():
        tail.append(partial_line.decode(errors="replace").rstrip())
    done.set()


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
