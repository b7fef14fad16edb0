"""The embedded engine's settings, checked before anything starts.

``sieproxy config`` and ``sieproxy serve`` run the engine's own argument parser on the command
line the gateway would start it with (``sieproxy-engine check serve|fake ...``: the parser and,
for the CPU engine, the model's lookup; nothing is loaded or started), so ``embedded_engine.model
= "/nonexistent"`` or ``extra_args = ["--threads", "abc"]`` is refused at start, naming the key,
instead of an engine crashing and being restarted behind a gateway that answers "loading". The
gateway still never imports ``engine``: the check is a child process, like the engine itself.
"""

from __future__ import annotations

import logging
import subprocess

from ..settings.schema import ConfigError, Settings
from .child import engine_argv

__all__ = ["CHECK_TIMEOUT", "check_engine_setup"]

log = logging.getLogger("sieproxy.child")

#: Seconds the check may take (it imports the engine's modules: torch, for the CPU engine).
CHECK_TIMEOUT = 300.0


def check_engine_setup(settings: Settings, where: str) -> None:
    """Refuse (``ConfigError`` naming ``embedded_engine.model`` or ``.extra_args``) an embedded
    engine whose command line its own parser rejects; nothing when it is disabled."""
    e = settings.embedded_engine
    if not e.enabled:
        return
    argv = engine_argv(e.model, e.host, e.port, e.served_name, e.engine_args(), kind=e.kind)
    argv = [*argv[:3], "check", *argv[3:]]  # python -m engine check serve|fake ...
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=CHECK_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:  # no verdict: the start will tell
        log.warning("the embedded engine's settings could not be checked: %s", exc)
        return
    if proc.returncode == 0:
        return
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    problem = lines[-1] if lines else f"the engine's check exited with code {proc.returncode}"
    problem = problem.split(": error: ", 1)[-1]
    model = "argument --model" in problem or "argument --model-path" in problem
    key = "embedded_engine.model" if model else "embedded_engine.extra_args"
    raise ConfigError(f"{where}: key `{key}`: the engine refuses it: {problem}")
