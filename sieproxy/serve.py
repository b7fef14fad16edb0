"""Running the gateway: state from settings, background tasks, Hypercorn on Trio, shutdown.

``serve()`` is what ``sieproxy serve`` runs; ``asgi.app`` is the same app for running under the
``hypercorn`` command with several worker processes (see docs/DEPLOYMENT.md).

Background tasks (in the app's serving nursery): a health watcher per replica, and — for a model
with no configured chat template — discovery of the template from the engine's ``/model_info``
(``tokenizer_path``, a local directory when the engine runs on the same host, as the embedded
CPU engine does). Until discovery has run, the model is not ready (503 "model loading").

Shutdown: on SIGTERM/SIGINT the gateway stops accepting connections, answers new requests on
open connections with 503, lets in-flight streams run for ``shutdown_grace`` seconds, then
cancels them — which aborts every unfinished candidate upstream — and stops the engine child.
"""

from __future__ import annotations

import gc
import logging
import signal
from dataclasses import replace

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from msgspec.structs import replace as struct_replace
from quart import Quart

from .app import GatewayState, create_app
from .auth import Authenticator
from .child import engine_argv, supervise_child
from .core.errors import GatewayError
from .core.profile import ModelProfile
from .core.reasoning import make_reasoning_parser
from .core.template import check_template
from .core.toolparse import make_tool_parser
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

__all__ = ["build_app", "build_state", "serve"]

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
        parser = DEFAULT_MODEL_TOOL_PARSER if default else None
        models[e.served_name] = ModelSettings(engines=[EngineSpec(url=url)], tool_parser=parser)
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


def _check_profile(p: ModelProfile) -> None:
    """Fail at start, naming the key, for what would otherwise be a 500 on every request."""
    key = f"models.{p.name}"
    try:
        make_tool_parser(p.tool_parser, tool_names=())
    except ValueError as exc:
        raise ConfigError(f"key `{key}.tool_parser`: {exc}") from None
    try:
        make_reasoning_parser(p.reasoning_parser, enable_thinking=None)
    except ValueError as exc:
        raise ConfigError(f"key `{key}.reasoning_parser`: {exc}") from None
    if p.chat_template is not None:
        try:
            check_template(p.chat_template)
        except GatewayError:
            raise ConfigError(f"key `{key}`: the chat template does not compile") from None


def build_state(settings: Settings) -> GatewayState:
    """Everything the routes need (no I/O beyond reading local template files)."""
    g = settings.gateway
    models = effective_models(settings)
    try:
        profiles = {name: _profile(name, m, settings) for name, m in models.items()}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for p in profiles.values():
        _check_profile(p)
    pools = {name: ModelPool(name, _specs(m), g) for name, m in models.items()}
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
        observer=Observer(pools, access_log_enabled=g.access_log, inflight=inflight),
        active=active,
    )


async def _discover_template(state: GatewayState, model: str) -> None:
    pool = state.pools[model]
    while True:
        for r in pool.replicas:
            if not r.ready:
                continue
            try:
                info = await state.client.model_info(r.url)
            except GatewayError:
                continue
            path = info.get("tokenizer_path") or info.get("model_path")
            if isinstance(path, str) and await trio.Path(path).is_dir():
                try:
                    src = read_tokenizer_dir(path)
                except ValueError as exc:
                    log.warning("model %s: %s", model, exc)
                else:
                    if src.template:
                        state.profiles[model] = replace(
                            state.profiles[model],
                            chat_template=src.template,
                            template_vars=src.variables,
                        )
                        log.info("model %s: chat template read from %s", model, path)
            if state.profiles[model].chat_template is None:
                log.warning(
                    "model %s: no chat template configured or discoverable; "
                    "using the plain role-prefixed rendering",
                    model,
                )
            pool.gate_open = True
            return
        await trio.sleep(0.5)


