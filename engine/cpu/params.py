"""Parse and validate ``sampling_params`` exactly as SGLang's native ``/generate`` does.

Two kinds of failure, with two wire shapes (SGLANG-NATIVE-PROTOCOL.md §1, §2.2, §3.5):

* :class:`ContractError` — the JSON contract rejects the body (unknown key inside
  ``sampling_params``, wrong JSON type). HTTP 400 ``{"error": "<serde-style text>"}``.
* :class:`ParamError` (a ``ValueError``) — ``SamplingParams.verify()`` rejects a value (range,
  cross-field rule). HTTP 400 ``{"error": {"message": "..."}}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "KNOWN_SAMPLING_KEYS",
    "MODEL_DEFAULT_KEYS",
    "UNLIMITED",
    "ContractError",
    "ParamError",
    "SamplingParams",
    "parse_sampling_params",
]

DEFAULT_MAX_NEW_TOKENS = 128
UNLIMITED = -1  # max_new_tokens: null → up to the context length
MAX_STOP_COUNT = 32

# Order as in SGLang's contract error message (api_types.py SamplingParams fields).
KNOWN_SAMPLING_KEYS: tuple[str, ...] = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "beam_width",
    "watermark",
    "choice",
)
_KNOWN = frozenset(KNOWN_SAMPLING_KEYS)

#: The sampling keys a model's ``generation_config.json`` may default (SGLang's set: what it
#: applies when a request leaves them unset, with ``--sampling-defaults model``).
MODEL_DEFAULT_KEYS: tuple[str, ...] = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
)


class ContractError(ValueError):
    """The JSON contract rejected the body: 400 ``{"error": "<text>"}``."""


class ParamError(ValueError):
    """A sampling parameter failed validation: 400 ``{"error": {"message": "<text>"}}``."""


@dataclass
class SamplingParams:
    """Validated, normalized sampling parameters of one request."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # UNLIMITED for null
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    stop_regex: list[str] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (SGLang: ``temperature < 1e-6`` or top_k 1)."""
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, spec)`` of the one grammar constraint, or None."""
        for kind in ("json_schema", "regex", "ebnf", "structural_tag"):
            value = getattr(self, kind)
            if value:
                return kind, value
        return None

    @property
    def has_penalties(self) -> bool:
        """Whether frequency/presence/repetition penalties are active."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "a sequence"
    if isinstance(value, dict):
        return "a map"
    return type(value).__name__


def _expect(value: Any, kind: str, key: str) -> Any:
    """Check JSON type like serde would; return the value (ints accepted as numbers)."""
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "list": isinstance(value, list),
        "dict": isinstance(value, dict),
    }[kind]
    if not ok:
        expected = {
            "int": "i64",
            "number": "f64",
            "bool": "a boolean",
            "str": "a string",
            "list": "a sequence",
            "dict": "a map",
        }[kind]
        raise ContractError(
            f"sampling_params.{key}: invalid type: {_type_name(value)}, expected {expected}"
        )
    return value


def parse_sampling_params(
    raw: Any, vocab_size: int, defaults: Mapping[str, float] | None = None
) -> SamplingParams:
    """Validate one ``sampling_params`` object; raise ContractError or ParamError.

    ``defaults`` are the model's own values for :data:`MODEL_DEFAULT_KEYS`, used for each key
    the request leaves unset (absent or null); a value the request sets always wins."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ContractError(f"sampling_params: invalid type: {_type_name(raw)}, expected a map")
    for key in raw:
        if key not in _KNOWN:
            expected = ", ".join(f"`{k}`" for k in KNOWN_SAMPLING_KEYS)
            raise ContractError(f"unknown field `{key}`, expected one of {expected}")
    p = SamplingParams()
    for key, value in (defaults or {}).items():
        setattr(p, key, int(value) if key == "top_k" else float(value))
    # null means "default" for every field except max_new_tokens (null = unlimited).
    values = {k: v for k, v in raw.items() if v is not None or k == "max_new_tokens"}

    if "max_new_tokens" in values:
        v = values["max_new_tokens"]
        p.max_new_tokens = UNLIMITED if v is None else _expect(v, "int", "max_new_tokens")
    for key in ("min_new_tokens", "top_k", "n", "stream_interval", "beam_width"):
        if key in values:
            _expect(values[key], "int", key)
    for key in (
        "temperature",
        "top_p",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    ):
        if key in values:
            setattr(p, key, float(_expect(values[key], "number", key)))
    for key in (
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
    ):
        if key in values:
            setattr(p, key, _expect(values[key], "bool", key))
    for key in ("json_schema", "regex", "ebnf", "structural_tag"):
        if key in values:
            setattr(p, key, _expect(values[key], "str", key) or None)
    p.min_new_tokens = values.get("min_new_tokens", 0)
    p.top_k = values.get("top_k", p.top_k)
    p.n = values.get("n", 1)
    p.stream_interval = values.get("stream_interval")

    for key, target in (("stop", "stop"), ("stop_regex", "stop_regex")):
        if key in values:
            v = values[key]
            if isinstance(v, str):
                v = [v]
            for item in _expect(v, "list", key):
                _expect(item, "str", key)
            setattr(p, target, [s for s in v if s])
    if "stop_token_ids" in values:
        ids = _expect(values["stop_token_ids"], "list", "stop_token_ids")
        p.stop_token_ids = {_expect(i, "int", "stop_token_ids") for i in ids}
    if "logit_bias" in values:
        bias = _expect(values["logit_bias"], "dict", "logit_bias")
        for k, v in bias.items():
            _expect(v, "number", "logit_bias")
            try:
                tid = int(k)
            except ValueError as exc:
                raise ParamError(f"logit_bias key {k!r} is not a token id") from exc
            if not 0 <= tid < vocab_size:
                raise ParamError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {tid}.")
            p.logit_bias[tid] = float(v)
    if "sampling_seed" in values:
        seed = _expect(values["sampling_seed"], "int", "sampling_seed")
        if not -(2**63) <= seed < 2**63:
            raise ParamError("sampling_seed must be a 64-bit signed integer")
        p.sampling_seed = seed
    if values.get("choice"):
        raise ParamError("sampling_params.choice is not supported by this engine")
    if values.get("beam_width", 1) > 1:
        raise ParamError("beam search (beam_width > 1) is not supported by this engine")
    _verify(p)
    return p


