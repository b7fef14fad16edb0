"""The checks of loaded settings: each failure a ``ConfigError`` naming the source, the key and
what to change.

Every value is checked at load time (ranges, parser names, chat templates compiled,
``tokens_file`` and ``engines_file`` read), so ``sieproxy config`` refuses whatever
``sieproxy serve`` would fail on later.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

from ..core.planning.template import check_template
from ..core.request.aliases import alias_conflict
from ..core.shaping.reasoning import make_reasoning_parser
from ..core.shaping.toolparse import make_tool_parser
from ..core.upstream.protocol import PROTOCOLS
from .keys import load_keys
from .schema import (
    ROUTING_MODES,
    ConfigError,
    EngineSpec,
    FallbackSpec,
    ModelSettings,
    Settings,
    fallback_target,
)
from .tokenizer_dir import read_tokenizer_dir

__all__ = ["check_settings", "parse_engines_file"]

_URL_RE = re.compile(r"^https?://[^/\s]+(/[^\s]*)?$")


def parse_engines_file(text: str) -> list[EngineSpec]:
    """The engines of an ``engines_file``: one ``URL [pool=P] [machine_profile=M]`` a line;
    blank lines and ``#`` comments are skipped. Raises ``ValueError`` naming the line."""
    specs: list[EngineSpec] = []
    for no, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if not _URL_RE.match(words[0]):
            raise ValueError(f"line {no}: not an http(s) base URL: {words[0]!r}")
        labels: dict[str, str] = {}
        for w in words[1:]:
            k, eq, v = w.partition("=")
            if not eq or k not in ("pool", "machine_profile") or not v:
                raise ValueError(f"line {no}: expected pool=NAME or machine_profile=NAME: {w!r}")
            labels[k] = v
        specs.append(
            EngineSpec(
                url=words[0], pool=labels.get("pool"), machine_profile=labels.get("machine_profile")
            )
        )
    return specs


