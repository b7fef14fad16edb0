"""The native (C) harness: build it, run its engine, its load generator and its spin loop.

The Python harness (bench/fastengine.py + bench/loadgen.py) costs ~60 µs of CPU per relayed
chunk; on a two-core machine that is most of a core at the rates a saturated gateway reaches,
which caps what a second gateway worker can add. ``bench/native/harness.c`` implements the
same wire behaviour (engine) and the same closed-loop measurement (load generator) in C on
epoll; see docs/BENCH-METHOD.md "The native harness".

The binary is compiled on first use with the system C compiler into
``~/.cache/sieproxy/bench/harness-<sha256 of the source and flags>`` and rebuilt whenever the
source changes (a new hash is a new file).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import targets as T
from bench.loadgen import public_config, window_fields, with_window
from bench.procstat import cpu_between, sample_tree, tree_rss

if TYPE_CHECKING:
    from bench.runner import Layout

SRC = Path(__file__).resolve().parent / "native" / "harness.c"
CFLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror"]
LIBS = ["-lm"]


class NativeUnavailable(RuntimeError):
    """No C compiler, or the harness does not compile."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sieproxy" / "bench"


def compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return cc
    for cand in ("cc", "gcc", "clang"):
        if shutil.which(cand):
            return cand
    return None


_lock = threading.Lock()


def binary() -> Path:
    """The path of the compiled harness, building it if needed."""
    src = SRC.read_bytes()
    digest = hashlib.sha256(src + " ".join(CFLAGS + LIBS).encode()).hexdigest()[:16]
    out = cache_dir() / f"harness-{digest}"
    with _lock:
        if out.exists():
            return out
        cc = compiler()
        if cc is None:
            raise NativeUnavailable(
                "the native harness needs a C compiler (cc, gcc or clang on PATH, or $CC); "
                "install one (e.g. `apt-get install gcc`) or run with --engine fast "
                "--loadgen python"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SRC), *LIBS],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise NativeUnavailable(f"{cc} failed to build {SRC}:\n{r.stderr[-4000:]}")
            os.chmod(tmp, 0o755)
            os.replace(tmp, out)  # atomic: a concurrent build leaves one complete binary
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def engine_argv(port: int, ttft_ms: float, itl_ms: float, tokens: int,
                incremental: bool) -> list[str]:
    """argv of the native engine (the same flags as bench/fastengine.py)."""
    return [
        str(binary()), "engine", "--port", str(port), "--ttft-ms", str(ttft_ms),
        "--itl-ms", str(itl_ms), "--tokens", str(tokens),
    ] + (["--incremental"] if incremental else [])


# ---- the load generator -----------------------------------------------------------------------

#: Config keys of bench/loadgen.py that the C load generator does not implement.
UNSUPPORTED = ("rate", "think")

#: How long after its start the C process begins its ramp (it starts in a millisecond or two).
START_DELAY = 0.2


def run_native_loadgen(cfg: dict[str, Any], layout: Layout, label: str) -> dict[str, Any]:
    """Same contract and result keys as ``runner.run_loadgen``, with the C load generator.

    The C process counts chunks, TTFTs and gaps in a window given as absolute monotonic times;
    this (orchestrating) process samples the CPU of the SUT's tree, the engine's tree and the
    load generator itself from /proc at those same instants.
    """
    from bench.runner import PROGRESS, read_progress  # runner imports this module lazily

    cfg = dict(cfg)
    bad = [k for k in UNSUPPORTED if cfg.get(k)]
    if int(cfg.get("fanout", 1)) != 1:
        bad.append("fanout > 1")
    if bad:
        return {"error": "native load generator: not implemented: " + ", ".join(bad)
                + " (use --loadgen python)"}
    try:
        exe = binary()
    except NativeUnavailable as exc:
        return {"error": str(exc)}
    sut = list(cfg.get("sut_pids", []))
    eng = list(cfg.get("engine_pids", []))
    warmup = float(cfg.get("warmup", 2.0))
    duration = float(cfg["duration"])
    idle = sample_tree(sut)
    start = time.monotonic() + START_DELAY
    ws = start + warmup
    we = ws + duration
    ccfg = {**public_config(cfg), "start": start, "window_start": ws, "window_end": we,
            "linger": 0.3}
    argv = [*T.taskset(layout.harness), str(exe), "load", json.dumps(ccfg)]
    PROGRESS.phase(label)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=T.ROOT)
    assert p.stdout is not None and p.stderr is not None
    stdout_parts: list[str] = []
    err_lines: list[str] = []
    readers = [
        threading.Thread(target=lambda s: stdout_parts.append(s.read()), args=(p.stdout,),
                         daemon=True),
        threading.Thread(target=read_progress, args=(p.stderr, err_lines), daemon=True),
    ]
    for t in readers:
        t.start()
    out: dict[str, Any] = {}
    rss_series: list[tuple[float, int]] = []
    try:
        _sleep_until(ws, p)
        if p.poll() is None:
            s0, e0, l0 = sample_tree(sut), sample_tree(eng), sample_tree([p.pid])
            hu0 = user_sys([*e0.pids, p.pid])
            m0 = machine_busy()
            w0 = time.monotonic()
            pids = s0.pids
            peak = s0.rss
            while time.monotonic() < we and p.poll() is None:
                _sleep_until(min(time.monotonic() + 0.5, we), p)
                r = tree_rss(pids)
                peak = max(peak, r)
                rss_series.append((time.monotonic() - ws, r))
            s1, e1, l1 = sample_tree(sut), sample_tree(eng), sample_tree([p.pid])
            hu1 = user_sys([*e1.pids, p.pid])
            m1 = machine_busy()
            wall = time.monotonic() - w0
            hu, hs = hu1[0] - hu0[0], hu1[1] - hu0[1]
            out.update(
                window_fields(wall, idle, s0, s1, e0, e1, peak),
                loadgen_cpu=cpu_between(l0, l1),
                loadgen_cpu_ticks=l1.cpu_ticks - l0.cpu_ticks,
                loadgen_rss=l1.rss,
                # share of the engine's + load generator's CPU spent in the kernel (ticks)
                harness_sys_share=hs / (hu + hs) if hu + hs > 0 else None,
                # cores busy on the whole machine, and those not used by SUT, engine or load
                # generator (this orchestrator, other work on a shared machine)
                machine_busy_cores=(m1 - m0) / wall,
                other_cores=(m1 - m0 - cpu_between(s0, s1) - cpu_between(e0, e1)
                             - cpu_between(l0, l1)) / wall,
                rss_series=rss_series,
            )
        p.wait(timeout=max(30.0, duration))
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for t in readers:
            t.join(timeout=5)
    text = "".join(stdout_parts)
    if p.returncode != 0 or not text or "wall" not in out:
        return {"error": f"native loadgen failed (exit {p.returncode}): "
                + "".join(err_lines)[-2000:]}
    raw = json.loads(text)
    return summarize(cfg, raw, out)


