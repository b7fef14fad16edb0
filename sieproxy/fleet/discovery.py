"""Engine discovery: DNS names re-resolved periodically and an engines file watched for changes.

Each served model has one :class:`EngineSources`: its configured ``engines`` (plain URLs, and
entries with ``discover = "dns"``) and its ``engines_file``. The model's replicas are what
:func:`sieproxy.core.upstream.discovery.replicas` makes of them, applied with
``ModelPool.set_engines``:
an address that appears becomes a replica that takes requests after its first passing health
check; one that vanishes is never chosen again, and the streams running on it finish there
(draining). A model with neither kind of entry changes its list only on reload.

* A DNS entry's host is resolved (``trio.socket.getaddrinfo``, through :data:`resolve`, which
  tests replace) at start and every ``interval`` seconds. A name that does not exist, or has
  no address, leaves the entry with none (its replicas drain); any other resolution failure (a
  timeout, a server failure) keeps the addresses last resolved, so a DNS outage does not empty
  the fleet. Each resolution is bounded by ``health_timeout``.
* The engines file is checked every :data:`FILE_POLL` seconds (a ``stat``) and re-read when its
  modification time, size or inode changed (a Kubernetes ConfigMap volume swaps a symlink). A
  file that cannot be read or has a bad line keeps the list last read, logged once per change.
* A reload (SIGHUP) calls :meth:`EngineSources.configure` and applies the new entries at once
  (what DNS entries that stay resolved to is kept; new ones are resolved right away).
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Awaitable, Callable

import trio

from ..core.upstream.discovery import Endpoint, diff, host_port, replicas
from ..settings.load import EngineSpec, parse_engines_file
from .pool import ModelPool

__all__ = ["FILE_POLL", "EngineSources", "resolve"]

log = logging.getLogger("sieproxy.discovery")

#: Seconds between two checks of an engines file.
FILE_POLL = 1.0

#: The host names a resolution may answer "no such name / no address" for (the entry then has
#: no replica); every other failure keeps the addresses last resolved.
_GONE = {getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)}


class NameGone(Exception):
    """The name does not exist, or has no address (the entry stands for no replica)."""


async def _getaddrinfo(host: str, port: int | None) -> list[str]:
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _GONE:
            raise NameGone(host) from exc
        raise
    out: list[str] = []
    for *_, sockaddr in infos:
        addr = str(sockaddr[0])
        if addr not in out:
            out.append(addr)
    return out


#: The resolver: host, port → addresses (raises :class:`NameGone` for a name with none). Read
#: at each resolution, so a test may replace it while the gateway runs.
resolve: Callable[[str, int | None], Awaitable[list[str]]] = _getaddrinfo


def _endpoint(spec: EngineSpec) -> Endpoint:
    return Endpoint(
        spec.url.rstrip("/"), spec.pool, spec.machine_profile, spec.discover == "dns",
        spec.protocol,
    )  # fmt: skip


class EngineSources:
    """Where one model's replicas come from (see the module docstring)."""

    def __init__(
        self, model: str, specs: list[EngineSpec], engines_file: str | None, timeout: float
    ) -> None:
        self.model = model
        self._timeout = timeout
        self._resolved: dict[str, list[str]] = {}
        self._file_entries: list[Endpoint] = []
        self._file_key: tuple[float, int, int] | None = None
        self._file_problem: str | None = None
        self._file: str | None = None
        self._kick = trio.Event()
        self.configure(specs, engines_file)

    def configure(self, specs: list[EngineSpec], engines_file: str | None) -> None:
        """Take new entries (at start, and on reload); what stays keeps its state."""
        self._entries = [_endpoint(s) for s in specs]
        self._interval = {e.url: s.interval for e, s in zip(self._entries, specs, strict=True)}
        self._resolved = {u: a for u, a in self._resolved.items() if u in self._interval}
        self._due = {e.url: 0.0 for e in self._entries if e.dns}
        if engines_file != self._file:
            self._file_entries, self._file_key = [], None
        self._file = engines_file
        if engines_file is not None:
            self._read_file()
        self._kick.set()

    def specs(self) -> list[EngineSpec]:
        """The replicas the model should have now."""
        found = replicas(self._entries, self._resolved, self._file_entries)
        return [
            EngineSpec(
                url=e.url, pool=e.pool, machine_profile=e.machine_profile, protocol=e.protocol
            )
            for e in found
        ]

    def _read_file(self) -> bool:
        """Re-read the engines file if it changed; True when its entries changed. (Blocking
        calls: a ``stat`` a second, and a read of a small local file when it changed.)"""
        assert self._file is not None
        try:
            st = os.stat(self._file)
            key = (st.st_mtime, st.st_size, st.st_ino)
            if key == self._file_key:
                return False
            with open(self._file, encoding="utf-8") as f:
                text = f.read()
            self._file_key = key  # a bad line is not read again until the file changes
            entries = [_endpoint(s) for s in parse_engines_file(text)]
        except (OSError, ValueError) as exc:
            if str(exc) != self._file_problem:  # logged once, not every poll
                self._file_problem = str(exc)
                log.warning(
                    "model %s: engines file %s not applied, the last list stays: %s",
                    self.model,
                    self._file,
                    exc,
                )
            return False
        self._file_problem = None
        changed = entries != self._file_entries
        self._file_entries = entries
        return changed

    async def _resolve(self, entry: Endpoint) -> bool:
        """Resolve one DNS entry; True when its addresses changed."""
        host, port = host_port(entry.url)
        try:
            with trio.fail_after(self._timeout):
                addresses = await resolve(host, port)
        except NameGone:
            addresses = []
        except (OSError, trio.TooSlowError) as exc:
            log.warning(
                "model %s: resolving %s failed (%s); its last addresses stay",
                self.model,
                host,
                type(exc).__name__,
            )
            return False
        addresses = sorted(addresses)
        if self._resolved.get(entry.url) == addresses or entry.url not in self._due:
            return False
        self._resolved[entry.url] = addresses
        return True

    async def run(self, pool: ModelPool) -> None:
        """Keep ``pool``'s replicas in line with the sources (runs until cancelled)."""
        while True:
            self._kick = trio.Event()
            now = trio.current_time()
            changed = False
            for entry in self._entries:
                if entry.dns and self._due.get(entry.url, 0.0) <= now:
                    changed |= await self._resolve(entry)
                    if entry.url in self._due:  # (a reload during the await may drop it)
                        self._due[entry.url] = trio.current_time() + self._interval[entry.url]
            if self._file is not None:
                changed |= self._read_file()
            if changed:
                self.apply(pool)
            wake = min(self._due.values(), default=math.inf)  # no source: until a reload
            if self._file is not None:
                wake = min(wake, trio.current_time() + FILE_POLL)
            with trio.move_on_at(wake):
                await self._kick.wait()

    def apply(self, pool: ModelPool) -> tuple[list[str], list[str]]:
        """Give ``pool`` the current list; returns the URLs (added, removed)."""
        specs = self.specs()
        added, removed = diff((r.url for r in pool.replicas), (s.url for s in specs))
        pool.set_engines(specs)
        if added or removed:
            log.info(
                "model %s: engines added %s, removed %s (draining)",
                self.model,
                added or "[]",
                removed or "[]",
            )
        return added, removed
