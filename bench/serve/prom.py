"""The server's own Prometheus metrics, scraped before and after a load point.

What a point reports (``server_metrics``): the change of every counter (a family typed
``counter``, and the ``_sum``/``_count`` of histograms and summaries) over the point, and the
value of every gauge after it. Histogram buckets are left out. A server without a metrics
endpoint (connection refused, 404, not Prometheus text) gives ``{"available": false,
"reason": …}`` and the run goes on.
"""

from __future__ import annotations

import math
from typing import Any

import httpx


def parse(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Prometheus text exposition → (``{series: value}``, ``{family: type}``); a series is its
    name with its labels as written (``vllm:num_requests_running{model_name="m"}``)."""
    values: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 4 and parts[1] == "TYPE":
                types[parts[2]] = parts[3]
            continue
        if "}" in line:
            series, _, rest = line.rpartition("}")
            series += "}"
        else:
            series, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            raise ValueError(f"not Prometheus text: {line[:80]!r}")
        values[series.strip()] = float(fields[0])
    return values, types


def _family(series: str) -> str:
    return series.split("{", 1)[0]


def _kind(series: str, types: dict[str, str]) -> str:
    name = _family(series)
    if name in types:
        return types[name]
    for suffix in ("_sum", "_count", "_bucket", "_total", "_created"):
        base = name[: -len(suffix)] if name.endswith(suffix) else None
        if base is not None and base in types:
            return f"{types[base]}{suffix}"
    return "untyped"


def difference(before: dict[str, float], after: dict[str, float],
               types: dict[str, str]) -> dict[str, Any]:
    """Counters' changes and gauges' values after (see the module's docstring)."""
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for series, v in after.items():
        kind = _kind(series, types)
        if kind.endswith("_bucket") or kind.endswith("_created") or math.isnan(v):
            continue
        if kind == "counter" or kind.endswith(("_sum", "_count", "_total")) or (
                kind == "untyped" and _family(series).endswith("_total")):
            counters[series] = v - before.get(series, 0.0)
        elif kind == "gauge" or kind == "untyped":
            gauges[series] = v
    return {"counters_delta": counters, "gauges_after": gauges}


async def scrape(client: httpx.AsyncClient, url: str) -> tuple[dict[str, float],
                                                               dict[str, str]] | str:
    """The parsed metrics at ``url``, or why there are none."""
    try:
        r = await client.get(url, timeout=10.0)
    except (httpx.TransportError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]
    if r.status_code != 200:
        return f"HTTP {r.status_code}"
    try:
        return parse(r.text)
    except ValueError as exc:
        return str(exc)


def report(url: str | None, before: Any, after: Any) -> dict[str, Any]:
    if url is None:
        return {"available": False, "reason": "off (--metrics-url none)"}
    for x in (before, after):
        if isinstance(x, str):
            return {"available": False, "url": url, "reason": x}
    return {"available": True, "url": url, **difference(before[0], after[0],
                                                        {**before[1], **after[1]})}
