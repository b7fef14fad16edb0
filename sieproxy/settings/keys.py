"""The keys file: API keys as tenants, stored as hashes only.

One JSON object per line (blank lines and lines starting with ``#`` are ignored)::

    {"id": "key-3f9a0c1b2d4e", "sha256": "<64 hex digits>", "tenant": "team-a",
     "models": ["*"], "priority": "interactive", "rpm": 60, "tpm": 40000, "concurrency": 4,
     "weight": 1.0, "created": "2026-12-05T09:30:00Z"}

``sha256`` is the SHA-256 of the key's UTF-8 bytes, in lower-case hex: the key itself is never
stored; ``sieproxy keys add`` prints it once. ``models``: the served model names the key may
use (``"*"``: every one). ``priority``: ``interactive`` (default) or ``batch``. ``rpm``,
``tpm``, ``concurrency``: the tenant's limits (``null`` or absent: none). ``weight``: the
tenant's share under saturation (default 1). Limits, priority and weight belong to the tenant:
every key of a tenant must give the same ones. A line that breaks a rule (not JSON, an unknown
field, a malformed hash, a hash or id seen on an earlier line, a model not served, a tenant whose
keys disagree) refuses the whole file with the line's number.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ..core.tenancy.fairshare import PRIORITIES
from ..core.tenancy.quota import Limits
from .schema import ConfigError

__all__ = [
    "KeyEntry",
    "KeyLine",
    "Tenant",
    "add_key",
    "key_digest",
    "legacy_entries",
    "load_keys",
    "parse_keys",
    "read_lines",
    "revoke_keys",
]

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: Tenant names appear in metric labels, log lines and Redis keys: a safe alphabet.
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY_PREFIX = "sk-sie-"


class KeyLine(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    id: str
    sha256: str
    tenant: str
    models: list[str] = msgspec.field(default_factory=lambda: ["*"])
    priority: str = "interactive"
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None
    weight: float = 1.0
    created: str | None = None


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: str = "interactive"
    limits: Limits = field(default_factory=Limits)
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """What a presented key maps to: its tenant and the models it may use (None: all)."""

    key_id: str
    tenant: Tenant
    models: frozenset[str] | None = None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def key_digest(key: str | bytes) -> str:
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return hashlib.sha256(raw).hexdigest()


def _check(line: KeyLine, models: Collection[str] | None) -> str | None:
    """The first problem of one line, or None."""
    if not _HEX64.match(line.sha256):
        return "`sha256` must be 64 lower-case hex digits (the SHA-256 of the key)"
    if not _TENANT.match(line.tenant):
        return "`tenant` must be 1-64 characters of letters, digits, '.', '_' or '-'"
    if not line.id or len(line.id) > 64:
        return "`id` must be 1-64 characters"
    if line.priority not in PRIORITIES:
        return f"`priority` must be one of {', '.join(PRIORITIES)}"
    for name in ("rpm", "tpm", "concurrency"):
        v = getattr(line, name)
        if v is not None and v < 1:
            return f"`{name}` must be >= 1 (or null: no limit)"
    if not line.weight > 0:
        return "`weight` must be > 0"
    if not line.models:
        return '`models` must name at least one model (or "*")'
    if models is not None:
        for m in line.models:
            if m != "*" and m not in models:
                return f"`models`: {m!r} is not a served model"
    return None


_decoder = msgspec.json.Decoder(KeyLine)


def read_lines(text: str, where: str) -> list[tuple[int, KeyLine]]:
    out: list[tuple[int, KeyLine]] = []
    for no, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        try:
            out.append((no, _decoder.decode(s)))
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{where}: line {no}: {exc}") from None
        except msgspec.DecodeError:
            raise ConfigError(f"{where}: line {no}: not a JSON object") from None
    return out


def parse_keys(text: str, where: str, models: Collection[str] | None = None) -> dict[str, KeyEntry]:
    """The keys of a keys file by their SHA-256 hex digest; ``ConfigError`` naming the line of
    the first problem (``models``: the served model names, checked when given)."""
    entries: dict[str, KeyEntry] = {}
    seen_ids: dict[str, int] = {}
    seen_hash: dict[str, int] = {}
    tenants: dict[str, tuple[int, Tenant]] = {}
    for no, line in read_lines(text, where):
        problem = _check(line, models)
        if problem is None and line.sha256 in seen_hash:
            problem = f"the same key (hash) as line {seen_hash[line.sha256]}"
        if problem is None and line.id in seen_ids:
            problem = f"the same `id` as line {seen_ids[line.id]}"
        tenant = Tenant(
            line.tenant, line.priority, Limits(line.rpm, line.tpm, line.concurrency), line.weight
        )
        if problem is None and line.tenant in tenants and tenants[line.tenant][1] != tenant:
            first = tenants[line.tenant][0]
            problem = (
                f"tenant {line.tenant!r} has other limits, priority or weight on line {first}; "
                "every key of a tenant must give the same"
            )
        if problem is not None:
            raise ConfigError(f"{where}: line {no}: {problem}")
        tenants.setdefault(line.tenant, (no, tenant))
        seen_hash[line.sha256] = seen_ids[line.id] = no
        allowed = None if "*" in line.models else frozenset(line.models)
        entries[line.sha256] = KeyEntry(line.id, tenant, allowed)
    return entries


def load_keys(path: str, models: Collection[str] | None = None) -> dict[str, KeyEntry]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"gateway.keys_file: cannot read {path}: {why}") from None
    return parse_keys(text, path, models)


def legacy_entries(tokens: list[bytes]) -> dict[str, KeyEntry]:
    """The old bearer tokens as tenants with no limits: ``token-<first 8 hex of the hash>``."""
    out: dict[str, KeyEntry] = {}
    for t in tokens:
        h = key_digest(t)
        out[h] = KeyEntry(f"token-{h[:8]}", Tenant(f"token-{h[:8]}"))
    return out


def _write(path: str, lines: list[str]) -> None:
    """Replace the file at once (readers see the old or the new one), private to its owner."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(f"{ln}\n" for ln in lines))
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _existing(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None


def add_key(path: str, line: KeyLine, models: Collection[str] | None = None) -> tuple[str, KeyLine]:
    """Append a new key for ``line``'s tenant (its ``id``/``sha256`` are made here); returns
    the key, in clear (shown once), and the line written."""
    text = _existing(path)
    key = _KEY_PREFIX + secrets.token_urlsafe(32)
    digest = key_digest(key)
    line.sha256 = digest
    line.id = f"key-{secrets.token_hex(6)}"
    line.created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    new_text = text + ("" if not text or text.endswith("\n") else "\n")
    new_text += msgspec.json.encode(line).decode() + "\n"
    parse_keys(new_text, path, models)  # the file must stay valid with it
    _write(path, new_text.splitlines())
    return key, line


def revoke_keys(path: str, which: str) -> list[KeyLine]:
    """Remove the key whose ``id`` is ``which``, or every key of the tenant ``which``."""
    text = _existing(path)
    parsed = dict(read_lines(text, path))
    keep: list[str] = []
    gone: list[KeyLine] = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = parsed.get(no)
        if line is not None and which in (line.id, line.tenant):
            gone.append(line)
        else:
            keep.append(raw)
    if gone:
        _write(path, keep)
    return gone
