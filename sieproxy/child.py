"""Supervise the embedded CPU engine as a child process of the gateway.

The gateway never imports ``engine``: it starts ``python -m engine serve ...`` and talks to it
over the wire like any other engine. The child is restarted with exponential backoff when it
exits, and terminated (SIGTERM, then SIGKILL after a grace period) when the gateway stops.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys

import trio

__all__ = ["supervise_child"]

log = logging.getLogger("sieproxy.child")


async def supervise_child(
    argv: list[str],
    *,
    name: str = "engine",
    backoff: float = 1.0,
    backoff_max: float = 30.0,
    stop_grace: float = 10.0,
) -> None:
    """Run ``argv`` forever (restarting on exit) until cancelled; then stop it cleanly."""
    delay = backoff
    while True:
        started = trio.current_time()
        proc = await trio.lowlevel.open_process(argv, stdin=subprocess.DEVNULL)
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
            raise
        log.warning("%s exited with code %s; restarting in %.1fs", name, code, delay)
        if trio.current_time() - started > 60:
            delay = backoff
        await trio.sleep(delay)
        delay = min(backoff_max, delay * 2)


def engine_argv(model: str, host: str, port: int, served_name: str, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "engine",
        "serve",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_name,
        *extra,
    ]
