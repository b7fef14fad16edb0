"""Running the gateway: state from settings, background tasks, Hypercorn on Trio, shutdown.

``serve()`` is what ``sieproxy serve`` runs; ``asgi.app`` is the same app for running under the
``hypercorn`` command with several worker processes (see docs/DEPLOYMENT.md).

Background tasks (in the app's serving nursery, :func:`build_app`): a health watcher per replica,
the stall sweeper, the wait timer, the relay pump, and per model its engine sources and the
discovery of what its engine knows (sieproxy/front/state.py). Signals, the drain and the reload on
SIGHUP: sieproxy/operations/lifecycle.py.
"""

from __future__ import annotations

import gc
import logging
import os
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import Quart

from ..front.app import create_app
from ..front.hypercorn_io import install as install_hypercorn_io
from ..front.state import GatewayState, build_state, discover, effective_models
from ..front.tenants import run_tenancy
from ..relay.body import sweep_stalls
from ..settings.load import Settings
from ..surfaces import SURFACES, Surface
from .child import LAUNCH_TOKEN_ENV, PortInUse, claim_port, engine_argv, supervise_child
from .lifecycle import (
    EXIT_WITH_PARENT_ENV,
    announce_ready,
    on_signals,
    reload_on_sighup,
    reload_settings,
    stop_requests,
    watch_parent,
)

__all__ = [
    "GC_THRESHOLDS",
    "build_app",
    "build_state",
    "claim_ports",
    "effective_models",
    "hypercorn_config",
    "reload_settings",
    "serve",
    "tune_gc",
]

log = logging.getLogger("sieproxy")


def build_app(settings: Settings, surfaces: tuple[Surface, ...] = SURFACES) -> Quart:
    """The app serving ``surfaces``, with its background tasks wired to Quart-Trio's serving
    nursery."""
    state = build_state(settings)
    app = create_app(state, surfaces)

    @app.before_serving
    async def _start_background() -> None:
        nursery: trio.Nursery = app.nursery  # type: ignore[attr-defined]
        nursery.start_soon(sweep_stalls, state.active, settings.gateway.client_stall_timeout)
        nursery.start_soon(state.timer.run)
        if settings.gateway.fast_paths:
            nursery.start_soon(state.pump.run)
        for name, pool in state.pools.items():
            nursery.start_soon(pool.run_health_checks, state.client)
            nursery.start_soon(state.sources[name].run, pool)  # DNS names, engines file
            nursery.start_soon(discover, state, name)
            if pool.policy is not None:  # routing = "cache_aware": KV events, its tokenizer
                nursery.start_soon(pool.policy.run, pool, state.client)
        nursery.start_soon(run_tenancy, state, list(state.pools))  # keys file, Redis

    @app.after_serving
    async def _stop_background() -> None:
        with trio.move_on_after(2, shield=True):
            await state.client.aclose()

    return app


#: Generation thresholds for the cyclic garbage collector of a serving process (see
#: ``tune_gc``); CPython's default is (700, 10, 10).
GC_THRESHOLDS = (10_000, 10, 10)


