"""Model aliases: the other names a served model answers to (``models.<name>.aliases``).

A client may name a model the gateway serves under another name: Claude Code asks for
``claude-sonnet-5``, ``claude-haiku-4-5-20251001``, ... An alias is an exact name, or a glob
pattern (``*``, ``?``, ``[...]``, as :func:`fnmatch.fnmatchcase`: case-sensitive) such as
``claude-*``. A request's model name resolves in this order: a served name, then an exact
alias, then the patterns in the order the models are configured (the first match wins).
Settings refuse, at start, an alias equal to a served name, a pattern that matches a served
name, and an alias that another model also declares (:func:`alias_conflict`), so a served
name always means its own model and an exact alias one model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase

from .profile import ModelProfile

__all__ = ["alias_conflict", "is_pattern", "resolve_alias"]


def is_pattern(alias: str) -> bool:
    """``alias`` is a glob pattern, not an exact name."""
    return any(c in alias for c in "*?[")


def resolve_alias(profiles: Mapping[str, ModelProfile], name: str) -> ModelProfile | None:
    """The served model an alias ``name`` means (None: no alias matches)."""
    for profile in profiles.values():
        if name in profile.aliases:
            return profile
    for profile in profiles.values():
        for alias in profile.aliases:
            if is_pattern(alias) and fnmatchcase(name, alias):
                return profile
    return None


def alias_conflict(models: Mapping[str, Iterable[str]]) -> tuple[str, int, str] | None:
    """The first alias that collides, as ``(model, index, problem)``, or None: an empty alias,
    one equal to (or, as a pattern, matching) a served name, or one another model declares."""
    owner: dict[str, str] = {}
    for model, aliases in models.items():
        for i, alias in enumerate(aliases):
            if not alias:
                return model, i, "an alias must be a non-empty name or pattern"
            if alias in models:
                return model, i, f"{alias!r} is the name of a served model"
            if is_pattern(alias):
                hit = next((m for m in models if fnmatchcase(m, alias)), None)
                if hit is not None:
                    return model, i, f"pattern {alias!r} matches the served model {hit!r}"
            first = owner.setdefault(alias, model)
            if first != model:
                return model, i, f"{alias!r} is already an alias of model {first!r}"
    return None
