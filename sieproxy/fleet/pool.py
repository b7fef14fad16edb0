"""Engine replicas of each model: readiness, circuit breaking, routing and admission.

Routing, for one request (all its candidates go to one replica and its prefix cache):
1. Candidates are the *ready* replicas whose labels match the request's ``X-SIE-Pool`` /
   ``X-SIE-MACHINE-PROFILE`` (absent header = any).
2. The affinity key (``routing``): ``prefix``, ``cache_aware`` — ``routing_key``, else
   ``prompt_cache_key``, else the prompt's prefix key (:mod:`sieproxy.core.affinity`);
   ``key_only`` — the client keys; ``least_loaded`` — none. ``cache_aware``'s ranking by cached
   tokens (``policy``, :mod:`sieproxy.cache_route`, via ``RouteHints.route``) comes first.
3. With a key, replicas are ranked by rendezvous hashing on it; the first one whose load stays
   within ``bound × (mean load + 1)`` and below the engine's running batch (its
   ``max_running_requests``, when given) is chosen: repeat prefixes reach a warm cache, one hot
   key cannot overload a replica, and every gateway process picks the same replica.
4. Otherwise the least loaded replica wins (ties: fewest own candidates, then fewest total).

Load: the gateway's own outstanding candidates, unless the engine reports its own (read after
each passing check and every ``load_interval``: SGLang's ``/v1/loads``, else ``/get_load``:
running + waiting, over its data-parallel ranks); between two reads, the engine's figure plus
the change in this process's own count since (never less than that count), so gateway processes
sharing a fleet balance on the engine's real queue.

Admission: a replica holds at most ``replica_max_inflight`` candidates. When every matching
replica is full the request waits (bounded by ``admission_wait``), then gets 503 + Retry-After.

Health: a background task per replica polls ``/health`` (and ``/server_info`` once, for the
text mode and the embedded engine's per-launch token). A failed check takes a replica out until
a check passes again. ``breaker_failures`` server-side request failures in a row open its
circuit breaker: the replica is out for a backoff that doubles on each further opening up to
``breaker_backoff_max`` (a successful request resets streak and backoff; 4xx never count). A
passing health check that *started after* the breaker opened closes it, half-open: the next
failed request opens it again for the doubled backoff, a successful one closes it for good. So
a replica whose ``/health`` passes is retried within one ``health_interval``, at the cost of
one failed request (retried on another replica) while its requests keep failing.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable
from typing import Any

import trio

from ..core.errors import InvalidRequest, ServiceUnavailable
from ..core.request.profile import positive_int
from ..core.tenancy.fairshare import FairShare, Ticket
from ..core.upstream.protocol import protocol_for
from ..settings.load import EngineSpec, GatewaySettings
from ..tenancy.admission import AdmissionQueue
from .client import EngineClient
from .replica import Replica, RouteHints

log = logging.getLogger("sieproxy.pool")

__all__ = ["ModelPool", "Replica", "RouteHints"]

_LOAD_BOUND = 1.25


class ModelPool:
    """The replicas of one model."""
    first_token: float | None = None  # the model's ``first_token_timeout`` (sieproxy.relay.attempt)
    max_resumes = 1  # the model's ``max_resumes`` (sieproxy.relay.resume)

    def __init__(
        self,
        model: str,
        specs: Iterable[EngineSpec],
        g: GatewaySettings,
        *,
        routing: str = "prefix",
    ) -> None:
        self.model = model
        self._g = g
        self.routing = routing
        #: Requests waiting for admission now; requests refused 503, by cause (metrics).
        self.waiting = 0
        self.unserved = {"no_ready_replica": 0, "at_capacity": 0}
        self.replicas = [
            Replica(
                url=s.url.rstrip("/"),
                pool=s.pool,
                machine_profile=s.machine_profile,
                protocol=s.protocol,
            )
            for s in specs
        ]
        self._labels()
        #: Requests waiting for a slot, granted in fair-share order whenever capacity may
        #: have appeared (``_wake``).
        self.queue = AdmissionQueue(FairShare(g.batch_promote_after))
        self._watch_with: tuple[trio.Nursery, EngineClient] | None = None
        #: False while the model's chat template is still being discovered from an engine.
        self.gate_open = True
        #: Why the model's embedded engine was given up (``sieproxy.child``), else None.
        self.failed: str | None = None
        #: The embedded engine's per-launch token: a replica becomes ready only once its
        #: ``/server_info`` reports it (another process on the port is never taken for it).
        self.launch_token: str | None = None
        self.policy: Any = None  # routing = "cache_aware": its sieproxy.fleet.cache_route policy

    def _labels(self) -> None:
        self.pools = frozenset(r.pool for r in self.replicas if r.pool)
        self.machine_profiles = frozenset(
            r.machine_profile for r in self.replicas if r.machine_profile
        )
        self._label_pairs = frozenset((r.pool, r.machine_profile) for r in self.replicas)

    def set_engines(self, specs: Iterable[EngineSpec]) -> tuple[list[str], list[str]]:
        """Replace the replica list (a config reload); returns the URLs (added, removed).

        A replica whose URL stays keeps its state (readiness, breaker, in-flight counts) and
        takes the new labels. A new one starts not ready until its first health check passes.
        A removed one is never chosen again; requests already running on it finish there.
        """
        old = {r.url: r for r in self.replicas}
        keep: list[Replica] = []
        added: list[Replica] = []
        for spec in specs:
            url = spec.url.rstrip("/")
            r = old.pop(url, None)
            if r is None:
                r = Replica(url=url)
                added.append(r)
            r.pool, r.machine_profile = spec.pool, spec.machine_profile
            r.protocol = spec.protocol
            keep.append(r)
        for r in old.values():
            r.retired = True
        self.replicas = keep
        self._labels()
        if self._watch_with is not None:
            nursery, client = self._watch_with
            for r in added:
                nursery.start_soon(self._watch, r, client)
        self._wake()
        return [r.url for r in added], list(old)

    def _wake(self) -> None:
        self.queue.dispatch(self._choose)

    # ------------------------------------------------------------------ readiness
    def any_ready(self) -> bool:
        now = trio.current_time()
        return self.gate_open and any(r.available(now) for r in self.replicas)

    def check_hints(self, h: RouteHints) -> None:
        """Header values that no replica of the model carries are a 400 naming the header.

        This covers the two headers together: a pool and a machine profile that each exist but
        never on one replica can never be served, so a retry (503) would be no answer.
        """
        if h.pool is not None and h.pool not in self.pools:
            raise InvalidRequest(
                f"No engine of model {self.model!r} is in pool {h.pool!r}.", param="X-SIE-Pool"
            )
        if h.machine_profile is not None and h.machine_profile not in self.machine_profiles:
            raise InvalidRequest(
                f"No engine of model {self.model!r} has machine profile {h.machine_profile!r}.",
                param="X-SIE-MACHINE-PROFILE",
            )
        if (
            h.pool is not None
            and h.machine_profile is not None
            and (h.pool, h.machine_profile) not in self._label_pairs
        ):
            raise InvalidRequest(
                f"No engine of model {self.model!r} is both in pool {h.pool!r} (X-SIE-Pool) "
                f"and of machine profile {h.machine_profile!r} (X-SIE-MACHINE-PROFILE); "
                "drop one of the two headers or choose values one engine carries.",
                param="X-SIE-Pool",
            )

    def record_success(self, r: Replica) -> None:
        r.failures = 0
        r.backoff = 0.0

    def record_failure(self, r: Replica) -> None:
        """A request or a health check failed on ``r``; open its breaker after a streak."""
        r.failures += 1
        if r.failures >= self._g.breaker_failures:
            r.backoff = min(
                self._g.breaker_backoff_max,
                (r.backoff * 2) if r.backoff else self._g.breaker_backoff,
            )
            r.opened_at = trio.current_time()
            r.out_until = r.opened_at + r.backoff
            r.failures = 0
            log.warning(
                "replica %s of %s taken out for %.1f s after %d failed requests",
                r.url,
                self.model,
                r.backoff,
                self._g.breaker_failures,
            )

    def _close_breaker(self, r: Replica) -> None:
        """A health check that started after the breaker opened passed: put ``r`` back now,
        half-open (one more failed request opens the breaker again)."""
        r.out_until = 0.0
        r.failures = self._g.breaker_failures - 1
        log.info("replica %s of %s is back: a health check passed", r.url, self.model)
        self._wake()

    # ------------------------------------------------------------------ routing
    def _choose(
        self, h: RouteHints, k: int, exclude: Replica | None
    ) -> tuple[Replica | None, bool]:
        """Best replica with room for ``k`` candidates, and whether any matching replica is
        available at all. A request larger than the cap may still run alone on an idle one."""
        now = trio.current_time()
        if not self.gate_open:
            return None, False
        cands = [r for r in self.replicas if r is not exclude and r.matches(h)]
        live = [r for r in cands if r.available(now)]
        if not live:
            return None, False
        cap = self._g.replica_max_inflight
        roomy = [r for r in live if r.inflight + k <= cap or r.inflight == 0]
        if not roomy:
            return None, True
        key = self._key(h)
        ranked = None if key is None else sorted(roomy, key=lambda r: _score(key, r.url))
        if h.route is not None:
            ranked = h.route.policy.rank(h.route, ranked or roomy) or ranked
        if ranked:
            mean = sum(r.load() for r in live) / len(live)
            limit = math.ceil(_LOAD_BOUND * (mean + 1))
            for r in ranked:
                load = r.load()
                if load < limit and (r.max_running is None or load < r.max_running):
                    return r, True
        return min(roomy, key=lambda r: (r.load(), r.inflight, r.total)), True

    def _key(self, h: RouteHints) -> str | None:
        if self.routing == "least_loaded":
            return None
        if h.affinity_key is not None or self.routing == "key_only":
            return h.affinity_key
        return h.prefix_key

    async def acquire(
        self,
        h: RouteHints,
        k: int,
        *,
        exclude: Replica | None = None,
        wait: bool = True,
        ticket: Ticket | None = None,
    ) -> Replica:
        """Reserve ``k`` candidate slots on one replica (bounded wait, none without ``wait``),
        or raise 503. Waiting requests get slots in fair-share order (``ticket``:
        sieproxy/tenancy/admission.py)."""
        ticket = ticket or Ticket(cost=k)
        r, any_live = self._choose(h, k, exclude)
        if r is None and any_live and wait:  # every matching replica is full: wait for a slot
            self.waiting += 1
            try:
                wait_for = self._g.admission_wait  # (no timer when there is room)
                got: Replica | None = await self.queue.wait(
                    ticket, h, k, exclude, wait_for, self.release
                )
            finally:
                self.waiting -= 1
            r = got  # its slots were taken when it was granted
        elif r is not None:
            r.inflight += k
            r.total += k
            self.queue.fair.charge(ticket)
        if r is not None:
            if h.route is not None:  # routing = "cache_aware" (sieproxy/fleet/cache_route.py)
                h.route.policy.sent(h.route, r)
            return r
        now = trio.current_time()
        any_live = self.gate_open and any(r.available(now) for r in self.replicas if r.matches(h))
        if any_live:
            self.unserved["at_capacity"] += 1
            raise ServiceUnavailable(
                f"Every engine of model {self.model!r} is at capacity; retry shortly.",
                retry_after=self._g.retry_after,
            )
        self.unserved["no_ready_replica"] += 1
        raise ServiceUnavailable(
            f"Model {self.model!r} is loading or has no ready engine; retry shortly.",
            retry_after=self._g.retry_after,
            code="model_loading",
        )

    def release(self, r: Replica, k: int = 1) -> None:
        r.inflight -= k
        self._wake()

    # ------------------------------------------------------------------ health
    async def run_health_checks(self, client: EngineClient) -> None:
        """Background health checks, one task per replica (runs until cancelled)."""
        async with trio.open_nursery() as nursery:
            self._watch_with = (nursery, client)
            for r in self.replicas:
                nursery.start_soon(self._watch, r, client)
            # Open for replicas that join later (set_engines), even when none is left now.
            await trio.sleep_forever()

    async def _watch(self, r: Replica, client: EngineClient) -> None:
        g = self._g
        while not r.retired:
            started = trio.current_time()
            ok = foreign = False
            why = "its /health did not answer 200"
            with trio.move_on_after(g.health_timeout) as scope:
                try:
                    proto = protocol_for(r.protocol)
                    ok = await client.health(r.url, proto.health_paths)
                    if ok and not r.info_loaded and not proto.server_info:
                        r.info_loaded = True
                    if ok and not r.info_loaded:
                        info = await client.server_info(r.url)
                        if self.launch_token and info.get("launch_token") != self.launch_token:
                            ok, foreign = False, True
                            why = "the process answering there is not this gateway's engine"
                        else:
                            r.incremental = bool(info.get("incremental_streaming_output", False))
                            r.max_running = positive_int(info.get("max_running_requests"))
                            r.info_loaded = True
                except Exception as exc:
                    ok = False
                    why = f"its check failed ({type(exc).__name__})"
            if scope.cancelled_caught:
                ok = False
                why = f"its check took longer than {g.health_timeout:g} s"
            if foreign and not r.foreign:
                log.error("replica %s of %s is not used: %s", r.url, self.model, why)
            r.foreign = foreign
            if not ok and self.launch_token:
                r.info_loaded = False  # after an outage, check who answers there again
            if not ok:
                r.engine_load = None  # until its engine answers again
            # One log line per transition, when a replica leaves or returns.
            if ok and started > r.opened_at and r.out_until > trio.current_time():
                self._close_breaker(r)
            if ok and not r.ready:
                log.info("replica %s of %s is ready", r.url, self.model)
                r.ready = True
                self._wake()
            elif not ok and r.ready:
                log.warning("replica %s of %s is not ready: %s", r.url, self.model, why)
                r.ready = False
            if ok:
                await self._read_loads(r, client, trio.current_time() + g.health_interval)
            else:
                await trio.sleep(
                    g.health_interval if r.info_loaded else min(1.0, g.health_interval)
                )

    async def _read_loads(self, r: Replica, client: EngineClient, until: float) -> None:
        """Read the engine's own load now and every ``load_interval`` until ``until`` (the next
        health check); an engine without a load endpoint is asked again only after that check,
        one whose read failed or hung at the next interval (its report is dropped meanwhile)."""
        g = self._g
        while not r.retired:
            load, absent = None, False
            with trio.move_on_after(g.health_timeout):
                try:
                    load = await client.load(r.url)
                    absent = load is None  # no load endpoint (a failed read is retried)
                except Exception:  # a load read failing is no health verdict
                    load = None
            r.engine_load = None if load is None else load[0] + load[1]
            r.inflight_at_read = r.inflight
            now = trio.current_time()
            step = until - now if absent else g.load_interval
            if now + step >= until:
                await trio.sleep_until(until)
                return
            await trio.sleep(step)


def _score(key: str, url: str) -> bytes:
    # Rendezvous (highest-random-weight) hashing: rank replicas by hash(key, url).
    return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()[::-1]
