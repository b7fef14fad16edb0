"""Running the gateway: state from settings, background tasks, Hypercorn on Trio, shutdown.

``serve()`` is what ``sieproxy serve`` runs; ``asgi.app`` is the same app for running under the
``hypercorn`` command with several worker processes (see docs/DEPLOYMENT.md).

Background tasks (in the app's serving nursery): a health watcher per replica, and per model a
discovery from the engine's ``/model_info`` and ``/server_info`` (``_discover``): the context
length and vocabulary size the core checks requests against, and — for a model with no
configured chat template — the template (``tokenizer_path``, a local directory when the engine
runs on the same host, as the embedded CPU engine does). Until the template is discovered, such
a model is not ready (503 "model loading").

Shutdown: on SIGTERM/SIGINT the gateway stops accepting connections, answers new requests on
open connections with 503, lets in-flight streams run for ``shutdown_grace`` seconds, then ends
them — every unfinished candidate aborted upstream, each client sent a 503 "shutting down"
error event and [DONE] — cancels what is still left, and stops the engine child (after the
aborts, so they reach it). During the drain a SIGTERM is logged and changes nothing (tox and
process managers follow SIGINT with SIGTERM within a second); a second SIGINT — a second
Ctrl-C — ends the streams the same way at once.
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import signal
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from msgspec.structs import replace as struct_replace
from quart import Quart

from .app import GatewayState, create_app
from .auth import Authenticator
from .child import LAUNCH_TOKEN_ENV, PortInUse, claim_port, engine_argv, supervise_child
from .core.errors import GatewayError
from .core.profile import ModelProfile, positive_int
from .core.protocol import protocol_for
from .core.template import check_template
from .discovery import EngineSources
from .engine_client import EngineClient
from .hypercorn_io import install as install_hypercorn_io
from .observe import Observer
from .pool import ModelPool
from .relay import GenerationBody, sweep_stalls
from .settings import (
    DEFAULT_MODEL_NAME,
    ConfigError,
    EngineSpec,
    GatewaySettings,
    ModelSettings,
    Settings,
    load_settings,
)
from .tokenizer_dir import read_tokenizer_dir

__all__ = ["build_app", "build_state", "claim_ports", "serve"]

log = logging.getLogger("sieproxy")


#: ``embedded_engine.model`` values naming the bundled default (as the CPU engine reads them).
_DEFAULT_MODEL_ALIASES = frozenset(
    {"", "default", "smollm2", "smollm2-135m-instruct", DEFAULT_MODEL_NAME.lower()}
)
#: The bundled default's tool-call parser (its chat template ignores ``tools``; the gateway
#: shows them with an example call in this format).
DEFAULT_MODEL_TOOL_PARSER = "smollm2"


def effective_models(settings: Settings) -> dict[str, ModelSettings]:
    """Configured models, plus the embedded engine's model when it is enabled."""
    models = dict(settings.models)
    e = settings.embedded_engine
    if e.enabled:
        url = f"http://{e.host}:{e.port}"
        default = e.model.strip().lower() in _DEFAULT_MODEL_ALIASES
        models[e.served_name] = ModelSettings(
            engines=[EngineSpec(url=url)],
            tool_parser=e.tool_parser or (DEFAULT_MODEL_TOOL_PARSER if default else None),
            reasoning_parser=e.reasoning_parser,
        )
    return models


def _profile(name: str, m: ModelSettings, settings: Settings) -> ModelProfile:
    template, variables = m.chat_template, {}
    if m.tokenizer:
        src = read_tokenizer_dir(m.tokenizer)
        template, variables = src.template, src.variables
    return ModelProfile(
        name=name,
        inputs=frozenset(m.inputs),
        encode_only=m.encode_only,
        lora_names=frozenset(m.lora_paths),
        tool_parser=m.tool_parser,
        reasoning_parser=m.reasoning_parser,
        schema_in_prompt=m.schema_in_prompt,
        default_max_tokens=m.default_max_tokens or settings.gateway.default_max_tokens,
        max_tool_calls=m.max_tool_calls,
        max_image_bytes=settings.gateway.max_image_bytes,
        chat_template=template,
        template_vars=variables,
        stop=tuple(m.stop),
        pools=frozenset(s.pool for s in _specs(m) if s.pool),
        machine_profiles=frozenset(s.machine_profile for s in _specs(m) if s.machine_profile),
    )


