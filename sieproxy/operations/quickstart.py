"""One model from the command line, no configuration file: ``sieproxy serve --model PATH`` and
``sieproxy serve --engine URL`` (``sieproxy.cli`` parses the flags; this module turns them
into :class:`~sieproxy.settings.load.Settings`).

- ``--model PATH`` (a local Hugging Face directory or a ``.gguf`` file, or ``default``) runs the
  embedded CPU engine on it. The served name defaults to the directory's or file's name (a
  GGUF's quantization suffix such as ``.Q4_1`` dropped; a Hugging Face cache snapshot
  ``models--org--name/snapshots/<hash>`` gives ``org/name``).
- ``--engine URL`` fronts a running engine. An SGLang-native server is known by its
  ``/model_info`` (or ``/server_info``), which gives the served name (``served_model_name``,
  else the model path) and the parsers it was started with, when the gateway knows them. Any
  other server that lists its models at ``GET /v1/models`` (vLLM, llama.cpp's server, TGI, a
  hosted endpoint; ``URL`` may end in ``/v1``) is fronted as an OpenAI-compatible engine
  (``protocol = "openai"``, the engine renders and parses): the served name is its one model's
  id, and parser flags are refused, since the engine's own parsers apply.

The tool and reasoning parsers default from the model family where that is reliable
(:data:`FAMILY_PARSERS`: ``config.json``'s ``model_type`` or else its first ``architectures``
entry, a GGUF's ``general.architecture``, or the same keys of the engine's ``/model_info``);
``none`` turns a default off. ``llama`` is deliberately not in the table: small models such as
SmolLM2 share the type without Llama 3's tool-call format.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..core.shaping.reasoning import REASONING_PARSERS
from ..core.shaping.toolparse import TOOL_PARSERS
from ..settings.load import (
    DEFAULT_MODEL_NAME,
    ConfigError,
    EngineSpec,
    ModelSettings,
    Settings,
    check_settings,
    load_settings,
)

__all__ = [
    "FAMILY_PARSERS",
    "EngineIdentity",
    "ModelFlags",
    "engine_identity",
    "family_of",
    "serve_settings",
    "served_name_for",
    "settings_from_flags",
]

#: model family (``model_type`` / GGUF ``general.architecture``) -> (tool parser, reasoning parser)
FAMILY_PARSERS: dict[str, tuple[str | None, str | None]] = {
    "qwen2": ("qwen25", None),
    "qwen2_moe": ("qwen25", None),
    "qwen3": ("qwen25", "qwen3"),
    "qwen3_moe": ("qwen25", "qwen3"),
}

_DEFAULT_ALIASES = frozenset({"", "default", "smollm2", DEFAULT_MODEL_NAME.lower()})
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
#: Seconds to wait for ``--engine``'s ``/model_info`` at start.
ENGINE_INFO_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class ModelFlags:
    """The model flags of ``sieproxy serve`` (all optional)."""

    model: str | None = None
    engine: str | None = None
    served_model_name: str | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None

    def any(self) -> bool:
        return any(
            v is not None
            for v in (
                self.model,
                self.engine,
                self.served_model_name,
                self.tool_parser,
                self.reasoning_parser,
            )
        )


def served_name_for(model: str) -> str:
    """The default served name of ``--model``'s value."""
    if model.strip().lower() in _DEFAULT_ALIASES:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser().resolve()
    if path.suffix.lower() == ".gguf":
        return _QUANT_SUFFIX.sub("", path.stem) or path.stem
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


def family_of(model: str) -> str | None:
    """The model family of a local model: ``config.json``'s ``model_type``, or a GGUF file's
    ``general.architecture``; ``None`` when it cannot be read."""
    path = Path(model).expanduser()
    if path.is_dir():
        try:
            config = json.loads((path / "config.json").read_text("utf-8"))
        except (OSError, ValueError):
            return None
        return _family(config) if isinstance(config, dict) else None
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_architecture(path)
    return None