def build_app(settings: Settings) -> Quart:
    """The app with its background tasks wired to Quart-Trio's serving nursery."""
    state = build_state(settings)
    app = create_app(state)

    @app.before_serving
    async def _start_background() -> None:
        nursery: trio.Nursery = app.nursery  # type: ignore[attr-defined]
        nursery.start_soon(sweep_stalls, state.active, settings.gateway.client_stall_timeout)
        nursery.start_soon(state.timer.run)
        nursery.start_soon(state.pump.run)
        for name, pool in state.pools.items():
            nursery.start_soon(pool.run_health_checks, state.client)
            if not pool.gate_open:
                nursery.start_soon(_discover_template, state, name)

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
    cfg.graceful_timeout = g.shutdown_grace
    cfg.keep_alive_timeout = 75  # longer than typical client/LB idle timeouts
    cfg.backlog = 2048
    cfg.accesslog = None  # the gateway writes its own structured access log
    cfg.errorlog = "-"
    cfg.h11_max_incomplete_size = 64 * 1024  # header floods get 400/431 quickly
    # No cfg.read_timeout: Hypercorn applies it while a response is still being sent, which
    # would cut long streams; request bodies are bounded by Quart's BODY_TIMEOUT instead.
    return cfg


async def serve(
    settings: Settings,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    shutdown_trigger: trio.Event | None = None,
    app: Quart | None = None,
    config_path: str | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or ``shutdown_trigger``); ``task_status`` gets the binds.

    Without a ``shutdown_trigger`` (a real process), SIGHUP reloads ``config_path`` (or
    ``$SIEPROXY_CONFIG``; see ``reload_settings``)."""
    if app is None:
        app = build_app(settings)
    state: GatewayState = app.extensions["sieproxy"]
    cfg = hypercorn_config(settings)
    install_hypercorn_io()
    stop = shutdown_trigger if shutdown_trigger is not None else trio.Event()

    async def _trigger() -> None:
        await stop.wait()
        state.draining = True
        log.info("shutting down: draining %d in-flight requests", len(state.active))

    async def _drain(nursery: trio.Nursery) -> None:
        # Hypercorn's trio worker waits out the whole grace period while any idle keep-alive
        # connection is open; return as soon as the in-flight responses are all sent instead.
        await stop.wait()
        with trio.move_on_after(settings.gateway.shutdown_grace):
            while state.active:  # noqa: ASYNC110 - bounded polling, during shutdown only
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        e = settings.embedded_engine
        if e.enabled:
            argv = engine_argv(e.model, e.host, e.port, e.served_name, e.extra_args)
            nursery.start_soon(lambda: supervise_child(argv, name="cpu-engine"))
        if shutdown_trigger is None:
            nursery.start_soon(_wait_signals, stop)
            nursery.start_soon(_reload_on_sighup, state, config_path)
        nursery.start_soon(_drain, nursery)
        await hypercorn_serve(app, cfg, shutdown_trigger=_trigger, task_status=task_status)
        nursery.cancel_scope.cancel()


def reload_settings(state: GatewayState, path: str | None) -> list[str]:
    """Re-read the configuration and apply what can change while serving (SIGHUP).

    Applied: bearer tokens and the auth switch; each served model's engine list (replicas
    added, relabelled or removed; see ``ModelPool.set_engines``). Everything else (models added
    or removed, templates, other ``[gateway]`` keys) needs a restart and is reported, not
    applied. Raises ``ConfigError`` for an invalid file, leaving the running configuration as
    it was. Returns one line per thing applied or ignored, for the log.
    """
    new = load_settings(path)
    old = state.settings
    done: list[str] = []
    tokens = new.auth_tokens()  # reads tokens_file: once
    state.auth = Authenticator(new.gateway.auth, tokens)
    done.append(f"auth {'on' if new.gateway.auth else 'off'}, {len(tokens)} token(s)")
    old_models, new_models = effective_models(old), effective_models(new)
    for name, m in new_models.items():
        pool = state.pools.get(name)
        if pool is None:
            done.append(f"model {name!r} is new: not served until a restart")
            continue
        added, removed = pool.set_engines(_specs(m))
        if added or removed:
            done.append(f"model {name!r}: engines added {added or '[]'}, removed {removed or '[]'}")
        if struct_replace(m, engines=[]) != struct_replace(old_models[name], engines=[]):
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


async def _wait_signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop.set()
            return
