"""Engine discovery, the pure part: from configured entries, resolved addresses and an engines
file's lines to the list of replicas a model should have, and what changed.

The shell (``sieproxy.discovery``) resolves names and reads the file; this module decides:

* a DNS entry (``discover = "dns"``) stands for one replica per address its host resolved to,
  each the entry's URL with the host replaced by the address (``[...]`` for IPv6) and the
  entry's labels; an entry not resolved yet stands for none;
* the model's list is the static entries, then the DNS entries' replicas, then the file's, in
  that order, the first of several entries with the same URL winning;
* ``diff`` names the URLs added and removed between two lists (the pool keeps the state of a
  replica whose URL stays, starts an added one not ready, and drains a removed one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Endpoint", "diff", "host_port", "replicas", "with_address"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One configured engine entry, or one replica it stands for."""

    url: str
    pool: str | None = None
    machine_profile: str | None = None
    dns: bool = False  # the host is a name to resolve (an entry only, never a replica)
    protocol: str = "sglang"  # the engine's API (``core.protocol``)


def host_port(url: str) -> tuple[str, int | None]:
    """The host to resolve and the port of an entry's URL."""
    parts = urlsplit(url)
    return parts.hostname or "", parts.port


def with_address(url: str, address: str) -> str:
    """``url`` with its host replaced by ``address`` (the port, path and scheme kept)."""
    parts = urlsplit(url.rstrip("/"))
    host = f"[{address}]" if ":" in address else address
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    if parts.username is not None:  # user info is kept as written
        netloc = parts.netloc.rsplit("@", 1)[0] + "@" + netloc
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def replicas(
    entries: Sequence[Endpoint],
    resolved: Mapping[str, Sequence[str]],
    file_entries: Sequence[Endpoint] = (),
) -> list[Endpoint]:
    """The replicas of a model: static entries, DNS entries expanded by ``resolved`` (entry URL
    → addresses), then the file's entries; one per URL, the first one winning."""
    out: dict[str, Endpoint] = {}

    def add(items: Iterable[Endpoint]) -> None:
        for e in items:
            url = e.url.rstrip("/")
            out.setdefault(url, Endpoint(url, e.pool, e.machine_profile, protocol=e.protocol))

    add(e for e in entries if not e.dns)
    for e in entries:
        if e.dns:
            add(
                Endpoint(with_address(e.url, a), e.pool, e.machine_profile, protocol=e.protocol)
                for a in resolved.get(e.url, ())
            )
    add(file_entries)
    return list(out.values())


def diff(before: Iterable[str], after: Iterable[str]) -> tuple[list[str], list[str]]:
    """The URLs in ``after`` and not ``before`` (added), and the reverse (removed), in order."""
    old, new = list(before), list(after)
    olds, news = set(old), set(new)
    return [u for u in new if u not in olds], [u for u in old if u not in news]
