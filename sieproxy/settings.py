"""Settings: one typed table, loaded from a TOML file, overridden by environment variables.

Every field has a documented default (see docs/CONFIGURATION.md, which mirrors this module).
A bad file fails at start with a message naming the file, the key and the problem.

Environment overrides (applied after the file):

==================================  ==========================================================
``SIE_GATEWAY_DEFAULT_MAX_TOKENS``  ``gateway.default_max_tokens`` (the contract's name)
``SIEPROXY_AUTH_TOKENS``            comma-separated bearer tokens; also turns auth on
``SIEPROXY_HOST`` / ``SIEPROXY_PORT``  listen address
``SIEPROXY_CONFIG``                 path of the TOML file when ``--config`` is not given
==================================  ==========================================================
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct, field

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ConfigError",
    "EmbeddedEngine",
    "EngineSpec",
    "GatewaySettings",
    "ModelSettings",
    "Settings",
    "load_settings",
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
    #: Circuit breaker: a replica failing this many times in a row is taken out for
    #: ``breaker_backoff`` seconds (doubling up to ``breaker_backoff_max``).
    breaker_failures: int = 3
    breaker_backoff: float = 2.0
    breaker_backoff_max: float = 60.0
    #: Graceful shutdown: in-flight streams get this long to finish, then are aborted.
    shutdown_grace: float = 30.0
    #: Largest decoded image accepted in a data: URI.
    max_image_bytes: int = 20 * MiB
    log_level: str = "info"
    access_log: bool = True


class EngineSpec(_Conf):
    url: str
    pool: str | None = None
    machine_profile: str | None = None


class ModelSettings(_Conf):
    #: SGLang-native base URLs (strings or tables with url/pool/machine_profile).
    engines: list[str | EngineSpec] = field(default_factory=list)
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


class EmbeddedEngine(_Conf):
    """The CPU engine the gateway starts as a supervised child when ``enabled``."""

    enabled: bool = False
    model: str = "smollm2"
    served_name: str = DEFAULT_MODEL_NAME
    host: str = "127.0.0.1"
    port: int = 30100
    extra_args: list[str] = field(default_factory=list)


class Settings(_Conf):
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    models: dict[str, ModelSettings] = field(default_factory=dict)
    embedded_engine: EmbeddedEngine = field(default_factory=EmbeddedEngine)

    def engine_specs(self, model: str) -> list[EngineSpec]:
        return [
            e if isinstance(e, EngineSpec) else EngineSpec(url=e)
            for e in self.models[model].engines
        ]

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


def _check(s: Settings, where: str) -> None:
    g = s.gateway

    def bad(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{where}: key `{key}`: {problem}")

    if g.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise bad("gateway.log_level", "one of debug, info, warning, error, critical")
    for key in ("retry_after", "breaker_failures", "max_image_bytes"):
        if getattr(g, key) < 1:
            raise bad(f"gateway.{key}", "must be >= 1")
    for key in ("admission_wait", "breaker_backoff", "breaker_backoff_max"):
        if getattr(g, key) < 0:
            raise bad(f"gateway.{key}", "must be >= 0 seconds")
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
        "shutdown_grace",
    ):
        if getattr(g, key) <= 0:
            raise bad(f"gateway.{key}", "must be a positive number of seconds")
    for name, m in s.models.items():
        if not m.engines:
            raise bad(f"models.{name}.engines", "at least one engine URL is required")
        for i, e in enumerate(m.engines):
            url = e.url if isinstance(e, EngineSpec) else e
            if not re.match(r"^https?://[^/\s]+(/[^\s]*)?$", url):
                raise bad(f"models.{name}.engines[{i}]", f"not an http(s) base URL: {url!r}")
        bad_inputs = set(m.inputs) - {"text", "image"}
        if bad_inputs:
            raise bad(f"models.{name}.inputs", f"unknown input kinds {sorted(bad_inputs)}")
        if m.tokenizer and m.chat_template:
            raise bad(f"models.{name}", "set either `tokenizer` or `chat_template`, not both")
        if m.tokenizer and not Path(m.tokenizer).is_dir():
            raise bad(f"models.{name}.tokenizer", f"not a directory: {m.tokenizer}")
        if m.default_max_tokens is not None and m.default_max_tokens < 1:
            raise bad(f"models.{name}.default_max_tokens", "must be >= 1")
        if m.max_tool_calls < 1:
            raise bad(f"models.{name}.max_tool_calls", "must be >= 1")
    if s.embedded_engine.enabled and s.embedded_engine.served_name in s.models:
        raise bad(
            "embedded_engine.served_name",
            f"model {s.embedded_engine.served_name!r} is also configured under [models]",
        )


def as_dict(s: Settings) -> dict[str, Any]:
    """The effective settings (tokens redacted), for `sieproxy config`."""
    d: dict[str, Any] = msgspec.to_builtins(s)
    if d["gateway"].get("tokens"):
        d["gateway"]["tokens"] = ["<redacted>"] * len(d["gateway"]["tokens"])
    return d
