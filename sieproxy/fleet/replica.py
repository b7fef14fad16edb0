"""A model's engine replica as its pool tracks it (readiness, circuit breaker, load), and a
request's routing hints (the labels, keys and tokens it is routed on). The pool
(``fleet/pool.py``) routes, admits and health-checks; these are only its records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Replica", "RouteHints"]


@dataclass(slots=True)
class RouteHints:
    pool: str | None = None
    machine_profile: str | None = None
    affinity_key: str | None = None  # routing_key, else prompt_cache_key
    prefix_key: str | None = None  # the prompt's leading block (sieproxy.core.planning.affinity)
    route: Any = None  # the prompt's tokens for ``policy`` (sieproxy.fleet.cache_route.Route)


@dataclass(eq=False)
class Replica:
    url: str
    pool: str | None = None
    machine_profile: str | None = None
    ready: bool = False
    incremental: bool = False
    protocol: str = "sglang"  # the engine's API (``core.protocol``)
    info_loaded: bool = False
    inflight: int = 0  # candidates currently running here
    total: int = 0
    failures: int = 0  # consecutive
    out_until: float = 0.0  # circuit open until this trio time
    opened_at: float = 0.0  # trio time the circuit last opened
    backoff: float = 0.0
    retired: bool = False  # dropped by a config reload: never chosen, its watcher stops
    foreign: bool = False  # the process answering at url is not the expected engine
    max_running: int | None = None  # the engine's batch size (server_info), when it says
    engine_load: int | None = None  # running + waiting, as the engine last reported (None: no)
    inflight_at_read: int = 0  # own candidates here when engine_load was read

    def load(self) -> int:
        """The engine's reported load plus this process's change since, else its own count."""
        if self.engine_load is None:
            return self.inflight
        return max(self.inflight, self.engine_load + self.inflight - self.inflight_at_read)

    def matches(self, h: RouteHints) -> bool:
        return (h.pool is None or h.pool == self.pool) and (
            h.machine_profile is None or h.machine_profile == self.machine_profile
        )

    def available(self, now: float) -> bool:
        return self.ready and now >= self.out_until