def _family(info: dict[str, Any]) -> str | None:
    """``model_type``, else the first architecture's family (``Qwen3ForCausalLM`` -> ``qwen3``)."""
    kind = info.get("model_type")
    if isinstance(kind, str) and kind:
        return kind
    archs = info.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0].removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration").lower()
    return None


def _gguf_architecture(path: Path) -> str | None:
    try:
        import gguf  # the GGUF reader transformers converts with
    except ImportError:
        return None
    try:
        field = gguf.GGUFReader(str(path)).fields.get("general.architecture")
        if field is None or not field.data:
            return None
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (OSError, ValueError, UnicodeDecodeError):
        return None


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What ``--engine URL`` found at start: the engine's base URL (without a ``/v1``), its
    protocol, and its ``/model_info`` (SGLang) or its model ids (``/v1/models``)."""

    url: str
    protocol: str
    info: dict[str, Any]
    models: tuple[str, ...] = ()


def engine_base(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``: the gateway adds ``/v1/...`` itself."""
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def engine_identity(
    url: str, timeout: float = ENGINE_INFO_TIMEOUT, client: httpx.Client | None = None
) -> EngineIdentity:
    """Which engine answers at ``url``: SGLang's ``/model_info`` (``/get_model_info``, then
    ``/server_info``, for older servers), else an OpenAI-compatible ``/v1/models``;
    ``ConfigError`` naming the URL when neither answers."""
    base = engine_base(url)
    with client or httpx.Client(timeout=timeout) as http:
        problem = "no answer"
        try:
            for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
                resp = http.get(base + path)
                info = _json(resp)
                if isinstance(info, dict):
                    return EngineIdentity(base, "sglang", info)
                problem = f"HTTP {resp.status_code}"
            listed = _json(http.get(base + "/v1/models"))
        except httpx.HTTPError as exc:
            problem = type(exc).__name__  # the server is not there: no other path will answer
        else:
            models = _model_ids(listed)
            if models:
                return EngineIdentity(base, "openai", {}, models)
    raise ConfigError(
        f"--engine {url}: could not read the engine's /model_info or /v1/models ({problem}); "
        "start the engine first, or name the model with --served-model-name"
    )


def _json(resp: httpx.Response) -> Any:
    if resp.status_code != 200:
        return None
    try:
        return resp.json()
    except ValueError:
        return None


def _model_ids(listed: Any) -> tuple[str, ...]:
    """The ids of an OpenAI ``/v1/models`` list (``{"data": [{"id": ...}, ...]}``)."""
    data = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(data, list):
        return ()
    ids = (m.get("id") for m in data if isinstance(m, dict))
    return tuple(i for i in ids if isinstance(i, str) and i)


def _parser(flag: str | None, known: dict[str, Any], *candidates: object) -> str | None:
    """The flag's value (``none`` for no parser), else the first candidate the gateway knows."""
    if flag is not None:
        return None if flag == "none" else flag
    for c in candidates:
        if isinstance(c, str) and c.strip().lower() in known:
            return c.strip().lower()
    return None


def serve_settings(config: str | None, flags: ModelFlags) -> Settings:
    """The settings of ``sieproxy serve``: from the configuration file (``config``, else
    ``$SIEPROXY_CONFIG``), or from the model flags — never both (``ConfigError``): the file is
    for fleets, the flags for one model, and mixing them would leave unclear which wins."""
    if not flags.any():
        return load_settings(config)
    path = config or os.environ.get("SIEPROXY_CONFIG")
    if path:
        source = "--config" if config else "$SIEPROXY_CONFIG"
        raise ConfigError(
            f"--model, --engine, --served-model-name, --tool-parser and --reasoning-parser "
            f"serve one model without a configuration file, and {source} ({path}) is given "
            "too; put the model in the file's [models] table instead, or drop the file"
        )
    return settings_from_flags(flags)


