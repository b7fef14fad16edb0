"""Settings: one typed table, loaded from a TOML file, overridden by environment variables.

Every field has a documented default (see docs/CONFIGURATION.md, which mirrors this module).
A bad file fails at start with a message naming the file, the key and the problem: every value
is checked at load time (ranges, parser names, chat templates compiled, ``tokens_file`` read),
so ``sieproxy config`` refuses whatever ``sieproxy serve`` would fail on later.

Environment overrides (applied after the file):

==================================  ==========================================================
``SIE_GATEWAY_DEFAULT_MAX_TOKENS``  ``gateway.default_max_tokens`` (the contract's name)
``SIEPROXY_AUTH_TOKENS``            comma-separated bearer tokens; also turns auth on
``SIEPROXY_HOST`` / ``SIEPROXY_PORT``  listen address
``SIEPROXY_CONFIG``                 path of the TOML file when ``--config`` is not given
``SIEPROXY_FAST_PATHS``             ``gateway.fast_paths`` (``0``/``false``/``off`` or ``1``/...)
==================================  ==========================================================
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct, field

from .core.protocol import PROTOCOLS
from .core.reasoning import make_reasoning_parser
from .core.template import check_template
from .core.toolparse import make_tool_parser
from .tokenizer_dir import read_tokenizer_dir

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ROUTING_MODES",
    "ConfigError",
    "EmbeddedEngine",
    "EngineSpec",
    "FallbackSpec",
    "GatewaySettings",
    "ModelSettings",
    "Settings",
    "check_settings",
    "default_settings",
    "load_settings",
    "parse_engines_file",
]

KiB = 1024
MiB = 1024 * KiB

#: The name the embedded CPU engine's default model is served under.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(Exception):
    """The configuration is invalid; the message names the file, the key and the problem."""


class _Conf(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class GatewaySettings(_Conf):
    host: str = "127.0.0.1"
    port: int = 8000
    #: Output cap when a chat request sets neither max_completion_tokens nor max_tokens.
    default_max_tokens: int = 1024
    #: Request bodies above this many bytes get 413 (declared or streamed).
    max_body_bytes: int = 32 * MiB
    #: Bearer auth. ``tokens`` inline, ``tokens_file`` (one per line), ``SIEPROXY_AUTH_TOKENS``.
    auth: bool = False
    tokens: list[str] = field(default_factory=list)
    tokens_file: str | None = None
    #: Whether GET /healthz, /readyz and /metrics also need a token.
    auth_health: bool = False
    auth_metrics: bool = False
    # --- upstream (engine) side -----------------------------------------------------------
    #: Seconds to open a TCP connection to an engine.
    connect_timeout: float = 5.0
    #: Seconds to wait for a free pooled connection.
    pool_timeout: float = 10.0
    #: Longest silence allowed between two upstream chunks (includes time to first token).
    token_gap_timeout: float = 300.0
    #: Longest a whole request may take, streaming or not.
    request_deadline: float = 3600.0
    #: Upper bound on the shielded /abort_request call made while tearing a request down.
    abort_timeout: float = 2.0
    #: A client that reads nothing for this long gets its candidates aborted upstream.
    client_stall_timeout: float = 60.0
    #: Capacity of each per-request channel between candidates and the merger.
    channel_size: int = 8
    #: httpx pool: connections kept per engine (keep-alive) and in total.
    max_connections: int = 4096
    max_keepalive_connections: int = 512
    #: Longest SSE line accepted from an engine.
    max_sse_line_bytes: int = 4 * MiB
    #: Admission: candidates in flight per replica; wait this long for room, then 503.
    replica_max_inflight: int = 1024
    admission_wait: float = 5.0
    #: Value of Retry-After on 503 answers, seconds.
    retry_after: int = 2
    #: Background health checks of each replica.
    health_interval: float = 5.0
    health_timeout: float = 10.0
    #: Between two health checks, each replica's own load is read this often (routing).
    load_interval: float = 1.0
    #: Circuit breaker: a replica failing this many requests in a row is taken out for
    #: ``breaker_backoff`` seconds (doubling up to ``breaker_backoff_max``), or until a health
    #: check begun after the opening passes (see sieproxy/pool.py).
    breaker_failures: int = 3
    breaker_backoff: float = 2.0
    breaker_backoff_max: float = 60.0
    #: Graceful shutdown: in-flight streams get this long to finish, then are aborted.
    shutdown_grace: float = 30.0
    #: Largest decoded image accepted in a data: URI.
    max_image_bytes: int = 20 * MiB
    log_level: str = "info"
    access_log: bool = True
    #: The server front's fast paths (direct socket reads and writes, the gateway's own chunk
    #: framing and response heads, the relay pump); off: Hypercorn's own I/O, as on a platform
    #: without epoll (docs/DESIGN.md, "The server front").
    fast_paths: bool = True


class EngineSpec(_Conf):
    url: str
    pool: str | None = None
    machine_profile: str | None = None
    #: ``"dns"``: the URL's host is a name resolved every ``interval`` seconds, one replica per
    #: address it resolves to (sieproxy/discovery.py).
    discover: str | None = None
    interval: float = 10.0
    #: The engine's API: ``"sglang"`` (native ``/generate``) or ``"openai"`` (an
    #: OpenAI-compatible server; docs/CONFIGURATION.md "The OpenAI-compatible protocol").
    protocol: str = "sglang"


class FallbackSpec(_Conf):
    """One fallback target: another model (``model``), a pool (``pool``), or both."""

    model: str | None = None
    pool: str | None = None


class ModelSettings(_Conf):
    #: SGLang-native base URLs (strings or tables with url/pool/machine_profile).
    engines: list[str | EngineSpec] = field(default_factory=list)
    #: A file of more engines, one URL per line (``URL [pool=P] [machine_profile=M]``),
    #: re-read when it changes (sieproxy/discovery.py).
    engines_file: str | None = None
    #: Tried in order before the first byte when this model cannot serve a request (see
    #: docs/CONFIGURATION.md "Fallbacks"): a model name, or a table with ``model``/``pool``.
    fallbacks: list[str | FallbackSpec] = field(default_factory=list)
    #: Chat template source: a local tokenizer directory, or an inline Jinja template.
    tokenizer: str | None = None
    chat_template: str | None = None
    inputs: list[str] = field(default_factory=lambda: ["text"])
    encode_only: bool = False
    #: Served adapter name -> path (the path is the engine's business; the name is what
    #: clients send as ``lora_adapter`` and what reaches the engine as ``lora_path``).
    lora_paths: dict[str, str] = field(default_factory=dict)
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    schema_in_prompt: bool = True
    default_max_tokens: int | None = None
    #: The most calls one choice may make under ``tool_choice: "required"``.
    max_tool_calls: int = 4
    #: Extra stop strings every request of this model gets.
    stop: list[str] = field(default_factory=list)
    #: Replica choice: ``prefix`` (affinity on the client's key, else the prompt's leading
    #: block), ``key_only`` (the client's key only), ``least_loaded`` (no affinity).
    routing: str = "prefix"


class EmbeddedEngine(_Conf):
    """The CPU engine the gateway starts as a supervised child when ``enabled``."""

    enabled: bool = False
    #: "cpu" (the CPU engine) or "fake" (the scripted fake engine: no torch, canned text).
    kind: str = "cpu"
    model: str = "smollm2"
    served_name: str = DEFAULT_MODEL_NAME
    host: str = "127.0.0.1"
    #: 0: a free port picked at each start (two gateways never share an engine).
    port: int = 0
    #: ``--prefix-cache-tokens`` of the engine (None: the engine's default; 0: no cache).
    prefix_cache_tokens: int | None = None
    extra_args: list[str] = field(default_factory=list)
    tool_parser: str | None = None
    reasoning_parser: str | None = None

    def engine_args(self) -> list[str]:
        """Engine arguments from the keys above, then ``extra_args``."""
        args = []
        if self.prefix_cache_tokens is not None:
            args += ["--prefix-cache-tokens", str(self.prefix_cache_tokens)]
        return [*args, *self.extra_args]


class Settings(_Conf):
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    models: dict[str, ModelSettings] = field(default_factory=dict)
    embedded_engine: EmbeddedEngine = field(default_factory=EmbeddedEngine)

    def engine_specs(self, model: str) -> list[EngineSpec]:
        return [
            e if isinstance(e, EngineSpec) else EngineSpec(url=e)
            for e in self.models[model].engines
        ]

    def fallback_chain(self, model: str) -> list[tuple[str, str | None]]:
        """The ``(model, pool)`` targets tried after ``model``, in order: its own fallbacks,
        each model entry followed by that model's own chain (depth first), without repeats
        and without ``(model, None)`` itself. Call only on checked settings (no cycle)."""
        out: list[tuple[str, str | None]] = []

        def walk(name: str) -> None:
            m = self.models.get(name)
            for entry in m.fallbacks if m is not None else ():
                target = _fallback_target(name, entry)
                if target != (model, None) and target not in out:
                    out.append(target)
                if target[0] != name:
                    walk(target[0])

        walk(model)
        return out

    def auth_tokens(self) -> list[bytes]:
        """All configured bearer tokens, as bytes (inline, file, environment)."""
        toks = list(self.gateway.tokens)
        if self.gateway.tokens_file:
            p = Path(self.gateway.tokens_file)
            try:
                toks += [t.strip() for t in p.read_text("utf-8").splitlines() if t.strip()]
            except OSError as exc:
                raise ConfigError(f"gateway.tokens_file: cannot read {p}: {exc.strerror}") from exc
        env = os.environ.get("SIEPROXY_AUTH_TOKENS", "")
        toks += [t.strip() for t in env.split(",") if t.strip()]
        return [t.encode("utf-8") for t in toks]


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


def _fallback_target(owner: str, entry: str | FallbackSpec) -> tuple[str, str | None]:
    if isinstance(entry, str):
        return entry, None
    return entry.model or owner, entry.pool


#: The values of a model's ``routing`` (their meaning: sieproxy/pool.py).
ROUTING_MODES = ("prefix", "least_loaded", "key_only")

_PATH_RE = re.compile(r" - at `\$\.?(.*)`$")


def _explain(exc: msgspec.ValidationError) -> tuple[str, str]:
    msg = str(exc)
    m = _PATH_RE.search(msg)
    key = m.group(1) if m else "(top level)"
    problem = msg[: m.start()] if m else msg
    problem = problem.replace("Object contains unknown field", "unknown key")
    return key, problem


def default_settings() -> Settings:
    """No config file: serve the default model through the embedded CPU engine."""
    s = Settings()
    s.embedded_engine.enabled = True
    return s


def load_settings(path: str | os.PathLike[str] | None = None) -> Settings:
    """Load the TOML file at ``path`` (or ``$SIEPROXY_CONFIG``), apply env overrides, check."""
    if path is None:
        path = os.environ.get("SIEPROXY_CONFIG") or None
    if path is None:
        settings = default_settings()
        where = "(defaults)"
    else:
        where = str(path)
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read the file: {exc.strerror}") from exc
        try:
            settings = msgspec.toml.decode(raw, type=Settings)
        except msgspec.ValidationError as exc:
            key, problem = _explain(exc)
            raise ConfigError(f"{where}: key `{key}`: {problem}") from None
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    _apply_env(settings, where)
    _check(settings, where)
    return settings


def _apply_env(s: Settings, where: str) -> None:
    env = os.environ
    for name, attr in (
        ("SIE_GATEWAY_DEFAULT_MAX_TOKENS", "default_max_tokens"),
        ("SIEPROXY_PORT", "port"),
    ):
        if name in env:
            try:
                setattr(s.gateway, attr, int(env[name]))
            except ValueError:
                raise ConfigError(f"environment {name}: expected an integer") from None
    if env.get("SIEPROXY_HOST"):
        s.gateway.host = env["SIEPROXY_HOST"]
    if env.get("SIEPROXY_AUTH_TOKENS", "").strip():
        s.gateway.auth = True
    fast = env_fast_paths()
    if fast is not None:
        s.gateway.fast_paths = fast


_FLAGS = {"1": True, "true": True, "on": True, "yes": True}
_FLAGS |= {"0": False, "false": False, "off": False, "no": False}


def env_fast_paths() -> bool | None:
    """``SIEPROXY_FAST_PATHS`` as a boolean, ``None`` when unset or empty."""
    raw = os.environ.get("SIEPROXY_FAST_PATHS", "").strip().lower()
    if not raw:
        return None
    if raw not in _FLAGS:
        raise ConfigError(
            f"environment SIEPROXY_FAST_PATHS: expected 0 or 1 (or true/false, on/off), got {raw!r}"
        )
    return _FLAGS[raw]


def _check(s: Settings, where: str) -> None:
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
    if g.breaker_backoff_max < g.breaker_backoff:
        raise bad("gateway.breaker_backoff_max", "must be >= `gateway.breaker_backoff`")
    if g.tokens_file:
        try:
            Path(g.tokens_file).read_bytes()
        except OSError as exc:
            problem = f"cannot read {g.tokens_file}: {exc.strerror}"
            raise bad("gateway.tokens_file", problem) from None
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
        if m.max_tool_calls < 1:
            raise bad(f"models.{name}.max_tool_calls", "must be >= 1")
        _check_parsers_and_template(name, m, bad)
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


def _check_fallbacks(s: Settings, bad: Callable[[str, str], ConfigError]) -> None:
    """Every fallback names a served model or a pool, and no model falls back to itself
    through a chain of model fallbacks (the chain is followed, ``Settings.fallback_chain``)."""
    served = set(s.models)
    if s.embedded_engine.enabled:
        served.add(s.embedded_engine.served_name)
    edges: dict[str, list[str]] = {}
    for name, m in s.models.items():
        for i, entry in enumerate(m.fallbacks):
            key = f"models.{name}.fallbacks[{i}]"
            if isinstance(entry, FallbackSpec) and entry.model is None and entry.pool is None:
                raise bad(key, "name a `model`, a `pool`, or both")
            target, pool = _fallback_target(name, entry)
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


def check_settings(s: Settings, where: str) -> None:
    """Check settings built in code (``sieproxy serve``'s model flags) as a file is checked;
    ``where`` names their source in the error."""
    _check(s, where)


def as_dict(s: Settings) -> dict[str, Any]:
    """The effective settings (tokens redacted), for `sieproxy config`."""
    d: dict[str, Any] = msgspec.to_builtins(s)
    if d["gateway"].get("tokens"):
        d["gateway"]["tokens"] = ["<redacted>"] * len(d["gateway"]["tokens"])
    return d