def user_sys(pids: list[int] | tuple[int, ...]) -> tuple[float, float]:
    """Summed (utime, stime) in seconds of ``pids`` (10 ms ticks; for the user/kernel split)."""
    tick = os.sysconf("SC_CLK_TCK")
    u = s = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        u += int(rest[11])
        s += int(rest[12])
    return u / tick, s / tick


def machine_busy() -> float:
    """Seconds of CPU time (all CPUs, anything but idle and iowait) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _sleep_until(t: float, p: subprocess.Popen[str]) -> None:
    while True:
        left = t - time.monotonic()
        if left <= 0 or p.poll() is not None:
            return
        time.sleep(min(left, 0.05))


def summarize(cfg: dict[str, Any], raw: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """The result dict of bench/loadgen.py (``Runner._summary``) from the C process's counts."""
    window = float(raw["window_s"]) or float(cfg["duration"])
    chunks = int(raw["chunks"])
    res: dict[str, Any] = {
        "config": public_config(cfg),
        "loadgen": "native",
        "window_s": window,
        "chunks": chunks,
        "content_chunks": raw["content_chunks"],
        "chunks_per_s": chunks / window,
        "requests_per_s": raw["window_completed"] / window,
        "requests_started": raw["requests_started"],
        "requests_completed": raw["requests_completed"],
        "window_completed": raw["window_completed"],
        "disconnects": raw["disconnects"],
        "window_disconnects": raw["window_disconnects"],
        "dropped": 0,
        "errors": raw["errors"],
        "window_errors": raw["window_errors"],
        "mean_inflight": raw["mean_inflight"],
        "inflight_at_stop": raw["inflight_at_stop"],
        "ttft_ms": raw["ttft_ms"],
        "all_first_ms": raw["all_first_ms"],
        "gap_ms": raw["gap_ms"],
        "ttft_samples": raw["ttft_samples"],
        "gap_samples": raw["gap_samples"],
        "all_first_samples": raw["all_first_samples"],
    }
    return with_window(res, out)


# ---- the machine's own ceiling ----------------------------------------------------------------


PY_SPIN = """
import sys, time
end = time.monotonic() + float(sys.argv[1])
n = 0
d = {i: "" for i in range(256)}
while True:
    for i in range(2000):
        d[i & 255] = str(i) + "x"
        n += len(d[(i * 7) & 255])
    if time.monotonic() >= end:
        break
print(n / float(sys.argv[1]))
"""


def _native_rate(out: str) -> float:
    d = json.loads(out)
    return float(d["iterations"] / d["seconds"])


def spin(argv: list[str], copies: int, seconds: float, rate: Callable[[str], float]) -> float:
    """Run ``copies`` of the CPU-bound loop ``argv`` at once; their summed work per second
    (``rate`` of each one's output)."""
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    total = 0.0
    for p in procs:
        o, _ = p.communicate(timeout=seconds + 30)
        if p.returncode != 0:
            raise RuntimeError(f"{Path(argv[0]).name} spin exited with {p.returncode}")
        total += rate(o)
    return total


def machine_ceiling(seconds: float, kind: str = "python") -> dict[str, Any]:
    """The machine's own scaling: a CPU-bound process alone vs two at once.

    Runs one, two, one, two, one (``seconds`` each), so that a drift of the machine's speed
    during the probe does not read as (anti-)scaling. Returns work per second: ``one`` (mean of
    the single runs), ``two`` (mean of the pairs' sums), ``ratio`` = two ÷ one (2.0 on a machine
    whose two CPUs are two full cores) and the individual runs.
    """
    rate: Callable[[str], float]
    if kind == "native":
        argv, rate = [str(binary()), "spin", str(seconds)], _native_rate
    else:  # a small CPU-bound Python loop (the gateway's own interpreter)
        argv, rate = [T.PY, "-c", PY_SPIN, str(seconds)], float
    ones: list[float] = []
    twos: list[float] = []
    for k in range(5):
        (twos if k % 2 else ones).append(spin(argv, 2 if k % 2 else 1, seconds, rate))
    one = sum(ones) / len(ones)
    two = sum(twos) / len(twos)
    return {"one": one, "two": two, "ratio": two / one if one else 0.0,
            "ones": ones, "twos": twos}