def settings_from_flags(flags: ModelFlags) -> Settings:
    """The settings of ``sieproxy serve`` with model flags and no configuration file (the
    defaults and the environment's overrides, as with no flags; ``ConfigError`` if invalid)."""
    s = load_settings(None)
    _apply(s, flags)
    check_settings(s, "(command line)")
    return s


def _apply(s: Settings, flags: ModelFlags) -> None:
    if flags.engine is not None:
        s.embedded_engine.enabled = False
        _apply_engine(s, flags, flags.engine)
        return
    e = s.embedded_engine
    model = flags.model
    if model is not None:
        if model.strip().lower() not in _DEFAULT_ALIASES:
            path = Path(model).expanduser()
            if not (path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")):
                raise ConfigError(
                    f"--model {model}: not a model directory or a .gguf file (give a local "
                    "Hugging Face directory with config.json, a .gguf file, or 'default')"
                )
            model = str(path.resolve())
        e.model = model
        e.served_name = served_name_for(model)
    if flags.served_model_name is not None:
        e.served_name = flags.served_model_name
    tool, reasoning = FAMILY_PARSERS.get(family_of(e.model) or "", (None, None))
    e.tool_parser = _parser(flags.tool_parser, TOOL_PARSERS, tool)
    e.reasoning_parser = _parser(flags.reasoning_parser, REASONING_PARSERS, reasoning)


def _apply_engine(s: Settings, flags: ModelFlags, url: str) -> None:
    try:
        found = engine_identity(url)
    except ConfigError:
        if flags.served_model_name is None:
            raise
        # Not up yet, and named: its protocol cannot be asked, so a ``/v1`` URL says OpenAI.
        base = engine_base(url)
        found = EngineIdentity(base, "openai" if base != url.rstrip("/") else "sglang", {})
    if found.protocol == "openai":
        _apply_openai_engine(s, flags, url, found)
        return
    info = found.info
    name = flags.served_model_name or _engine_name(info, url)
    tool, reasoning = FAMILY_PARSERS.get(_family(info) or "", (None, None))
    s.models[name] = ModelSettings(
        engines=[found.url],
        tool_parser=_parser(flags.tool_parser, TOOL_PARSERS, info.get("tool_call_parser"), tool),
        reasoning_parser=_parser(
            flags.reasoning_parser, REASONING_PARSERS, info.get("reasoning_parser"), reasoning
        ),
    )


def _apply_openai_engine(s: Settings, flags: ModelFlags, url: str, found: EngineIdentity) -> None:
    """An OpenAI-compatible engine renders chat and parses tool calls itself (``render =
    "engine"``), and is asked for the model by the gateway's name: that name is its model's id."""
    for flag, value in (("--tool-parser", flags.tool_parser),
                        ("--reasoning-parser", flags.reasoning_parser)):  # fmt: skip
        if value is not None:
            raise ConfigError(
                f"{flag}: the engine at {url} is OpenAI-compatible and applies its own parsers "
                f"(vLLM: --tool-call-parser, --reasoning-parser); drop {flag}"
            )
    name = flags.served_model_name
    if name is None:
        if len(found.models) != 1:
            raise ConfigError(
                f"--engine {url}: the engine serves {len(found.models)} models "
                f"({', '.join(found.models)}); choose one with --served-model-name"
            )
        name = found.models[0]
    elif found.models and name not in found.models:
        raise ConfigError(
            f"--served-model-name {name}: the engine at {url} serves "
            f"{', '.join(found.models)}, and is asked for the model by this name; use one of them"
        )
    s.models[name] = ModelSettings(engines=[EngineSpec(url=found.url, protocol="openai")])


def _engine_name(info: dict[str, Any], url: str) -> str:
    for key in ("served_model_name", "model_path"):
        value = info.get(key)
        if isinstance(value, str) and value:
            # SGLang serves a local --model-path under the path itself: name it by the directory.
            return Path(value).name if value.startswith("/") else value
    raise ConfigError(
        f"--engine {url}: the engine's /model_info names no model; pass --served-model-name"
    )
