"""Orchestration: start the engine and the targets, run the load generator, collect results.

The orchestrator is plain synchronous Python: it only starts processes, waits, and reads
results; every timed measurement happens in the load generator process (see bench/loadgen.py).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench import targets as T


class Progress:
    """One status line on stderr (rewritten in place on a terminal, else printed now and then)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.prefix = ""

    def phase(self, text: str) -> None:
        self.prefix = text
        self._out(text, force=True)

    def update(self, text: str) -> None:
        self._out(f"{self.prefix}  {text}")

    def note(self, text: str) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K")
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def _out(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            sys.stderr.write("\r\x1b[K" + text[:160])
            sys.stderr.flush()
        elif force or now - self.last > 5:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            self.last = now

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


PROGRESS = Progress()


@dataclass
class Layout:
    """Which CPUs each party runs on (None: unpinned)."""

    sut: str | None = "1"
    harness: str | None = "0"

    @classmethod
    def make(cls, pin: bool) -> Layout:
        if not pin or (os.cpu_count() or 1) < 2:
            return cls(None, None)
        n = os.cpu_count() or 2
        return cls(sut=str(n - 1), harness=",".join(str(i) for i in range(n - 1)))


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def read_progress(stream: Any, err_lines: list[str]) -> None:
    """A load generator's stderr: ``PROGRESS {...}`` lines update the display, the rest is kept
    for the error report."""
    for line in stream:
        if line.startswith("PROGRESS "):
            d = json.loads(line[9:])
            PROGRESS.update(
                f"t={d['t']:.0f}/{d['of']:.0f}s chunks={d['chunks']} "
                f"open={d['inflight']} err={d['errors']}"
            )
        else:
            err_lines.append(line)


def run_loadgen(cfg: dict[str, Any], layout: Layout, label: str) -> dict[str, Any]:
    """Run one load generator process; returns its JSON result (``error`` key on failure)."""
    cfg = dict(cfg)
    argv = [*T.taskset(layout.harness), sys.executable, "-m", "bench.loadgen", json.dumps(cfg)]
    PROGRESS.phase(label)
    p = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=T.ROOT, text=True
    )
    assert p.stderr is not None and p.stdout is not None
    err_lines: list[str] = []
    # Drain stdout concurrently: a result larger than the pipe buffer would otherwise block the
    # load generator's final write while this loop still waits for stderr to close.
    stdout_parts: list[str] = []
    reader = threading.Thread(target=lambda: stdout_parts.append(p.stdout.read()), daemon=True)
    reader.start()
    read_progress(p.stderr, err_lines)
    reader.join()
    out = "".join(stdout_parts)
    p.wait()
    if p.returncode != 0 or not out:
        return {"error": "loadgen failed: " + "".join(err_lines)[-2000:]}
    return json.loads(out)


def run_load(cfg: dict[str, Any], layout: Layout, label: str,
             kind: str = "python") -> dict[str, Any]:
    """Run one measurement with the ``python`` (bench/loadgen.py) or ``native`` (C) load
    generator; both return the same result keys."""
    if kind == "native":
        from bench.native import run_native_loadgen

        return run_native_loadgen(cfg, layout, label)
    if kind != "python":
        raise ValueError(f"unknown load generator {kind!r}")
    return run_loadgen(cfg, layout, label)


def wait_engine_idle(engine_port: int, timeout: float = 15.0) -> dict[str, int]:
    """Wait until the engine runs no generation; returns its counters then."""
    end = time.monotonic() + timeout
    while True:
        st = T.engine_stats(engine_port)
        if st["running"] == 0 or time.monotonic() > end:
            return st
        time.sleep(0.1)


# ---- environment ------------------------------------------------------------------------------


def _pkg_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def versions(with_litellm: bool) -> dict[str, str | None]:
    v: dict[str, str | None] = {
        "python": platform.python_version(),
        "sieproxy": _pkg_version("sieproxy"),
        "trio": _pkg_version("trio"),
        "hypercorn": _pkg_version("hypercorn"),
        "quart": _pkg_version("quart"),
        "quart-trio": _pkg_version("quart-trio"),
        "httpx": _pkg_version("httpx"),
        "h11": _pkg_version("h11"),
    }
    b = T.nginx_binary()
    if b:
        r = subprocess.run([b, "-v"], capture_output=True, text=True)
        v["nginx"] = (r.stderr or r.stdout).strip().split("/")[-1]
    if with_litellm:
        v["litellm"] = T.litellm_version()
    try:
        v["git"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=T.ROOT
        ).stdout.strip()
    except OSError:
        v["git"] = None
    return v


def machine() -> dict[str, Any]:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "mem_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
    }


# ---- a run context ----------------------------------------------------------------------------


@dataclass
class Bench:
    """Shared state of one invocation: layout, engine settings, started targets, results."""

    layout: Layout
    tokens: int = 200
    ttft_ms: float = 0.0
    duration: float = 10.0
    warmup: float | None = None
    incremental: bool = True
    loadgen: str = "python"
    runs: list[dict[str, Any]] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)

    def start_targets(self, names: list[str], engine_port: int) -> dict[str, T.Target]:
        started: dict[str, T.Target] = {}
        for name in names:
            if name in self.unavailable:
                continue
            PROGRESS.phase(f"starting {name} ...")
            try:
                started[name] = T.start_target(name, engine_port, self.layout.sut)
            except Exception as exc:
                msg = f"{type(exc).__name__}: {exc}"
                PROGRESS.note(f"target {name} unavailable: {msg}")
                self.unavailable[name] = msg
        return started

    def load_cfg(self, tgt: T.Target, engine: T.Proc, *, n: int, concurrency: int,
                 itl_ms: float, tokens: int | None = None, **extra: Any) -> dict[str, Any]:
        tokens = tokens or self.tokens
        stream_s = (self.ttft_ms + tokens * itl_ms) / 1000
        ramp = min(max(stream_s, 0.2), 5.0) if concurrency > 1 else 0.0
        warmup = self.warmup if self.warmup is not None else ramp + 1.5
        fanout = n if tgt.split_n else 1
        cfg: dict[str, Any] = {
            "port": tgt.port, "path": tgt.path, "headers": tgt.headers, "n": n,
            "fanout": fanout, "tokens": tokens, "concurrency": concurrency,
            "duration": self.duration, "warmup": warmup, "ramp": ramp,
            "sut_pids": tgt.pids, "engine_pids": [engine.pid],
            "request_timeout": max(30.0, stream_s * 4 + 10),
        }
        cfg.update(extra)
        return cfg