def _specs(m: ModelSettings) -> list[EngineSpec]:
    return [e if isinstance(e, EngineSpec) else EngineSpec(url=e) for e in m.engines]


def build_state(settings: Settings) -> GatewayState:
    """Everything the routes need (no I/O beyond reading local template files).

    ``settings`` come from :func:`load_settings`, which has checked parser names and templates.
    """
    g = settings.gateway
    models = effective_models(settings)
    try:
        profiles = {name: _profile(name, m, settings) for name, m in models.items()}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    sources = {
        name: EngineSources(name, _specs(m), m.engines_file, g.health_timeout)
        for name, m in models.items()
    }
    pools = {
        name: ModelPool(name, sources[name].specs(), g, routing=m.routing)
        for name, m in models.items()
    }
    if settings.embedded_engine.enabled:
        pools[settings.embedded_engine.served_name].launch_token = secrets.token_urlsafe(16)
    for name, m in models.items():
        if not m.tokenizer and not m.chat_template:
            pools[name].gate_open = False  # discover the template from the engine first
    active: set[GenerationBody] = set()

    def inflight() -> dict[str, int]:
        counts: dict[str, int] = {}
        for b in active:
            counts[b.stats.model] = counts.get(b.stats.model, 0) + 1
        return counts

    return GatewayState(
        settings=settings,
        profiles=profiles,
        pools=pools,
        client=EngineClient(g),
        auth=Authenticator(g.auth, settings.auth_tokens()),
        observer=Observer(
            pools,
            access_log_enabled=g.access_log,
            inflight=inflight,
            with_fallbacks=[name for name, m in models.items() if m.fallbacks],
        ),
        active=active,
        sources=sources,
    )


async def _discover(state: GatewayState, model: str) -> None:
    """Learn what the model's engine knows, once, from its first ready replica: the context
    length (``/server_info``) and vocabulary size (``/model_info``'s ``vocab_size``, else the
    ``config.json`` of a local model directory), which the core checks requests against; and,
    for a model with no configured template, the chat template (then the model opens)."""
    pool = state.pools[model]
    need_template = not pool.gate_open
    while True:
        for r in pool.replicas:
            if not r.ready:
                continue
            info: dict[str, Any] = {}
            server: dict[str, Any] = {}
            if protocol_for(r.protocol).server_info:  # an OpenAI engine has neither endpoint
                try:
                    info = await state.client.model_info(r.url)
                    server = await state.client.server_info(r.url)
                except GatewayError:
                    continue
            path = info.get("tokenizer_path") or info.get("model_path")
            local = isinstance(path, str) and await trio.Path(path).is_dir()
            if need_template and local:
                assert isinstance(path, str)
                _read_template(state, model, path)
            _apply_limits(state, model, info, server, path if local else None)
            if need_template:
                if state.profiles[model].chat_template is None:
                    log.warning(
                        "model %s: no chat template configured or discoverable; "
                        "using the plain role-prefixed rendering",
                        model,
                    )
                pool.gate_open = True
            return
        await trio.sleep(0.5)


def _read_template(state: GatewayState, model: str, path: str) -> None:
    try:
        src = read_tokenizer_dir(path)
        if src.template:
            check_template(src.template)
    except ValueError as exc:  # logged; the plain rendering serves instead of a 500 a request
        log.error("model %s: %s (from %s)", model, exc, path)
        return
    if src.template:
        state.profiles[model] = replace(
            state.profiles[model], chat_template=src.template, template_vars=src.variables
        )
        log.info("model %s: chat template read from %s", model, path)


def _apply_limits(
    state: GatewayState,
    model: str,
    info: dict[str, Any],
    server: dict[str, Any],
    local_dir: str | None,
) -> None:
    context = positive_int(server.get("context_length"))
    vocab = positive_int(info.get("vocab_size"))
    if vocab is None and local_dir is not None:
        try:
            config = msgspec.json.decode(Path(local_dir, "config.json").read_bytes())
        except (OSError, msgspec.DecodeError):
            config = None
        if isinstance(config, dict):
            vocab = positive_int(config.get("vocab_size"))
    state.profiles[model] = replace(
        state.profiles[model], context_length=context, vocab_size=vocab
    )
    log.info("model %s: context length %s, vocabulary %s", model, context, vocab)


