"""The state every route shares (:class:`GatewayState`): built from the settings once per
process (:func:`build_state`), then completed from what each model's engine reports.

Per model, a background task (:func:`discover`, started by ``serve.build_app``) learns from the
engine's ``/model_info`` and ``/server_info`` the context length and vocabulary size the core
checks requests against, and — for a model with no configured chat template — the template
(``tokenizer_path``, a local directory when the engine runs on the same host, as the embedded
CPU engine does). Until the template is discovered, such a model is not ready (503 "model
loading").
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import trio

from ..core.errors import GatewayError
from ..core.planning.template import check_template
from ..core.request.profile import ModelProfile, positive_int
from ..core.upstream.protocol import protocol_for
from ..fleet.cache_route import CacheAwarePolicy
from ..fleet.client import EngineClient
from ..fleet.discovery import EngineSources
from ..fleet.pool import ModelPool
from ..observe.observer import Observer
from ..relay.body import GenerationBody
from ..relay.pump import Pump
from ..relay.timers import WaitTimer
from ..settings.load import (
    DEFAULT_MODEL_NAME,
    ConfigError,
    EngineSpec,
    ModelSettings,
    Settings,
)
from ..settings.tokenizer_dir import read_tokenizer_dir
from ..tenancy.gate import Tenancy
from ..tenancy.limiter import Limiter
from .auth import Authenticator
from .tenants import authenticator, build_tenancy

__all__ = [
    "DEFAULT_MODEL_TOOL_PARSER",
    "GatewayState",
    "build_state",
    "discover",
    "effective_models",
    "engine_specs",
]

log = logging.getLogger("sieproxy")  # the name it has always logged under


@dataclass
class GatewayState:
    """Everything the routes share; built once per process."""

    settings: Settings
    profiles: dict[str, ModelProfile]
    pools: dict[str, ModelPool]
    client: EngineClient
    auth: Authenticator
    observer: Observer
    draining: bool = False
    active: set[GenerationBody] = field(default_factory=set)
    timer: WaitTimer = field(default_factory=WaitTimer)
    pump: Pump = field(default_factory=Pump)
    #: Where each model's replicas come from (static entries, DNS names, an engines file).
    sources: dict[str, EngineSources] = field(default_factory=dict)
    created: Callable[[], int] = lambda: int(time.time())
    #: The tenants' limits (sieproxy/tenancy/gate.py).
    tenancy: Tenancy = field(default_factory=lambda: Tenancy(Limiter()))


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
            aliases=list(e.aliases),
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
        render=m.render_mode(),
        aliases=tuple(m.aliases),
        pools=frozenset(s.pool for s in engine_specs(m) if s.pool),
        machine_profiles=frozenset(s.machine_profile for s in engine_specs(m) if s.machine_profile),
    )


def engine_specs(m: ModelSettings) -> list[EngineSpec]:
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
        name: EngineSources(name, engine_specs(m), m.engines_file, g.health_timeout)
        for name, m in models.items()
    }
    pools = {
        name: ModelPool(name, sources[name].specs(), g, routing=m.routing)
        for name, m in models.items()
    }
    for name, m in models.items():
        if m.routing == "cache_aware":
            pools[name].policy = CacheAwarePolicy(name, m)
    if settings.embedded_engine.enabled:
        pools[settings.embedded_engine.served_name].launch_token = secrets.token_urlsafe(16)
    for name, m in models.items():
        pools[name].first_token = m.first_token_timeout
        pools[name].max_resumes = m.max_resumes
        if not m.tokenizer and not m.chat_template and m.render_mode() == "gateway":
            pools[name].gate_open = False  # discover the template from the engine first
    active: set[GenerationBody] = set()

    def inflight() -> dict[str, int]:
        counts: dict[str, int] = {}
        for b in active:
            counts[b.stats.model] = counts.get(b.stats.model, 0) + 1
        return counts

    observer = Observer(
        pools,
        access_log_enabled=g.access_log,
        inflight=inflight,
        with_fallbacks=[name for name, m in models.items() if m.fallbacks],
    )
    tenancy = build_tenancy(settings, on_reject=observer.tenant_rejected)
    observer.watch_limiter(tenancy.limiter)
    return GatewayState(
        settings=settings,
        profiles=profiles,
        pools=pools,
        client=EngineClient(g),
        auth=authenticator(settings, models),
        observer=observer,
        active=active,
        sources=sources,
        tenancy=tenancy,
    )


async def discover(state: GatewayState, model: str) -> None:
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
    state.profiles[model] = replace(state.profiles[model], context_length=context, vocab_size=vocab)
    if context is not None or vocab is not None:  # an engine that tells neither: nothing to say
        log.info(
            "model %s: context length %s, vocabulary %s",
            model, context or "not reported", vocab or "not reported",
        )  # fmt: skip