def _verify(p: SamplingParams) -> None:
    """Range and cross-field rules of SGLang's ``SamplingParams.verify()``."""
    if not (math.isfinite(p.temperature) and p.temperature >= 0.0):
        raise ParamError(f"temperature must be non-negative, got {p.temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise ParamError(f"top_p must be in (0, 1], got {p.top_p}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise ParamError(f"min_p must be in [0, 1], got {p.min_p}.")
    if p.top_k < 1 and p.top_k != -1:
        raise ParamError(f"top_k must be -1 (disable) or at least 1, got {p.top_k}.")
    if not -2.0 <= p.frequency_penalty <= 2.0:
        raise ParamError(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}.")
    if not -2.0 <= p.presence_penalty <= 2.0:
        raise ParamError(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}.")
    if not 0.0 < p.repetition_penalty <= 2.0:
        raise ParamError(f"repetition_penalty must be in (0, 2], got {p.repetition_penalty}.")
    if p.max_new_tokens != UNLIMITED and p.max_new_tokens < 0:
        raise ParamError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    if p.min_new_tokens < 0:
        raise ParamError(f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}.")
    if p.max_new_tokens != UNLIMITED and p.min_new_tokens > p.max_new_tokens:
        raise ParamError(
            f"min_new_tokens must be in [0, max_new_tokens({p.max_new_tokens})], "
            f"got {p.min_new_tokens}."
        )
    if p.n < 1:
        raise ParamError(f"n must be at least 1, got {p.n}.")
    if len(p.stop) > MAX_STOP_COUNT or len(p.stop_regex) > MAX_STOP_COUNT:
        raise ParamError(f"At most {MAX_STOP_COUNT} stop strings are allowed.")
    if any(len(r.encode()) > 256 for r in p.stop_regex):
        raise ParamError("stop_regex patterns must be at most 256 bytes.")
    grammars = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(p, k)]
    if len(grammars) > 1:
        raise ParamError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    if p.temperature < 1e-6:
        # SGLang rewrites greedy to temperature=1, top_k=1.
        p.temperature, p.top_k = 1.0, 1
