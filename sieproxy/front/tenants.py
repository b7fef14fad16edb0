"""Tenancy in a serving process: built from the settings, its Redis client kept open, the keys
file watched.

The keys file is re-read when it changes (its modification time, size or inode, looked at every
``KEYS_POLL`` seconds) and on SIGHUP (sieproxy/operations/lifecycle.py). A file that does
not parse, or breaks a rule, is refused with its line named in one log line, and the running
keys stay.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from typing import Any

import trio

from ..settings.keys import KeyEntry, load_keys
from ..settings.load import ConfigError, Settings
from ..tenancy.gate import Tenancy
from ..tenancy.limiter import Limiter
from ..tenancy.redis_store import RedisCounters
from .auth import Authenticator

__all__ = [
    "KEYS_POLL",
    "authenticator",
    "build_tenancy",
    "redis_client",
    "reload_keys",
    "run_tenancy",
]

log = logging.getLogger("sieproxy.tenancy")

#: Seconds between two looks at the keys file.
KEYS_POLL = 1.0


def redis_client(url: str) -> Any:
    """A ``coredis`` client for ``url`` that fails fast (the limiter falls back at once)."""
    import coredis
    from coredis.retry import NoRetryPolicy

    return coredis.Redis.from_url(
        url, connect_timeout=1.0, stream_timeout=1.0, retry_policy=NoRetryPolicy()
    )


def build_tenancy(settings: Settings, on_reject: Any = None) -> Tenancy:
    g = settings.gateway
    redis = RedisCounters(redis_client(g.redis_url)) if g.redis_url else None
    limiter = Limiter(redis)
    return Tenancy(limiter, on_reject) if on_reject is not None else Tenancy(limiter)


def authenticator(settings: Settings, served: Collection[str]) -> Authenticator:
    """Bearer tokens and the keys file (``ConfigError`` naming the line of a bad one)."""
    g = settings.gateway
    keys: dict[str, KeyEntry] | None = load_keys(g.keys_file, served) if g.keys_file else None
    return Authenticator(g.auth, settings.auth_tokens(), keys)


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def reload_keys(state: Any, served: Collection[str]) -> str:
    """Re-read the keys file into ``state.auth``; ``ConfigError`` leaves the running keys."""
    settings: Settings = state.settings
    state.auth = authenticator(settings, served)
    n = len(state.auth.keys)
    tenants = len({e.tenant.name for e in state.auth.keys.values()})
    return f"{n} key(s) of {tenants} tenant(s)"


async def _watch_keys(state: Any, served: Collection[str], every: float) -> None:
    path = state.settings.gateway.keys_file
    if not path:
        return
    last = _stamp(path)
    while True:
        await trio.sleep(every)
        if state.settings.gateway.keys_file != path:  # changed by a SIGHUP reload
            path = state.settings.gateway.keys_file
            if not path:
                return
        now = _stamp(path)
        if now == last or now is None:
            continue
        last = now
        try:
            what = reload_keys(state, served)
        except ConfigError as exc:
            log.error("keys file not reloaded, the running keys stay: %s", exc)
            continue
        log.warning("keys file reloaded: %s", what)


async def run_tenancy(state: Any, served: Collection[str], keys_poll: float = KEYS_POLL) -> None:
    """Background: the keys file watcher, and the Redis client with the limiter's tasks."""
    tenancy: Tenancy = state.tenancy
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_keys, state, served, keys_poll)
        redis = tenancy.limiter.redis
        if redis is not None:
            async with redis.client:
                await tenancy.limiter.run()
