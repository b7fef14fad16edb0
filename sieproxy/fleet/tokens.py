"""The model's tokenizer at the gateway (``routing = "cache_aware"``), loaded once per model.

The rendered prompt is tokenized the way SGLang and the CPU engine tokenize a ``text`` prompt:
the tokenizer's defaults (its post-processor adds the special tokens it adds, e.g. a BOS), so
the gateway's token blocks are the engine's. Only ``tokenizer.json`` (the ``tokenizers``
library's format, shipped with every Hugging Face fast tokenizer) is read; a directory without
one leaves the model on prefix-key routing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["PromptTokenizer", "load_tokenizer"]

log = logging.getLogger("sieproxy.tokens")


class PromptTokenizer:
    """Text → token ids with one loaded ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        self._tok = tokenizer
        self.source = source

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=True).ids
        return ids


def load_tokenizer(directory: str) -> PromptTokenizer | None:
    """The tokenizer of a local model directory, or None (logged) when it has none usable."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        log.warning("no tokenizer.json in %s: cache-aware routing stays on prefix keys", directory)
        return None
    try:
        from tokenizers import Tokenizer  # imported only where a model routes on tokens

        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # a corrupt or unsupported file: no routing on tokens
        log.error("cannot load %s (%s): cache-aware routing stays on prefix keys", path, exc)
        return None
    log.info("tokenizer loaded from %s", path)
    return PromptTokenizer(tok, str(path))
