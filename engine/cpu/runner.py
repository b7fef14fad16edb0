"""The CPU engine as one object: model, tokenizer, grammar compiler, adapters and scheduler.

:class:`CpuEngine` is built cheaply (nothing loaded) so the HTTP server can bind its port and
answer ``/health`` with 503 while :meth:`CpuEngine.load` (blocking; run it in a worker thread)
resolves, converts and loads the model.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.cpu.grammar import GrammarCache
from engine.cpu.lora import LoraAdapter, load_adapter
from engine.cpu.model import TransformerModel, load_model
from engine.cpu.model_store import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME, resolve_model
from engine.cpu.params import MODEL_DEFAULT_KEYS
from engine.cpu.scheduler import Scheduler
from engine.kv_events import KVEventPublisher, parse_kv_events_config

__all__ = [
    "DEFAULT_PREFIX_CACHE_TOKENS",
    "KNOWN_SAMPLING_DEFAULTS",
    "CpuEngine",
    "EngineConfig",
    "sampling_defaults",
]

#: Tokens of KV the prefix cache may hold (46 KB a token for SmolLM2-135M: about 380 MB).
DEFAULT_PREFIX_CACHE_TOKENS = 8192

log = logging.getLogger("engine.cpu")


@dataclass
class EngineConfig:
    """Engine settings (the CLI flags of ``sieproxy-engine serve``)."""

    model: str | None = None
    served_model_name: str | None = None
    loras: dict[str, Path] = field(default_factory=dict)
    max_running: int = 16
    max_queue: int = 128
    prefill_chunk: int = 256
    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS  # 0: no prefix cache
    threads: int = 0  # 0: one per core
    #: SGLang's ``--kv-events-config`` JSON (engine/kv_events.py); None: no KV events.
    kv_events_config: str | None = None


class CpuEngine:
    """Loads and owns everything the server needs to generate."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path: Path | None = None
        self.model: TransformerModel | None = None
        self.tokenizer: Any = None
        self.scheduler: Scheduler | None = None
        self.grammars: GrammarCache | None = None
        self.adapters: dict[str, LoraAdapter] = {}
        self.eos_token_ids: set[int] = set()
        #: The model's sampling defaults for unset request values (``sampling_defaults``).
        self.sampling_defaults: dict[str, float] = {}
        self.load_seconds = 0.0
        self.ready = False
        self.kv_events: KVEventPublisher | None = None
        self.error: str | None = None

    @property
    def served_model_name(self) -> str:
        """The name clients use (``--served-model-name``, else derived from ``--model``)."""
        if self.config.served_model_name:
            return self.config.served_model_name
        spec = (self.config.model or "").strip()
        if spec.lower() in DEFAULT_MODEL_ALIASES:
            return DEFAULT_MODEL_NAME
        return spec

    @property
    def context_length(self) -> int:
        """The model's context length (0 before load)."""
        return self.model.config.context_length if self.model is not None else 0

    def load(self) -> None:
        """Resolve/convert the model, load weights, tokenizer, adapters; start the scheduler."""
        from transformers import AutoTokenizer

        started = time.monotonic()
        threads = self.config.threads or os.cpu_count() or 1
        torch.set_num_threads(threads)
        path = resolve_model(self.config.model)
        self.model_path = path
        log.info("loading %s (%d torch threads)", path, threads)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = load_model(path)
        self.model = model
        self.eos_token_ids = _eos_ids(path, self.tokenizer)
        self.sampling_defaults = sampling_defaults(path)
        log.info("sampling defaults of the model: %s", self.sampling_defaults or "none")
        for name, adapter_path in self.config.loras.items():
            self.adapters[name] = load_adapter(name, adapter_path, model.config.num_layers)
        self.grammars = GrammarCache(
            self.tokenizer, model.config.vocab_size, sorted(self.eos_token_ids)
        )
        self.scheduler = Scheduler(
            model,
            self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            max_running=self.config.max_running,
            max_queue=self.config.max_queue,
            prefill_chunk=self.config.prefill_chunk,
            prefix_cache_tokens=self.config.prefix_cache_tokens,
        )
        conf = parse_kv_events_config(self.config.kv_events_config)
        if conf is not None and self.scheduler.cache.enabled:
            self.kv_events = KVEventPublisher(conf)
            self.scheduler.cache.on_events = self.kv_events.publish
        self.scheduler.start()
        self.load_seconds = time.monotonic() - started
        self.ready = True
        log.info("model ready in %.1fs", self.load_seconds)

    def shutdown(self) -> None:
        """Stop the scheduler thread (aborting everything in flight)."""
        self.ready = False
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.kv_events is not None:
            self.kv_events.close()

    def encode(self, text: str) -> list[int]:
        """Tokenize like SGLang: the tokenizer's defaults (special tokens added if it adds)."""
        return list(self.tokenizer.encode(text))

    def architecture(self) -> str:
        """The model's architecture name."""
        return self.model.config.architecture if self.model is not None else ""

    def model_type(self) -> str:
        """The model's ``model_type``."""
        return self.model.config.model_type if self.model is not None else ""


#: Sampling defaults of models whose ``generation_config.json`` sets none, from their model cards.
#: SmolLM2-135M-Instruct's card samples at temperature 0.2, top-p 0.9; at the engine's plain
#: defaults (1.0 / 1.0) the 135M model answers the README's questions with word salad.
KNOWN_SAMPLING_DEFAULTS: dict[str, dict[str, float]] = {
    DEFAULT_MODEL_NAME: {"temperature": 0.2, "top_p": 0.9},
}


def sampling_defaults(path: Path) -> dict[str, float]:
    """The model's sampling defaults, as SGLang takes them: the ``temperature``, ``top_p``,
    ``top_k``, ``min_p`` and ``repetition_penalty`` its ``generation_config.json`` sets; when it
    sets none, :data:`KNOWN_SAMPLING_DEFAULTS` by the model directory's name."""
    gen = path / "generation_config.json"
    config: Any = {}
    if gen.is_file():
        try:
            config = json.loads(gen.read_text())
        except ValueError:
            log.warning("%s is not valid JSON; no sampling defaults read from it", gen)
    found = {
        k: float(v)
        for k in MODEL_DEFAULT_KEYS
        if isinstance(config, dict)
        and isinstance(v := config.get(k), int | float)
        and not isinstance(v, bool)
    }
    if found:
        return found
    return dict(KNOWN_SAMPLING_DEFAULTS.get(path.name, {}))


def _eos_ids(path: Path, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    gen = path / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