def build_app(settings: Settings) -> Quart:
    """The app with its background tasks wired to Quart-Trio's serving nursery."""
    state = build_state(settings)
    app = create_app(state)

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
            nursery.start_soon(_discover, state, name)

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
            await _stop_requests(state, nursery.cancel_scope, g.abort_timeout + 1)
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
                outer.start_soon(partial(supervise_child, argv, name=f"{e.kind}-engine", env=env))
            if shutdown_trigger is None:
                outer.start_soon(_on_signals, stop, state, now, forced)
                if os.environ.get(EXIT_WITH_PARENT_ENV, "").strip() in ("1", "true", "yes"):
                    outer.start_soon(_watch_parent, stop, os.getppid())
            with now:
                async with trio.open_nursery() as nursery:

                    async def _http(task_status: trio.TaskStatus[list[str]]) -> None:
                        await hypercorn_serve(
                            web, cfg, shutdown_trigger=_trigger, task_status=task_status
                        )
                        nursery.cancel_scope.cancel()

                    if shutdown_trigger is None:
                        nursery.start_soon(_reload_on_sighup, state, config_path)
                    nursery.start_soon(_drain, nursery)
                    binds: list[str] = await nursery.start(_http)
                    task_status.started(binds)
                    nursery.start_soon(_announce_ready, state, binds)
            outer.cancel_scope.cancel()
    finally:
        uninstall()
    return bool(forced)


#: Set (to 1) by ``tox -e serve``: stop like on SIGTERM once the parent process is gone.
EXIT_WITH_PARENT_ENV = "SIEPROXY_EXIT_WITH_PARENT"


async def _watch_parent(stop: trio.Event, parent: int, every: float = 0.5) -> None:
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


async def _announce_ready(state: GatewayState, binds: list[str]) -> None:
    """One line once every model can be served: where the API is and what it serves."""

    def ready() -> bool:
        return all(p.gate_open and any(r.ready for r in p.replicas) for p in state.pools.values())

    while not ready():  # noqa: ASYNC110 - polled a few times a second, once, at start
        await trio.sleep(0.1)
    names = ", ".join(state.pools) or "no models"
    log.info("ready: %s/v1 — %s", binds[0] if binds else "(no listener)", names)


def reload_settings(state: GatewayState, path: str | None) -> list[str]:
    """Re-read the configuration and apply what can change while serving (SIGHUP).

    Applied: bearer tokens and the auth switch; each served model's engine list, its DNS
    entries and ``engines_file`` included (replicas added, relabelled or removed; see
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
    tokens = new.auth_tokens()  # reads tokens_file: once
    state.auth = Authenticator(new.gateway.auth, tokens)
    done.append(f"auth {'on' if new.gateway.auth else 'off'}, {len(tokens)} token(s)")
    old_models, new_models = effective_models(old), effective_models(new)
    for name, m in new_models.items():
        pool = state.pools.get(name)
        if pool is None:
            done.append(f"model {name!r} is new: not served until a restart")
            continue
        sources = state.sources[name]
        sources.configure(_specs(m), m.engines_file)  # DNS names resolve again at once
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
        return struct_replace(g, auth=False, tokens=[], tokens_file=None)

    if unauth(new.gateway) != unauth(old.gateway):
        done.append("[gateway] settings other than auth and tokens need a restart")
    return done


async def _reload_on_sighup(state: GatewayState, path: str | None) -> None:
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            try:
                lines = reload_settings(state, path)
            except ConfigError as exc:
                log.error("SIGHUP: configuration not reloaded, the running one stays: %s", exc)
                continue
            log.warning("SIGHUP: configuration reloaded: %s", "; ".join(lines))


async def _stop_requests(state: GatewayState, scope: trio.CancelScope, within: float) -> None:
    """End every in-flight request now — aborted upstream, its client told with a 503 "shutting
    down" (an SSE error event and [DONE] on a started stream) — then cancel ``scope`` once they
    are all gone, or after ``within`` seconds (a client that does not read)."""
    for body in list(state.active):
        body.shut_down()
    with trio.move_on_after(within):
        while state.active:  # noqa: ASYNC110 - bounded polling, during shutdown only
            await trio.sleep(0.02)
    scope.cancel()


async def _on_signals(
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
                    tasks.start_soon(_stop_requests, state, scope, 1.0)
                else:
                    left = max(0.0, grace - (trio.current_time() - started))
                    log.warning(
                        "%s during the drain: still draining %d request(s), at most %.0f s more "
                        "(Ctrl-C stops now)",
                        name,
                        n,
                        left,
                    )
