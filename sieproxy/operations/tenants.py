"""``sieproxy keys add|list|revoke`` and ``sieproxy usage``.

The keys commands edit the keys file named by ``--keys-file`` (else the settings'
``gateway.keys_file``); each write replaces the file at once, so a gateway watching it never
reads half a file. ``add`` prints the new key once: only its hash is stored. ``usage`` reads the
per-minute usage that the gateways write to Redis (``gateway.redis_url``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from ..settings.keys import KeyLine, add_key, read_lines, revoke_keys
from ..settings.load import ConfigError, Settings

__all__ = ["add_parsers", "run_command"]

_PERIOD = re.compile(r"^(\d+)([mhd])$")
_UNIT = {"m": 60, "h": 3600, "d": 86400}


def add_parsers(sub: Any) -> None:
    k = sub.add_parser(
        "keys",
        help="add, list or revoke API keys (tenants) in the keys file",
        description="Edit the keys file (gateway.keys_file). A running gateway picks the "
        "change up within seconds.",
    )
    ks = k.add_subparsers(dest="keys_cmd", required=True, metavar="{add,list,revoke}")
    add = ks.add_parser("add", help="add a key for a tenant and print it (once)")
    add.add_argument("--tenant", required=True, help="the tenant's name")
    add.add_argument("--models", default="*", help="comma-separated model names (default: *)")
    add.add_argument("--priority", choices=["interactive", "batch"], default=None)
    add.add_argument("--rpm", type=int, help="requests per minute (default: no limit)")
    add.add_argument("--tpm", type=int, help="tokens per minute (default: no limit)")
    add.add_argument("--concurrency", type=int, help="concurrent requests (default: no limit)")
    add.add_argument("--weight", type=float, default=None, help="fair-share weight (default 1)")
    ks.add_parser("list", help="list the keys (ids, tenants, limits; never the keys)")
    rv = ks.add_parser("revoke", help="remove a key by its id, or every key of a tenant")
    rv.add_argument("which", help="a key id (key-...) or a tenant name")
    for p in ks.choices.values():
        p.add_argument("--config", metavar="FILE", help="TOML settings file")
        p.add_argument("--keys-file", metavar="FILE", help="the keys file (default: the "
                       "settings' gateway.keys_file)")  # fmt: skip
    u = sub.add_parser(
        "usage",
        help="each tenant's usage over a period (from Redis)",
        description="Print each tenant's requests, tokens and refusals over the last period, "
        "as the gateways sharing gateway.redis_url recorded them.",
    )
    u.add_argument("--config", metavar="FILE", help="TOML settings file")
    u.add_argument("--redis-url", help="default: the settings' gateway.redis_url")
    u.add_argument("--since", default="1h", help="the period: 30m, 24h, 7d (default 1h)")
    u.add_argument("--json", action="store_true", help="one JSON object instead of a table")


def _keys_path(args: Any, settings: Settings) -> str:
    path = args.keys_file or settings.gateway.keys_file
    if not path:
        raise ConfigError("no keys file: give --keys-file or set gateway.keys_file")
    return str(path)


def _served(settings: Settings) -> set[str] | None:
    names = set(settings.models)
    if settings.embedded_engine.enabled:
        names.add(settings.embedded_engine.served_name)
    return names or None


def _keys(args: Any, settings: Settings) -> int:
    path = _keys_path(args, settings)
    if args.keys_cmd == "add":
        existing = [ln for _, ln in read_lines(_read(path), path) if ln.tenant == args.tenant]
        base = existing[0] if existing else KeyLine(id="", sha256="", tenant=args.tenant)
        line = KeyLine(
            id="",
            sha256="",
            tenant=args.tenant,
            models=[m.strip() for m in args.models.split(",") if m.strip()],
            priority=args.priority or base.priority,
            rpm=args.rpm if args.rpm is not None else base.rpm,
            tpm=args.tpm if args.tpm is not None else base.tpm,
            concurrency=args.concurrency if args.concurrency is not None else base.concurrency,
            weight=args.weight if args.weight is not None else base.weight,
        )
        key, written = add_key(path, line, _served(settings))
        print(key)
        print(
            f"added {written.id} for tenant {written.tenant!r} to {path}; the key is shown "
            "only now: store it safely",
            file=sys.stderr,
        )
        return 0
    if args.keys_cmd == "list":
        rows: list[tuple[str, ...]] = [
            ("ID", "TENANT", "MODELS", "PRIORITY", "RPM", "TPM", "CONCURRENCY", "CREATED")
        ]
        for _, ln in read_lines(_read(path), path):
            rows.append((ln.id, ln.tenant, ",".join(ln.models), ln.priority, _n(ln.rpm),
                         _n(ln.tpm), _n(ln.concurrency), ln.created or "-"))  # fmt: skip
        _table(rows)
        return 0
    gone = revoke_keys(path, args.which)
    if not gone:
        print(f"sieproxy: no key id or tenant {args.which!r} in {path}", file=sys.stderr)
        return 1
    for ln in gone:
        print(f"revoked {ln.id} (tenant {ln.tenant!r})")
    return 0


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return ""
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _usage(args: Any, settings: Settings) -> int:
    url = args.redis_url or settings.gateway.redis_url
    if not url:
        raise ConfigError(
            "usage is recorded in Redis: set gateway.redis_url (or give --redis-url); without "
            "Redis each gateway exports its own counts on /metrics (sieproxy_tenant_*)"
        )
    m = _PERIOD.match(args.since)
    if not m:
        raise ConfigError(
            f"--since: expected a number and m, h or d (30m, 24h, 7d), got {args.since!r}"
        )
    seconds = int(m.group(1)) * _UNIT[m.group(2)]
    import trio

    from ..front.tenants import redis_client
    from ..tenancy.redis_store import USAGE_RETENTION, RedisCounters

    if seconds > USAGE_RETENTION:
        raise ConfigError(f"--since: usage is kept {USAGE_RETENTION // 86400} days at most")
    now = int(time.time() // 60)
    minutes = range(now - seconds // 60 + 1, now + 1)

    async def read() -> dict[str, dict[str, int]]:
        client = redis_client(url)
        async with client:
            return await RedisCounters(client).read_usage(minutes)

    totals = trio.run(read)
    if args.json:
        print(json.dumps({"since": args.since, "tenants": totals}, indent=2, sort_keys=True))
        return 0
    cols = ("requests", "prompt_tokens", "completion_tokens")
    rows: list[tuple[str, ...]] = [
        ("TENANT", "REQUESTS", "PROMPT_TOKENS", "COMPLETION_TOKENS", "REJECTED")
    ]
    for tenant in sorted(totals):
        t = totals[tenant]
        rejected = sum(v for k, v in t.items() if k.startswith("rejected_"))
        rows.append((tenant, *(str(t.get(c, 0)) for c in cols), str(rejected)))
    _table(rows)
    return 0


def run_command(args: argparse.Namespace, settings: Settings) -> int:
    if args.cmd == "keys":
        return _keys(args, settings)
    return _usage(args, settings)
