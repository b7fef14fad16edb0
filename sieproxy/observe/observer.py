"""Metrics (Prometheus text format) and the structured access log.

Both are fed once per request (:meth:`Observer.request_done`), never per chunk. Gauges of
replica state are read from the pools at scrape time (``collectors.py``). No label carries user
data: labels are the endpoint, the configured model name, the status code, the replica URL
(from config) and the abort cause (a fixed vocabulary), and the tenant's name (from the keys
file; never a key).

The access log is one JSON line per generation request on the ``sieproxy.access`` logger, with
its real outcome: refused before it ran (its error status), left by its client before the
status line (``499``, as nginx logs it; ``444`` if the gateway closed it first, at shutdown),
or answered (its status, and ``outcome`` saying whether the client got the response's end).
Every line has the same fields, ``tenant`` among them (the key's tenant; null with auth off
or before the key was known). It never carries a bearer token, a prompt, generated text or
``user``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import trio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..core.errors import GatewayError
from ..fleet.pool import ModelPool
from ..tenancy.limiter import Limiter
from .cache_metrics import CacheRouteCollector
from .collectors import LimiterCollector, PoolCollector
from .stats import RequestStats

__all__ = ["FALLBACK_CAUSES", "Observer"]

access_log = logging.getLogger("sieproxy.access")
_enc = msgspec.json.Encoder()

#: The statuses recorded for a request that got no status line, as nginx records them (no
#: response carries them): its client left first ("client closed request"), or the gateway
#: closed the connection first (a shutdown's grace ran out: "no response").
CLIENT_CLOSED = 499
NO_RESPONSE = 444

#: Why a request moved to a fallback (sieproxy/relay/fallback.py).
FALLBACK_CAUSES = ("no_replica", "full", "failed", "first_token", "context", "resume")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Observer:
    def __init__(
        self,
        pools: dict[str, ModelPool],
        *,
        access_log_enabled: bool = True,
        inflight: Callable[[], dict[str, int]] = dict,
        with_fallbacks: Iterable[str] = (),
    ) -> None:
        self.registry = CollectorRegistry()
        self._access = access_log_enabled
        r = self.registry
        r.register(CacheRouteCollector(pools))
        self.requests = Counter(
            "sieproxy_requests",
            "Requests by endpoint, model and status.",
            ["endpoint", "model", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "sieproxy_time_to_first_token_seconds",
            "Time to first token.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "sieproxy_request_duration_seconds",
            "Whole request duration.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sieproxy_inter_token_latency_seconds",
            "Mean time between tokens of a request (one observation per request).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "sieproxy_tokens",
            "Tokens in (prompt) and out (completion).",
            ["model", "direction"],
            registry=r,
        )
        self.aborts = Counter(
            "sieproxy_upstream_aborts",
            "Upstream aborts by cause.",
            ["model", "cause"],
            registry=r,
        )
        self.retries = Counter(
            "sieproxy_retries",
            "Requests retried on another replica before any byte.",
            ["model"],
            registry=r,
        )
        self.fallbacks = Counter(
            "sieproxy_fallbacks",
            "Requests moved before any byte to a fallback of the model they named, by cause "
            "(no_replica: none ready; full: no room past admission_wait; failed: the engine "
            "failed in a way the retry table allows; first_token: nothing within the model's "
            "first_token_timeout; context: the prompt too long for the model; resume: a broken "
            "stream continued on a fallback).",
            ["model", "cause"],
            registry=r,
        )
        self.resumes = Counter(
            "sieproxy_resumes",
            "Candidates whose stream broke after output and continued on another attempt, by "
            "cause (cut, error_event, stall, malformed).",
            ["model", "cause"],
            registry=r,
        )
        #: The labelled children of the per-request metrics, by metric and label values:
        #: ``labels()`` validates, locks and looks up on every call (``_child``).
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        for model in with_fallbacks:  # exported at 0 from the start (rates need a series)
            for cause in FALLBACK_CAUSES:
                self.fallbacks.labels(model, cause)
        r.register(PoolCollector(pools, inflight))
        self.tenant_requests = Counter(
            "sieproxy_tenant_requests",
            "Generation requests by tenant and status.",
            ["tenant", "status"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "sieproxy_tenant_tokens",
            "Tokens in (prompt) and out (completion) by tenant.",
            ["tenant", "direction"],
            registry=r,
        )
        self.tenant_rejections = Counter(
            "sieproxy_tenant_rejections",
            "Requests refused by a tenant limit: requests, tokens, concurrency (429), too_large "
            "(400: more than the per-minute budget), model (404: a model the key may not use).",
            ["tenant", "limit"],
            registry=r,
        )
        self.tenant_wait = Histogram(
            "sieproxy_tenant_admission_wait_seconds",
            "Time a tenant's admitted requests waited for a replica slot.",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._limiter: Limiter | None = None

    def watch_limiter(self, limiter: Limiter) -> None:
        """Export the limiter's Redis state, and feed it the usage ``sieproxy usage`` reads."""
        self._limiter = limiter
        if limiter.redis is not None:
            self.registry.register(LimiterCollector(limiter))

    def tenant_rejected(self, tenant: str, limit: str) -> None:
        self._child(self.tenant_rejections, tenant, limit).inc()
        if self._limiter is not None:
            self._limiter.count(tenant, f"rejected_{limit}")

    def fallback(self, model: str, cause: str) -> None:
        """One request of ``model`` went to a fallback (``cause``: a fixed vocabulary)."""
        self.fallbacks.labels(model, cause).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def refusal(
        self,
        endpoint: str,
        err: GatewayError,
        *,
        request_id: str | None,
        sdk_version: str | None,
        tenant: str | None = None,
    ) -> None:
        """A request answered with an error before it ran (no model label: it may be unknown)."""
        self._before_run(
            endpoint, err.status, "complete", err.code, request_id, sdk_version, tenant
        )

    def client_left(self, endpoint: str, *, request_id: str, sdk_version: str | None) -> None:
        """A request whose client left before it ran (while its body was arriving, or while it
        waited for admission): nothing was answered."""
        self._before_run(endpoint, CLIENT_CLOSED, "client_closed", None, request_id, sdk_version)

    def _before_run(
        self,
        endpoint: str,
        status: int,
        outcome: str,
        code: str | None,
        request_id: str | None,
        sdk_version: str | None,
        tenant: str | None = None,
    ) -> None:
        self.requests.labels(endpoint, "", str(status)).inc()
        if tenant is not None:
            self._child(self.tenant_requests, tenant, str(status)).inc()
        if self._access and access_log.isEnabledFor(logging.INFO):
            access_log.info(
                _enc.encode(
                    {
                        "request_id": request_id,
                        "endpoint": endpoint,
                        "model": None,
                        "status": status,
                        "outcome": outcome,
                        "n": None,
                        "stream": None,
                        "prompt_tokens": None,
                        "completion_tokens": None,
                        "ttft_ms": None,
                        "duration_ms": None,
                        "replica": None,
                        "abort_causes": None,
                        "retried": False,
                        "resumes": None,
                        "error_code": code,
                        "sdk_version": sdk_version,
                        "tenant": tenant,
                        "admission_wait_ms": None,
                        "cached_tokens": None,
                        "cached_tokens_predicted": None,
                    }
                ).decode()
            )

    def _child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """``metric.labels(*labels)``, made once (a series appears when first used, as
        before)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_done(self, s: RequestStats) -> None:
        now = trio.current_time()
        if not s.responded:
            status = CLIENT_CLOSED if s.outcome == "client_closed" else NO_RESPONSE
        else:
            status = s.error.status if s.error is not None else 200
        child, model = self._child, s.model
        child(self.requests, s.endpoint, model, str(status)).inc()
        child(self.duration, model).observe(now - s.started)
        ttft = None
        if s.first_token_at is not None:
            ttft = s.first_token_at - s.started
            child(self.ttft, model).observe(ttft)
            if s.completion_tokens > 1:
                child(self.itl, model).observe(
                    (now - s.first_token_at) / (s.completion_tokens - 1)
                )
        if s.prompt_tokens:
            child(self.tokens, model, "in").inc(s.prompt_tokens)
        if s.completion_tokens:
            child(self.tokens, model, "out").inc(s.completion_tokens)
        for cause, k in s.abort_causes.items():
            child(self.aborts, model, cause).inc(k)
        if s.retried:
            child(self.retries, model).inc()
        for cause, k in s.resumes.items():
            child(self.resumes, model, cause).inc(k)
        if s.tenant is not None:
            self._tenant_done(s, status)
        if self._access and access_log.isEnabledFor(logging.INFO):
            access_log.info(
                _enc.encode(
                    {
                        "request_id": s.request_id,
                        "endpoint": s.endpoint,
                        "model": s.model,
                        "status": status,
                        "outcome": s.outcome,
                        "n": s.n,
                        "stream": s.stream,
                        "prompt_tokens": s.prompt_tokens,
                        "completion_tokens": s.completion_tokens,
                        "ttft_ms": None if ttft is None else round(ttft * 1000, 3),
                        "duration_ms": round((now - s.started) * 1000, 3),
                        "replica": s.replica,
                        "abort_causes": s.abort_causes or None,
                        "retried": s.retried,
                        "resumes": s.resumes or None,
                        "error_code": None if s.error is None else s.error.code,
                        "sdk_version": s.sdk_version,
                        "tenant": s.tenant,
                        "admission_wait_ms": round(s.admission_wait * 1000, 3),
                        "cached_tokens": s.cached_tokens,
                        "cached_tokens_predicted": s.cached_predicted,
                    }
                ).decode()
            )

    def _tenant_done(self, s: RequestStats, status: int) -> None:
        tenant = s.tenant or ""
        self._child(self.tenant_requests, tenant, str(status)).inc()
        self._child(self.tenant_wait, tenant).observe(s.admission_wait)
        if s.prompt_tokens:
            self._child(self.tenant_tokens, tenant, "in").inc(s.prompt_tokens)
        if s.completion_tokens:
            self._child(self.tenant_tokens, tenant, "out").inc(s.completion_tokens)
        if self._limiter is not None:
            self._limiter.count(tenant, "requests")
            self._limiter.count(tenant, "prompt_tokens", s.prompt_tokens)
            self._limiter.count(tenant, "completion_tokens", s.completion_tokens)
