"""A serving process's lifecycle around ``serve`` (sieproxy/operations/serve.py): signals, the
drain, the configuration reload on SIGHUP, the parent watch and the "ready" line.

Shutdown: on SIGTERM/SIGINT the gateway stops accepting connections, answers new requests on
open connections with 503, lets in-flight streams run for ``shutdown_grace`` seconds, then ends
them — every unfinished candidate aborted upstream, each client sent a 503 "shutting down"
error event and [DONE] — cancels what is still left, and stops the engine child (after the
aborts, so they reach it). During the drain a SIGTERM is logged and changes nothing (tox and
process managers follow SIGINT with SIGTERM within a second); a second SIGINT — a second
Ctrl-C — ends the streams the same way at once.
"""

from __future__ import annotations

import logging
import os
import signal

import trio
from msgspec.structs import replace as struct_replace

from ..front.state import GatewayState, effective_models, engine_specs
from ..front.tenants import authenticator
from ..settings.load import ConfigError, GatewaySettings, load_settings

__all__ = [
    "EXIT_WITH_PARENT_ENV",
    "announce_ready",
    "on_signals",
    "reload_on_sighup",
    "reload_settings",
    "stop_requests",
    "watch_parent",
]

log = logging.getLogger("sieproxy")  # the name it has always logged under


#: Set (to 1) by ``tox -e serve``: stop like on SIGTERM once the parent process is gone.
EXIT_WITH_PARENT_ENV = "SIEPROXY_EXIT_WITH_PARENT"


async def watch_parent(stop: trio.Event, parent: int, every: float = 0.5) -> None:
    """Drain and stop (as on SIGTERM) once the process that started this one is gone, so a
    SIGKILLed tox leaves nothing running. Opt-in: a gateway started with ``nohup ... &`` is
    meant to outlive its shell."""
    while os.getppid() == parent:  # polled: no event tells of a parent's death
        with trio.move_on_after(every):
            await stop.wait()
        if stop.is_set():
            return
    if not stop.is_set():
        log.warning("the parent process (pid %d) is gone: shutting down", parent)
        stop.set()


async def announce_ready(state: GatewayState, binds: list[str]) -> None:
    """One line once every model can be served: where the API is and what it serves."""

    def ready() -> bool:
        return all(p.gate_open and any(r.ready for r in p.replicas) for p in state.pools.values())

    while not ready():  # noqa: ASYNC110 - polled a few times a second, once, at start
        await trio.sleep(0.1)
    names = ", ".join(state.pools) or "no models"
    log.info("ready: %s/v1 — %s", binds[0] if binds else "(no listener)", names)


def reload_settings(state: GatewayState, path: str | None) -> list[str]:
    """Re-read the configuration and apply what can change while serving (SIGHUP).

    Applied: bearer tokens, the keys file and the auth switch; each served model's engine
    list, its DNS entries and ``engines_file`` included (replicas added, relabelled or removed; see
    ``ModelPool.set_engines`` and ``sieproxy.discovery``). Everything else (models added
    or removed, templates, other ``[gateway]`` keys) needs a restart and is reported, not
    applied. Raises ``ConfigError`` for an invalid file, leaving the running configuration as
    it was. Returns one line per thing applied or ignored, for the log.
    """
    new = load_settings(path)
    old = state.settings
    done: list[str] = []
    # The running engine child keeps its settings (and the port picked for it at start).
    if struct_replace(new.embedded_engine, port=old.embedded_engine.port) != old.embedded_engine:
        done.append("[embedded_engine] settings need a restart")
    new.embedded_engine = old.embedded_engine
    state.auth = authenticator(new, state.pools)  # reads tokens_file and keys_file: once
    tenants = len({e.tenant.name for e in state.auth.keys.values()})
    on = "on" if state.auth.enabled else "off"
    done.append(f"auth {on}, {len(state.auth.keys)} key(s) of {tenants} tenant(s)")
    old_models, new_models = effective_models(old), effective_models(new)
    for name, m in new_models.items():
        pool = state.pools.get(name)
        if pool is None:
            done.append(f"model {name!r} is new: not served until a restart")
            continue
        sources = state.sources[name]
        sources.configure(engine_specs(m), m.engines_file)  # DNS names resolve again at once
        added, removed = sources.apply(pool)
        if added or removed:
            done.append(f"model {name!r}: engines added {added or '[]'}, removed {removed or '[]'}")
        if struct_replace(m, engines=[], engines_file=None) != struct_replace(
            old_models[name], engines=[], engines_file=None
        ):
            done.append(f"model {name!r}: settings other than engines need a restart")
    for name in old_models.keys() - new_models.keys():
        done.append(f"model {name!r} is gone from the file: still served until a restart")

    def unauth(g: GatewaySettings) -> GatewaySettings:
        return struct_replace(g, auth=False, tokens=[], tokens_file=None, keys_file=None)

    if unauth(new.gateway) != unauth(old.gateway):
        done.append("[gateway] settings other than auth and tokens need a restart")
    return done


async def reload_on_sighup(state: GatewayState, path: str | None) -> None:
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            try:
                lines = reload_settings(state, path)
            except ConfigError as exc:
                log.error("SIGHUP: configuration not reloaded, the running one stays: %s", exc)
                continue
            log.warning("SIGHUP: configuration reloaded: %s", "; ".join(lines))


async def stop_requests(state: GatewayState, scope: trio.CancelScope, within: float) -> None:
    """End every in-flight request now — aborted upstream, its client told with a 503 "shutting
    down" (an SSE error event and [DONE] on a started stream) — then cancel ``scope`` once they
    are all gone, or after ``within`` seconds (a client that does not read)."""
    for body in list(state.active):
        body.shut_down()
    with trio.move_on_after(within):
        while state.active:  # noqa: ASYNC110 - bounded polling, during shutdown only
            await trio.sleep(0.02)
    scope.cancel()


async def on_signals(
    stop: trio.Event, state: GatewayState, scope: trio.CancelScope, forced: list[bool]
) -> None:
    """One log line per signal. The first SIGINT/SIGTERM starts the drain; a SIGTERM during it
    changes nothing; a second SIGINT (a second Ctrl-C) ends the in-flight requests now (within
    a second; a third cancels them at once).

    The receiver stays open until ``serve`` returns, so no signal turns into a
    ``KeyboardInterrupt`` traceback while the gateway stops."""
    grace = state.settings.gateway.shutdown_grace
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as tasks:
            started = 0.0
            async for signum in signals:
                name, n = signal.Signals(signum).name, len(state.active)
                if not stop.is_set():
                    started = trio.current_time()
                    log.warning(
                        "%s: shutting down, draining %d in-flight request(s) for up to %g s "
                        "(Ctrl-C again to stop now)",
                        name,
                        n,
                        grace,
                    )
                    stop.set()
                elif signum == signal.SIGINT and forced:
                    log.warning("SIGINT a third time: cancelling the %d request(s) left", n)
                    scope.cancel()
                elif signum == signal.SIGINT:
                    log.warning(
                        "SIGINT again: stopping now, aborting %d in-flight request(s) upstream", n
                    )
                    forced.append(True)
                    tasks.start_soon(stop_requests, state, scope, 1.0)
                else:
                    left = max(0.0, grace - (trio.current_time() - started))
                    log.warning(
                        "%s during the drain: still draining %d request(s), at most %.0f s more "
                        "(Ctrl-C stops now)",
                        name,
                        n,
                        left,
                    )
