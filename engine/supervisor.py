"""Supervise one child process: start, wait until healthy, restart with backoff, stop cleanly.

Theory of operation. :meth:`Supervisor.run` loops over child *lives*. Each life spawns the
child in a new session (its own process group, so the whole tree can be signalled), then polls
``GET <health_url>`` every ``poll_interval`` until it answers 200 (ready), the child exits, or
``ready_timeout`` passes (the child is then stopped and counted as failed). The first readiness
is reported through ``task_status.started(self)``, so callers write
``sup = await nursery.start(Supervisor(spec).run)``. After readiness the life just waits for the
child to exit. Any exit — a crash, a clean exit, a readiness timeout — is followed by a backoff
sleep (``backoff_initial * backoff_factor**k``, capped at ``backoff_max``; ``k`` resets once a
child stayed up ``stable_after`` seconds) and a new life, until ``max_restarts`` is exceeded
(:class:`SupervisorError`).

Cancelling ``run`` stops the child in a shielded, bounded cleanup: SIGTERM to the process group,
up to ``stop_timeout`` seconds for the leader to exit, then SIGKILL; whatever is left in the
group (grandchildren) is killed too, so nothing is orphaned. :func:`supervise_until_signal`
wires SIGTERM/SIGINT to that cancellation for command-line use.

Known limit: if the supervisor itself is SIGKILLed, the child survives (no PDEATHSIG: trio
spawns from a worker thread, whose exit would fire it).
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx
import trio

__all__ = [
    "ChildSpec",
    "Supervisor",
    "SupervisorError",
    "SupervisorState",
    "SupervisorStatistics",
    "supervise_until_signal",
]


class SupervisorError(Exception):
    """The child could not be kept running (restart budget exhausted)."""


class SupervisorState(enum.Enum):
    """Where the supervisor is in a child's life."""

    IDLE = "idle"
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True)
class ChildSpec:
    """What to run and how to judge it. Times are in seconds.

    ``env`` None inherits the environment. ``health_url`` None means "ready once spawned".
    """

    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    health_url: str | None = None
    ready_timeout: float = 600.0
    poll_interval: float = 0.5
    backoff_initial: float = 1.0
    backoff_factor: float = 2.0
    backoff_max: float = 30.0
    stable_after: float = 60.0
    max_restarts: int | None = None
    stop_timeout: float = 10.0


@dataclass(frozen=True)
class SupervisorStatistics:
    """A snapshot of a :class:`Supervisor`."""

    state: SupervisorState
    pid: int | None
    starts: int
    restarts: int
    exit_codes: tuple[int, ...]


class Supervisor:
    """Keeps one child described by ``spec`` running (see the module docstring)."""

    def __init__(
        self, spec: ChildSpec, *, on_ready: Callable[[Supervisor], None] | None = None
    ) -> None:
        self.spec = spec
        self.on_ready = on_ready
        self.state = SupervisorState.IDLE
        self.pid: int | None = None
        self.starts = 0
        self.exit_codes: list[int] = []
        self._changed = trio.Event()
        self._status: trio.TaskStatus[Supervisor] | None = None

    @property
    def restarts(self) -> int:
        """How many times the child was started again after the first start."""
        return max(self.starts - 1, 0)

    def statistics(self) -> SupervisorStatistics:
        """Current state, pid and counters."""
        return SupervisorStatistics(
            self.state, self.pid, self.starts, self.restarts, tuple(self.exit_codes)
        )

    async def wait_state(self, state: SupervisorState) -> None:
        """Wait until the supervisor is in ``state``."""
        while self.state is not state:
            await self._changed.wait()

    def _set(self, state: SupervisorState) -> None:
        self.state = state
        self._changed.set()
        self._changed = trio.Event()

    async def run(
        self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Supervise until cancelled; ``task_status.started(self)`` at the first readiness.

        Raises :class:`SupervisorError` once more than ``max_restarts`` restarts in a row were
        needed.
        """
        spec = self.spec
        self._status = task_status
        failures = 0
        try:
            while True:
                ready_for = await self._life()
                if ready_for is not None and ready_for >= spec.stable_after:
                    failures = 0
                failures += 1
                if spec.max_restarts is not None and failures > spec.max_restarts:
                    raise SupervisorError(
                        f"child {spec.argv[0]!r} failed {failures} times in a row "
                        f"(exit codes {self.exit_codes[-failures:]})"
                    )
                self._set(SupervisorState.BACKOFF)
                delay = spec.backoff_initial * spec.backoff_factor ** (failures - 1)
                await trio.sleep(min(delay, spec.backoff_max))
        finally:
            self._status = None
            self._set(SupervisorState.STOPPED)

    async def _life(self) -> float | None:
        """One child life; returns how long it was ready (None if it never was)."""
        spec = self.spec
        self._set(SupervisorState.STARTING)
        proc = await trio.lowlevel.open_process(
            list(spec.argv),
            env=dict(spec.env) if spec.env is not None else None,
            cwd=spec.cwd,
            start_new_session=True,
        )
        self.pid = proc.pid
        self.starts += 1
        ready_at: float | None = None
        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    await proc.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                if await self._wait_healthy(proc):
                    ready_at = trio.current_time()
                    self._set(SupervisorState.READY)
                    self._report_ready()
                    await trio.sleep_forever()
                elif proc.returncode is None:
                    print(
                        f"supervisor: {spec.argv[0]} not ready after {spec.ready_timeout}s",
                        file=sys.stderr,
                    )
                    await self._stop(proc)
        finally:
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    self._set(SupervisorState.STOPPING)
                await self._stop(proc)
            assert proc.returncode is not None
            self.exit_codes.append(proc.returncode)
        return None if ready_at is None else trio.current_time() - ready_at

    def _report_ready(self) -> None:
        if self.on_ready is not None:
            self.on_ready(self)
        status = self._status
        if status is not None:
            self._status = None
            status.started(self)

    async def _wait_healthy(self, proc: trio.Process) -> bool:
        spec = self.spec
        if spec.health_url is None:
            return True
        timeout = httpx.Timeout(max(spec.poll_interval, 1.0))
        with trio.move_on_after(spec.ready_timeout):
            async with httpx.AsyncClient(timeout=timeout) as client:
                while proc.returncode is None:
                    try:
                        resp = await client.get(spec.health_url)
                        if resp.status_code == 200:
                            return True
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(spec.poll_interval)
        return False

    async def _stop(self, proc: trio.Process) -> None:
        """SIGTERM the group, wait up to ``stop_timeout``, SIGKILL; then reap leftovers."""
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            with trio.move_on_after(self.spec.stop_timeout):
                await proc.wait()
            if proc.returncode is None:
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # grandchildren left in the group


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def supervise_until_signal(
    spec: ChildSpec,
    *,
    on_ready: Callable[[Supervisor], None] | None = None,
    signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> Supervisor:
    """Run a :class:`Supervisor` until one of ``signals`` arrives, then stop the child cleanly.

    Returns the supervisor (for its statistics); raises :class:`SupervisorError` if the child
    cannot be kept running.
    """
    sup = Supervisor(spec, on_ready=on_ready)
    with trio.open_signal_receiver(*signals) as received:
        async with trio.open_nursery() as nursery:

            async def wait_signal() -> None:
                async for _ in received:
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(wait_signal)
            await sup.run()
            nursery.cancel_scope.cancel()
    return sup
