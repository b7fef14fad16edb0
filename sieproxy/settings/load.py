"""Settings: one typed table, loaded from a TOML file, overridden by environment variables.

The table is ``sieproxy.settings.schema`` (every field with its default); a bad file fails at
start with a message naming the file, the key and the problem (``sieproxy.settings.checks``).
This module loads, applies the environment, checks, and exports all of it.

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
from pathlib import Path
from typing import Any

import msgspec

from .checks import check_settings, parse_engines_file
from .schema import (
    DEFAULT_MODEL_NAME,
    ROUTING_MODES,
    ConfigError,
    EmbeddedEngine,
    EngineSpec,
    FallbackSpec,
    GatewaySettings,
    ModelSettings,
    Settings,
)

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
    "as_dict",
    "check_settings",
    "default_settings",
    "env_fast_paths",
    "load_settings",
    "parse_engines_file",
]

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


def load_settings(path: str | os.PathLike[str] | None = None, *, keys: bool = True) -> Settings:
    """Load the TOML file at ``path`` (or ``$SIEPROXY_CONFIG``), apply env overrides, check
    (``keys``: the keys file too)."""
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
    check_settings(settings, where, keys=keys)
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


def as_dict(s: Settings) -> dict[str, Any]:
    """The effective settings (tokens redacted), for `sieproxy config`."""
    d: dict[str, Any] = msgspec.to_builtins(s)
    if d["gateway"].get("tokens"):
        d["gateway"]["tokens"] = ["<redacted>"] * len(d["gateway"]["tokens"])
    return d
