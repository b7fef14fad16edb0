"""The process supervisor and ``sieproxy-engine launch``, with a stand-in for SGLang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from engine.cli import launch_spec, main, sglang_argv
from engine.supervisor import ChildSpec, Supervisor, SupervisorError, SupervisorState
from tests.procs import alive, free_port

STANDIN = Path(__file__).with_name("standin_sglang.py")
ROOT = Path(__file__).resolve().parents[2]
GUARD = 20.0


async def wait_dead(*pids: int) -> bool:
    """Whether all ``pids`` are gone within a second (a killed process takes a moment)."""
    for _ in range(100):
        if not any(alive(pid) for pid in pids):
            return True
        await trio.sleep(0.01)
    return False


def read_log(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def spec_for(port: int, *extra: str, **kw: object) -> ChildSpec:
    options: dict[str, object] = {
        "health_url": f"http://127.0.0.1:{port}/health",
        "poll_interval": 0.05,
        "backoff_initial": 0.2,
        "backoff_factor": 2.0,
        "stop_timeout": 2.0,
    }
    options.update(kw)
    argv = [sys.executable, str(STANDIN), "--port", str(port), *extra]
    return ChildSpec(argv=argv, **options)  # type: ignore[arg-type]


async def healthy(port: int) -> bool:
    async with httpx.AsyncClient(timeout=1.0) as client:
        try:
            return (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
        except httpx.HTTPError:
            return False


async def test_ready_after_health_turns_200(nursery: trio.Nursery, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "log"
    with trio.fail_after(GUARD):
        t0 = trio.current_time()
        sup = await nursery.start(
            Supervisor(spec_for(port, "--delay", "0.5", "--log", str(log))).run
        )
        assert trio.current_time() - t0 >= 0.5
        assert sup.state is SupervisorState.READY and sup.starts == 1
        assert await healthy(port)
        pid = int(read_log(log)[0][0])
        assert sup.pid == pid and alive(pid)
        nursery.cancel_scope.cancel()


async def test_restart_after_crash_with_backoff(nursery: trio.Nursery, tmp_path: Path) -> None:
    port = free_port()
    log, state = tmp_path / "log", tmp_path / "state"
    extra = ("--crash-times", "2", "--state-file", str(state), "--log", str(log))
    with trio.fail_after(GUARD):
        sup = await nursery.start(Supervisor(spec_for(port, *extra)).run)
        starts = [float(line[1]) for line in read_log(log)]
        assert len(starts) == 3 and sup.starts == 3 and sup.restarts == 2
        assert sup.exit_codes == [3, 3]
        assert starts[1] - starts[0] >= 0.2  # backoff_initial
        assert starts[2] - starts[1] >= 0.4  # doubled
        assert await healthy(port)
        nursery.cancel_scope.cancel()


async def test_crash_after_ready_is_restarted(nursery: trio.Nursery, tmp_path: Path) -> None:
    port = free_port()
    state = tmp_path / "state"
    extra = ("--crash-times", "1", "--crash-after", "0.3", "--state-file", str(state))
    with trio.fail_after(GUARD):
        sup = await nursery.start(Supervisor(spec_for(port, *extra)).run)
        first = sup.pid
        await sup.wait_state(SupervisorState.BACKOFF)
        await sup.wait_state(SupervisorState.READY)
        assert sup.starts == 2 and sup.pid != first and sup.exit_codes == [3]
        assert first is not None and await wait_dead(first)
        assert await healthy(port)
        nursery.cancel_scope.cancel()


async def test_gives_up_after_max_restarts(tmp_path: Path) -> None:
    port = free_port()
    extra = ("--crash-times", "99", "--state-file", str(tmp_path / "state"))
    sup = Supervisor(spec_for(port, *extra, max_restarts=2, backoff_initial=0.05))
    with trio.fail_after(GUARD), pytest.raises(SupervisorError, match="3 times"):
        await sup.run()
    assert sup.starts == 3 and sup.state is SupervisorState.STOPPED


async def test_ready_timeout_counts_as_failure(tmp_path: Path) -> None:
    port = free_port()
    sup = Supervisor(
        spec_for(port, "--delay", "100", ready_timeout=0.3, max_restarts=1, backoff_initial=0.05)
    )
    with trio.fail_after(GUARD), pytest.raises(SupervisorError):
        await sup.run()
    assert sup.exit_codes == [-signal.SIGTERM, -signal.SIGTERM]


async def test_clean_shutdown_leaves_no_orphan(nursery: trio.Nursery, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "log"
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as inner:
            sup = await inner.start(
                Supervisor(spec_for(port, "--grandchild", "--log", str(log))).run
            )
            pid, _, grandchild = (int(float(x)) for x in read_log(log)[0])
            assert alive(pid) and alive(grandchild)
            inner.cancel_scope.cancel()
        assert await wait_dead(pid, grandchild)
        assert sup.exit_codes == [-signal.SIGTERM] and sup.state is SupervisorState.STOPPED


async def test_sigkill_after_stop_timeout(nursery: trio.Nursery, tmp_path: Path) -> None:
    port = free_port()
    with trio.fail_after(GUARD):
        async with trio.open_nursery() as inner:
            spec = spec_for(port, "--ignore-sigterm", stop_timeout=0.5)
            sup = await inner.start(Supervisor(spec).run)
            pid = sup.pid
            inner.cancel_scope.cancel()
            t0 = trio.current_time()
        assert trio.current_time() - t0 >= 0.5
        assert pid is not None and await wait_dead(pid)
        assert sup.exit_codes == [-signal.SIGKILL]


# ---- sieproxy-engine launch ---------------------------------------------------------------


def test_sglang_argv_and_spec() -> None:
    assert sglang_argv("0.0.0.0", 30001, ["--model-path", "m"], python="py") == [
        "py",
        "-m",
        "sglang.launch_server",
        "--host",
        "0.0.0.0",
        "--port",
        "30001",
        "--model-path",
        "m",
    ]
    spec = launch_spec(["--sglang", "--host", "0.0.0.0", "--port", "31000", "--", "--tp", "2"])
    assert spec.argv[-4:] == ["--port", "31000", "--tp", "2"]
    assert spec.health_url == "http://127.0.0.1:31000/health"
    spec = launch_spec(["--health-url", "http://h/health", "--", "prog", "-x"])
    assert spec.argv == ["prog", "-x"] and spec.health_url == "http://h/health"
    with pytest.raises(SystemExit):
        launch_spec([])
    assert main([]) == 2
    assert main(["nope"]) == 2


async def _run_cli(argv: list[str], port: int, sig: signal.Signals, env: dict[str, str]) -> int:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "engine", *argv], env=env, cwd=ROOT, stderr=subprocess.DEVNULL
    )
    try:
        while not await healthy(port):
            assert proc.returncode is None, "the launcher died"
            await trio.sleep(0.05)
        proc.send_signal(sig)
        with trio.fail_after(10):
            return await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_cli_launch_command_and_sigterm(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [
        "launch",
        "--poll-interval",
        "0.05",
        "--health-url",
        f"http://127.0.0.1:{port}/health",
        "--",
        sys.executable,
        str(STANDIN),
        "--port",
        str(port),
        "--grandchild",
        "--log",
        str(log),
    ]
    with trio.fail_after(GUARD):
        assert await _run_cli(argv, port, signal.SIGTERM, env) == 0
    pid, _, grandchild = (int(float(x)) for x in read_log(log)[0])
    assert await wait_dead(pid, grandchild)


async def test_cli_launch_sglang_and_sigint(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(STANDIN.parent)])}
    argv = [
        "launch",
        "--sglang",
        "--sglang-module",
        "standin_sglang",
        "--port",
        str(port),
        "--poll-interval",
        "0.05",
        "--",
        "--delay",
        "0.2",
        "--log",
        str(log),
    ]
    with trio.fail_after(GUARD):
        assert await _run_cli(argv, port, signal.SIGINT, env) == 0
    assert await wait_dead(int(read_log(log)[0][0]))
