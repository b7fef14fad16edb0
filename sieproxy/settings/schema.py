"""The settings schema: one typed table of strict Structs, every field with its default.

Every field has a documented default (see docs/CONFIGURATION.md, which mirrors this module).
Unknown keys are errors (``forbid_unknown_fields``). Loading and environment overrides are
``sieproxy.settings``; the checks of every value, ``sieproxy.settings.checks``.
"""

from __future__ import annotations

import os
from pathlib import Path

from msgspec import Struct, field

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
    "fallback_target",
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
    #: Tenants: API keys (hashed) with models, priority and limits (sieproxy/settings/keys.py).
    keys_file: str | None = None
    #: Redis holding the tenants' counters and usage, shared by every gateway process (unset:
    #: per process).
    redis_url: str | None = None
    #: Seconds a ``batch`` request waits for admission before it ranks as ``interactive``.
    batch_promote_after: float = 30.0
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
    #: A streamed ``/v1/messages`` answer sends Anthropic's ``ping`` event whenever nothing
    #: went out for this many seconds (0: only the one after ``message_start``).
    messages_ping_interval: float = 10.0
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
    #: An engine's 429/503 whose Retry-After is at most this many seconds is retried on the
    #: same replica after that pause (the retry table: sieproxy/core/upstream/retry.py).
    retry_after_max: float = 5.0
    #: Jittered backoff before a retry on the same replica: ``retry_backoff * 2**k`` seconds
    #: (half to all of it), at most ``retry_backoff_max``.
    retry_backoff: float = 0.1
    retry_backoff_max: float = 2.0
    #: Background health checks of each replica.
    health_interval: float = 5.0
    health_timeout: float = 10.0
    #: Between two health checks, each replica's own load is read this often (routing).
    load_interval: float = 1.0
    #: Circuit breaker: a replica failing this many requests in a row is taken out for
    #: ``breaker_backoff`` seconds (doubling up to ``breaker_backoff_max``), or until a health
    #: check begun after the opening passes (see sieproxy/fleet/pool.py).
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
    #: address it resolves to (sieproxy/fleet/discovery.py).
    discover: str | None = None
    interval: float = 10.0
    #: The engine's API: ``"sglang"`` (native ``/generate``) or ``"openai"`` (an
    #: OpenAI-compatible server; docs/CONFIGURATION.md "The OpenAI-compatible protocol").
    protocol: str = "sglang"
    #: ``routing = "cache_aware"``: this engine's KV-event ZMQ endpoint (``tcp://host:port``)
    #: and replay endpoint, overriding the model's ``kv_events_port`` rule.
    kv_events: str | None = None
    kv_events_replay: str | None = None


class FallbackSpec(_Conf):
    """One fallback target: another model (``model``), a pool (``pool``), or both."""

    model: str | None = None
    pool: str | None = None


class ModelSettings(_Conf):
    #: SGLang-native base URLs (strings or tables with url/pool/machine_profile).
    engines: list[str | EngineSpec] = field(default_factory=list)
    #: A file of more engines, one URL per line (``URL [pool=P] [machine_profile=M]``),
    #: re-read when it changes (sieproxy/fleet/discovery.py).
    engines_file: str | None = None
    #: Tried in order before the first byte when this model cannot serve a request (see
    #: docs/CONFIGURATION.md "Fallbacks"): a model name, or a table with ``model``/``pool``.
    fallbacks: list[str | FallbackSpec] = field(default_factory=list)
    #: Tried in order before the first byte when a prompt is too long for this model (the
    #: gateway's check of max_tokens, or the engine's context_length_exceeded).
    context_fallbacks: list[str | FallbackSpec] = field(default_factory=list)
    #: Seconds an attempt may take to its first chunk before it is aborted and the request
    #: moves to another replica or a fallback (None: ``token_gap_timeout`` applies, and a
    #: timeout is not retried).
    first_token_timeout: float | None = None
    #: Times one candidate's stream may be resumed elsewhere after it broke mid-output
    #: (sieproxy/relay/resume.py); 0: never (the stream's error event, as before).
    max_resumes: int = 1
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
    #: Other names clients may ask for: exact names, or glob patterns such as ``claude-*``
    #: (sieproxy/core/request/aliases.py).
    aliases: list[str] = field(default_factory=list)
    #: Replica choice: ``prefix`` (affinity on the client's key, else the prompt's leading
    #: block), ``key_only`` (the client's key only), ``least_loaded`` (no affinity).
    routing: str = "prefix"
    #: Who renders a chat request: ``"engine"`` (an OpenAI-compatible engine's own
    #: ``/v1/chat/completions``, its template and parsers; the default when every engine is
    #: ``protocol = "openai"``) or ``"gateway"`` (this model's template here; the default
    #: otherwise, and it then needs ``tokenizer`` or ``chat_template`` for OpenAI engines).
    render: str | None = None

    def render_mode(self) -> str:
        """``render``, or its default (see there)."""
        if self.render is not None:
            return self.render
        openai = self.engines and all(
            isinstance(e, EngineSpec) and e.protocol == "openai" for e in self.engines
        )
        return "engine" if openai and not self.engines_file else "gateway"

    # --- routing = "cache_aware" (sieproxy/fleet/cache_route.py, docs/CONFIGURATION.md) ----------
    #: Each replica's KV events at ``tcp://<its URL's host>:<port>`` (None: no events, unless
    #: an engine entry names its ``kv_events``); the replay socket likewise; the ZMQ topic.
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_events_topic: str = ""
    #: A stream silent this long after a request was sent is out of sync (seconds).
    kv_events_stale: float = 10.0
    #: Prefill tokens per second of one replica, and the delay a request may wait for a warm
    #: cache: a replica whose uncached prefill in flight reaches their product spills.
    prefill_tokens_per_s: float = 10_000.0
    spill_delay: float = 0.5
    #: ... and so does one whose load reached this share of its engine's running batch.
    spill_batch_share: float = 0.9
    #: A cached match shorter than this (or than two blocks) is no affinity.
    min_match_tokens: int = 64
    #: A replica's prefix-cache size in tokens when its engine does not report one.
    cache_tokens: int = 100_000


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
    #: Other names the served model answers to (as ``models.<name>.aliases``).
    aliases: list[str] = field(default_factory=list)

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
                target = fallback_target(name, entry)
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


def fallback_target(owner: str, entry: str | FallbackSpec) -> tuple[str, str | None]:
    """The ``(model, pool)`` one fallback entry of model ``owner`` names (a table without
    ``model``: ``owner`` itself, in another pool)."""
    if isinstance(entry, str):
        return entry, None
    return entry.model or owner, entry.pool


#: The values of a model's ``routing`` (their meaning: sieproxy/fleet/pool.py).
ROUTING_MODES = ("prefix", "least_loaded", "key_only", "cache_aware")
