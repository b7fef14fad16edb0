"""Helpers for tests that run engines as real subprocesses."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL and reap."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