def check_settings(s: Settings, where: str, *, keys: bool = True) -> None:
    """Check settings, loaded from a file or built in code (``sieproxy serve``'s model flags);
    ``where`` names their source in the error. ``keys``: read and check the keys file too
    (``sieproxy keys`` does not: it is there to write it)."""
    g = s.gateway

    def bad(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{where}: key `{key}`: {problem}")

    if g.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise bad("gateway.log_level", "one of debug, info, warning, error, critical")
    for key in ("retry_after", "breaker_failures", "max_image_bytes", "max_sse_line_bytes"):
        if getattr(g, key) < 1:
            raise bad(f"gateway.{key}", "must be >= 1")
    # 0 is meaningful for these two: answer 503 at once when full; keep no idle connection.
    if g.admission_wait < 0:
        raise bad("gateway.admission_wait", "must be >= 0 seconds (0: no wait)")
    if g.max_keepalive_connections < 0:
        raise bad("gateway.max_keepalive_connections", "must be >= 0 (0: no keep-alive)")
    if g.retry_after_max < 0:
        raise bad("gateway.retry_after_max", "must be >= 0 seconds (0: never wait for one)")
    if g.retry_backoff_max < g.retry_backoff:
        raise bad("gateway.retry_backoff_max", "must be >= `gateway.retry_backoff`")
    if g.breaker_backoff_max < g.breaker_backoff:
        raise bad("gateway.breaker_backoff_max", "must be >= `gateway.breaker_backoff`")
    if g.tokens_file:
        try:
            Path(g.tokens_file).read_bytes()
        except OSError as exc:
            problem = f"cannot read {g.tokens_file}: {exc.strerror}"
            raise bad("gateway.tokens_file", problem) from None
    if g.keys_file and keys:  # a hostile or broken keys file is refused at start, naming its line
        served = set(s.models)
        if s.embedded_engine.enabled:
            served.add(s.embedded_engine.served_name)
        load_keys(g.keys_file, served)
    if g.redis_url and not g.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise bad("gateway.redis_url", "must be a redis://, rediss:// or unix:// URL")
    if not 0 <= g.messages_ping_interval < math.inf:
        raise bad("gateway.messages_ping_interval", "must be a number of seconds >= 0 (0: off)")
    if g.batch_promote_after <= 0:
        raise bad("gateway.batch_promote_after", "must be > 0 seconds")
    if not 0 <= g.port <= 65535:
        raise bad("gateway.port", "must be in [0, 65535]")
    if g.default_max_tokens < 1:
        raise bad("gateway.default_max_tokens", "must be >= 1")
    for key in ("max_body_bytes", "channel_size", "replica_max_inflight", "max_connections"):
        if getattr(g, key) < 0 or (key != "channel_size" and getattr(g, key) == 0):
            raise bad(f"gateway.{key}", "must be positive")
    for key in (
        "connect_timeout",
        "pool_timeout",
        "token_gap_timeout",
        "request_deadline",
        "abort_timeout",
        "client_stall_timeout",
        "health_interval",
        "health_timeout",
        "load_interval",
        "shutdown_grace",
        "breaker_backoff",
        "retry_backoff",
    ):
        if getattr(g, key) <= 0:
            raise bad(f"gateway.{key}", "must be a positive number of seconds")
    for name, m in s.models.items():
        if not m.engines and not m.engines_file:
            raise bad(
                f"models.{name}.engines", "at least one engine URL (or `engines_file`) is required"
            )
        for i, e in enumerate(m.engines):
            url = e.url if isinstance(e, EngineSpec) else e
            if not _URL_RE.match(url):
                raise bad(f"models.{name}.engines[{i}]", f"not an http(s) base URL: {url!r}")
            if isinstance(e, EngineSpec) and e.discover not in (None, "dns"):
                raise bad(f"models.{name}.engines[{i}].discover", 'only "dns" is supported')
            if isinstance(e, EngineSpec) and e.interval <= 0:
                raise bad(f"models.{name}.engines[{i}].interval", "must be a positive number")
            if isinstance(e, EngineSpec) and e.protocol not in PROTOCOLS:
                known = ", ".join(f'"{p}"' for p in sorted(PROTOCOLS))
                raise bad(f"models.{name}.engines[{i}].protocol", f"must be one of {known}")
        if m.engines_file:
            try:
                parse_engines_file(Path(m.engines_file).read_text("utf-8"))
            except OSError as exc:
                problem = f"cannot read {m.engines_file}: {exc.strerror}"
                raise bad(f"models.{name}.engines_file", problem) from None
            except ValueError as exc:
                raise bad(f"models.{name}.engines_file", str(exc)) from None
        bad_inputs = set(m.inputs) - {"text", "image"}
        if bad_inputs:
            raise bad(f"models.{name}.inputs", f"unknown input kinds {sorted(bad_inputs)}")
        if m.tokenizer and m.chat_template:
            raise bad(f"models.{name}", "set either `tokenizer` or `chat_template`, not both")
        if m.tokenizer and not Path(m.tokenizer).is_dir():
            raise bad(f"models.{name}.tokenizer", f"not a directory: {m.tokenizer}")
        if m.default_max_tokens is not None and m.default_max_tokens < 1:
            raise bad(f"models.{name}.default_max_tokens", "must be >= 1")
        if m.routing not in ROUTING_MODES:
            modes = ", ".join(ROUTING_MODES)
            raise bad(f"models.{name}.routing", f"one of {modes}, not {m.routing!r}")
        if m.first_token_timeout is not None and m.first_token_timeout <= 0:
            raise bad(f"models.{name}.first_token_timeout", "must be a positive number of seconds")
        if m.max_resumes < 0:
            raise bad(f"models.{name}.max_resumes", "must be >= 0 (0: a broken stream ends)")
        _check_cache_aware(name, m, bad)
        if m.max_tool_calls < 1:
            raise bad(f"models.{name}.max_tool_calls", "must be >= 1")
        _check_parsers_and_template(name, m, bad)
        _check_render(name, m, bad)
    if s.embedded_engine.kind not in ("cpu", "fake"):
        raise bad("embedded_engine.kind", "one of cpu, fake")
    if not 0 <= s.embedded_engine.port <= 65535:
        raise bad("embedded_engine.port", "must be in [0, 65535] (0 picks a free port)")
    cache = s.embedded_engine.prefix_cache_tokens
    if cache is not None and cache < 0:
        raise bad("embedded_engine.prefix_cache_tokens", "must be >= 0 (0 disables the cache)")
    if cache is not None and s.embedded_engine.kind != "cpu":
        raise bad("embedded_engine.prefix_cache_tokens", "applies to kind = 'cpu' only")
    if s.embedded_engine.enabled and s.embedded_engine.served_name in s.models:
        raise bad(
            "embedded_engine.served_name",
            f"model {s.embedded_engine.served_name!r} is also configured under [models]",
        )
    _check_fallbacks(s, bad)
    _check_aliases(s, bad)
    if not s.models and not s.embedded_engine.enabled:
        raise bad(
            "models",
            "no model is served: add a `[models.<name>]` table with its `engines`, or set "
            "`[embedded_engine] enabled = true`",
        )


def _check_aliases(s: Settings, bad: Callable[[str, str], ConfigError]) -> None:
    """No alias means two models, or shadows a served name (sieproxy/core/request/aliases.py)."""
    named = {name: m.aliases for name, m in s.models.items()}
    emb = s.embedded_engine
    if emb.enabled:
        named[emb.served_name] = emb.aliases
    clash = alias_conflict(named)
    if clash is not None:
        owner = "embedded_engine" if emb.enabled and clash[0] == emb.served_name else None
        where = owner or f"models.{clash[0]}"
        raise bad(f"{where}.aliases[{clash[1]}]", clash[2])


def _check_cache_aware(name: str, m: ModelSettings, bad: Callable[[str, str], ConfigError]) -> None:
    """The ``cache_aware`` keys: in range, and events only where that routing reads them."""
    for key in ("kv_events_port", "kv_events_replay_port"):
        port = getattr(m, key)
        if port is not None and not 1 <= port <= 65535:
            raise bad(f"models.{name}.{key}", "must be in [1, 65535]")
        if port is not None and m.routing != "cache_aware":
            raise bad(f"models.{name}.{key}", 'applies to routing = "cache_aware" only')
    for key in ("kv_events_stale", "prefill_tokens_per_s", "spill_delay"):
        if getattr(m, key) <= 0:
            raise bad(f"models.{name}.{key}", "must be a positive number")
    if not 0 < m.spill_batch_share <= 1:
        raise bad(f"models.{name}.spill_batch_share", "must be in (0, 1]")
    if m.min_match_tokens < 0:
        raise bad(f"models.{name}.min_match_tokens", "must be >= 0")
    if m.cache_tokens < 1:
        raise bad(f"models.{name}.cache_tokens", "must be a positive number of tokens")
    for i, e in enumerate(m.engines):
        for key in ("kv_events", "kv_events_replay"):
            endpoint = getattr(e, key, None) if isinstance(e, EngineSpec) else None
            if endpoint is None:
                continue
            where = f"models.{name}.engines[{i}].{key}"
            if m.routing != "cache_aware":
                raise bad(where, 'applies to routing = "cache_aware" only')
            if not re.match(r"^(tcp|ipc)://\S+$", endpoint):
                raise bad(where, f"not a tcp:// or ipc:// endpoint: {endpoint!r}")


def _check_fallbacks(s: Settings, bad: Callable[[str, str], ConfigError]) -> None:
    """Every fallback names a served model or a pool, and no model falls back to itself
    through a chain of model fallbacks (the chain is followed, ``Settings.fallback_chain``)."""
    served = set(s.models)
    if s.embedded_engine.enabled:
        served.add(s.embedded_engine.served_name)
    edges: dict[str, list[str]] = {}
    for name, m in s.models.items():
        for i, entry in enumerate(m.context_fallbacks):
            key = f"models.{name}.context_fallbacks[{i}]"
            target = fallback_target(name, entry)[0]
            if isinstance(entry, FallbackSpec) and entry.model is None:
                raise bad(key, "name a `model` (a larger-context one)")
            if target not in served or target == name:
                raise bad(key, f"must name another model served by this gateway, not {target!r}")
        for i, entry in enumerate(m.fallbacks):
            key = f"models.{name}.fallbacks[{i}]"
            if isinstance(entry, FallbackSpec) and entry.model is None and entry.pool is None:
                raise bad(key, "name a `model`, a `pool`, or both")
            target, pool = fallback_target(name, entry)
            if target not in served:
                raise bad(key, f"unknown model {target!r}: not served by this gateway")
            if target == name and pool is None:
                raise bad(key, f"model {name!r} falls back to itself; name a `pool` or remove it")
            if target != name:
                edges.setdefault(name, []).append(target)

    def cycle(start: str) -> list[str] | None:
        path, todo = [start], [iter(edges.get(start, ()))]
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                path.pop()
                todo.pop()
            elif nxt == start:
                return [*path, nxt]
            elif nxt not in path:
                path.append(nxt)
                todo.append(iter(edges.get(nxt, ())))
        return None

    for name in s.models:
        found = cycle(name)
        if found is not None:
            raise bad(
                f"models.{name}.fallbacks",
                f"fallbacks form a cycle ({' -> '.join(found)}); remove one of its entries",
            )


def _check_parsers_and_template(
    name: str, m: ModelSettings, bad: Callable[[str, str], ConfigError]
) -> None:
    """What would otherwise fail on requests: parser names, and the template compiled."""
    key = f"models.{name}"
    try:
        make_tool_parser(m.tool_parser, tool_names=())
    except ValueError as exc:
        raise bad(f"{key}.tool_parser", str(exc)) from None
    try:
        make_reasoning_parser(m.reasoning_parser, enable_thinking=None)
    except ValueError as exc:
        raise bad(f"{key}.reasoning_parser", str(exc)) from None
    template, key = m.chat_template, f"{key}.chat_template"
    if m.tokenizer:
        key = f"models.{name}.tokenizer"
        try:
            template = read_tokenizer_dir(m.tokenizer).template
        except ValueError as exc:
            raise bad(key, str(exc)) from None
    if template is not None:
        try:
            check_template(template)
        except ValueError as exc:
            raise bad(key, str(exc)) from None


#: The values of a model's ``render`` (docs/CONFIGURATION.md, "Rendering").
RENDER_MODES = ("engine", "gateway")


def _check_render(name: str, m: ModelSettings, bad: Callable[[str, str], ConfigError]) -> None:
    """Engine rendering needs engines that render (OpenAI-compatible ones); gateway rendering
    for an OpenAI-compatible engine needs the model's template here (nothing to discover it
    from: such an engine reports no tokenizer path)."""
    key = f"models.{name}.render"
    if m.render is not None and m.render not in RENDER_MODES:
        raise bad(key, f'one of "engine", "gateway", not {m.render!r}')
    protocols = {e.protocol if isinstance(e, EngineSpec) else "sglang" for e in m.engines}
    if m.engines_file:
        protocols.add("sglang")  # (an engines file lists SGLang engines)
    mode = m.render_mode()
    if mode == "engine" and protocols != {"openai"}:
        raise bad(
            key,
            '"engine" needs every engine of the model on `protocol = "openai"` (SGLang\'s '
            '/generate takes a prompt the gateway rendered); set `render = "gateway"`',
        )
    if mode == "gateway" and "openai" in protocols and not (m.tokenizer or m.chat_template):
        raise bad(
            key,
            f'"gateway" rendering for an OpenAI-compatible engine needs the model\'s chat '
            f"template: set `models.{name}.tokenizer` (a tokenizer directory) or "
            f'`models.{name}.chat_template`, or `render = "engine"` (the engine renders)',
        )
