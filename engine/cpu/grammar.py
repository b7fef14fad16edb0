"""Constrained decoding with xgrammar: compile once per distinct spec, one matcher per request.

``GrammarCache.compile(kind, spec)`` is thread-safe and memoized; the server calls it in a worker
thread before a request is admitted, so a bad grammar is a 400 before the response starts and
compilation never stalls the scheduler thread. Each request then gets a :class:`Constraint`
(a ``GrammarMatcher`` plus its bitmask buffer) that masks the logits row before sampling and
advances with every accepted token.

JSON schemas are compiled with ``any_whitespace=False`` (compact separators): small models
otherwise tend to emit unbounded whitespace runs inside JSON.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch
import xgrammar as xgr

__all__ = ["Constraint", "GrammarCache", "GrammarError"]


class GrammarError(ValueError):
    """The grammar spec is invalid (HTTP 400)."""


class GrammarCache:
    """Compiler for one tokenizer, with a memo of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._memo: dict[tuple[str, str], xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        """Compile (or fetch) the grammar; raise GrammarError on an invalid spec."""
        key = (kind, spec)
        with self._lock:
            hit = self._memo.get(key)
        if hit is not None:
            return hit
        try:
            if kind == "json_schema":
                json.loads(spec)
                compiled = self._compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(spec)
            elif kind == "ebnf":
                compiled = self._compiler.compile_grammar(spec)
            elif kind == "structural_tag":
                compiled = self._compile_structural_tag(spec)
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses
            raise GrammarError(f"invalid {kind}: {exc}") from exc
        with self._lock:
            self._memo[key] = compiled
        return compiled

    def _compile_structural_tag(self, spec: str) -> xgr.CompiledGrammar:
        data = json.loads(spec)
        if isinstance(data, dict) and "structures" in data:
            # SGLang's legacy shape: {"structures": [{begin, schema, end}], "triggers": [...]}.
            tags = [
                xgr.StructuralTagItem(
                    begin=s["begin"],
                    schema=json.dumps(s.get("schema", {})),
                    end=s["end"],
                )
                for s in data["structures"]
            ]
            return self._compiler.compile_structural_tag(tags, data.get("triggers", []))
        return self._compiler.compile_structural_tag(spec)

    def new_constraint(self, compiled: xgr.CompiledGrammar) -> Constraint:
        """A fresh per-request matcher for ``compiled``."""
        return Constraint(compiled, self.vocab_size)


class Constraint:
    """One request's grammar state."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def mask(self, row: torch.Tensor) -> None:
        """Set logits of tokens the grammar forbids to ``-inf`` (in place)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(row.view(1, -1), self.bitmask, vocab_size=self.vocab_size)

    def accept(self, token: int) -> bool:
        """Advance with ``token``; False if the grammar rejects it."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar has accepted a stop token."""
        return bool(self.matcher.is_terminated())