def tune_gc() -> None:
    """Make the garbage collector fit a process holding thousands of open streams.

    Every open stream keeps a few hundred objects alive (Hypercorn's protocol objects, the
    request's tasks, channels and shaper) and every relayed chunk allocates a few more. With
    CPython's defaults a full collection ran about every 1.4 s at 1,000 open streams, each
    walking ~330,000 objects: 36 % of the gateway's CPU and the main source of its inter-chunk
    jitter (p99 gap 923 ms at a 400 ms ITL). Freezing what exists once the app is built (it
    lives as long as the process) and collecting the young generation every 10,000 instead of
    700 allocations brought the collector to ~2.5 % and the p99 gap to 431 ms (docs/DESIGN.md).
    Called by the process entry points (``sieproxy serve``, ``sieproxy.asgi``), not by
    ``build_app``, so embedding the app elsewhere leaves the host's collector alone.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def hypercorn_config(settings: Settings) -> HypercornConfig:
    g = settings.gateway
    cfg = HypercornConfig()
    cfg.bind = [f"{g.host}:{g.port}"]
    # Hypercorn cancels what is left after its graceful timeout; the gateway's own drain
    # (``serve``) ends requests with an error event at shutdown_grace first, and cancels after.
    cfg.graceful_timeout = g.shutdown_grace + g.abort_timeout + 2
    cfg.keep_alive_timeout = 75  # longer than typical client/LB idle timeouts
    cfg.backlog = 2048
    cfg.accesslog = None  # the gateway writes its own structured access log
    # Hypercorn's own logger, through the root handler: with errorlog "-" Hypercorn adds a
    # handler *and* propagates, and every line ("Running on ...") was printed twice.
    cfg.errorlog = logging.getLogger("hypercorn.error")
    cfg.h11_max_incomplete_size = 64 * 1024  # header floods get 400/431 quickly
    # No cfg.read_timeout: Hypercorn applies it while a response is still being sent, which
    # would cut long streams; request bodies are bounded by Quart's BODY_TIMEOUT instead.
    return cfg


def claim_ports(settings: Settings) -> None:
    """Check the gateway's port and give the embedded engine one of its own, before starting.

    A taken port raises ``PortInUse`` naming it and what holds it (one line from the command
    line, instead of a traceback from the bind, or an engine restarting in a loop behind a
    gateway that answers from another instance's engine). ``embedded_engine.port = 0`` (the
    default) becomes a free port, fixed for this run.
    """
    g, e = settings.gateway, settings.embedded_engine
    if g.port:
        try:
            claim_port(g.host, g.port)
        except PortInUse as exc:
            raise PortInUse(f"the gateway's port {exc}; choose another with --port") from None
    if not e.enabled:
        return
    try:
        e.port = claim_port(e.host, e.port)
    except PortInUse as exc:
        raise PortInUse(
            f"the embedded engine's port (embedded_engine.port) {exc}; "
            "choose another, or 0 to pick a free one"
        ) from None


async def serve(
    settings: Settings,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    shutdown_trigger: trio.Event | None = None,
    app: Quart | None = None,
    config_path: str | None = None,
) -> bool:
    """Serve until SIGTERM/SIGINT (or ``shutdown_trigger``); ``task_status`` gets the binds.

    Without a ``shutdown_trigger`` (a real process), SIGHUP reloads ``config_path`` (or
    ``$SIEPROXY_CONFIG``; see ``reload_settings``). Returns True when a second SIGINT cut the
    drain short."""
    if app is None:
        claim_ports(settings)
        app = build_app(settings)
    web: Quart = app
    state: GatewayState = app.extensions["sieproxy"]
    cfg = hypercorn_config(settings)
    stop = shutdown_trigger if shutdown_trigger is not None else trio.Event()
    forced: list[bool] = []

    async def _trigger() -> None:
        await stop.wait()
        state.draining = True
        if shutdown_trigger is not None:  # with signals, their handler says it
            log.info("shutting down: draining %d in-flight requests", len(state.active))

    async def _drain(nursery: trio.Nursery) -> None:
        # Hypercorn's trio worker waits out the whole grace period while any idle keep-alive
        # connection is open; return as soon as the in-flight responses are all sent instead.
        await stop.wait()
        g = settings.gateway
        with trio.move_on_after(g.shutdown_grace):
            while state.active:  # noqa: ASYNC110 - bounded polling, during shutdown only
                await trio.sleep(0.02)
        if state.active:
            # The grace is over: each request ends with a 503 "shutting down" (an SSE error
            # event and [DONE] on a started stream), aborted upstream; then whatever is left
            # (a client that does not read, say) is cancelled.
            log.warning(
                "shutdown grace of %g s over: stopping %d request(s)",
                g.shutdown_grace,
                len(state.active),
            )
            await stop_requests(state, nursery.cancel_scope, g.abort_timeout + 1)
        nursery.cancel_scope.cancel()

    uninstall = install_hypercorn_io(fast=settings.gateway.fast_paths)  # at start, not import
    try:
        # The engine child lives in the outer nursery: it is stopped only once the inner one
        # (the HTTP server and every request in it, with their shielded upstream aborts) has
        # finished. The signal handler lives there too, so no signal is left to Python until
        # serve returns.
        now = trio.CancelScope()  # the inner nursery's, for "stop now"
        async with trio.open_nursery() as outer:
            e = settings.embedded_engine
            token = state.pools[e.served_name].launch_token if e.enabled else None
            if e.enabled and token:
                argv = engine_argv(
                    e.model, e.host, e.port, e.served_name, e.engine_args(), kind=e.kind
                )
                env = {**os.environ, LAUNCH_TOKEN_ENV: token}
                pool = state.pools[e.served_name]

                def given_up(reason: str) -> None:
                    pool.failed = reason

                supervise = partial(
                    supervise_child,
                    argv,
                    name=f"{e.kind}-engine",
                    env=env,
                    ready=lambda: any(r.ready for r in pool.replicas),
                    on_failed=given_up,
                )
                outer.start_soon(supervise)
            if shutdown_trigger is None:
                outer.start_soon(on_signals, stop, state, now, forced)
                if os.environ.get(EXIT_WITH_PARENT_ENV, "").strip() in ("1", "true", "yes"):
                    outer.start_soon(watch_parent, stop, os.getppid())
            with now:
                async with trio.open_nursery() as nursery:

                    async def _http(task_status: trio.TaskStatus[list[str]]) -> None:
                        await hypercorn_serve(
                            web, cfg, shutdown_trigger=_trigger, task_status=task_status
                        )
                        nursery.cancel_scope.cancel()

                    if shutdown_trigger is None:
                        nursery.start_soon(reload_on_sighup, state, config_path)
                    nursery.start_soon(_drain, nursery)
                    binds: list[str] = await nursery.start(_http)
                    task_status.started(binds)
                    nursery.start_soon(announce_ready, state, binds)
            outer.cancel_scope.cancel()
    finally:
        uninstall()
    return bool(forced)
