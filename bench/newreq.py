"""The cost of a new request: the summaries of ``python -m bench short`` and ``bench burst``.

* ``short``: clients in a closed loop, each sending requests for a very short response (2
  tokens, no inter-token delay by default), so that what the gateway spends is nearly all
  per-request work: CPU per request = the gateway process tree's CPU over the window (read
  from the OS, as for CPU per chunk) ÷ requests completed in it.
* ``burst``: many new streams at once (256 clients, each one request on a new connection),
  against a gateway that has served a burst before (a warm-up burst per target is not
  counted); added time to first token = a target's p50 (p99) − direct's, in the same round.

Every ratio is computed between the runs of one round (the targets alternate, the order
rotated each round) and the median over rounds is shown with the rounds' range, as for the
other subcommands (docs/BENCH-METHOD.md). The orchestration is in bench/__main__.py; this
module only turns the runs' results into figures, tables and verdicts.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bench import report as R

Run = dict[str, Any]


def cpu_per_request(run: Run) -> float | None:
    """The gateway's CPU per completed request in the window, µs (None: no gateway process,
    no completed request, or a failed run)."""
    if "error" in run or not run.get("sut_pids") or not run.get("window_completed"):
        return None
    return float(run["sut_cpu"]) / run["window_completed"] * 1e6


def ttft(run: Run, q: str) -> float | None:
    """The run's time to first token at percentile ``q`` ("p50", "p99"), ms."""
    if "error" in run:
        return None
    return R.p(run, "ttft_ms", q)


def _rounds(runs: list[Run]) -> dict[int, dict[str, Run]]:
    by: dict[int, dict[str, Run]] = {}
    for r in runs:
        by.setdefault(r["repeat"], {})[r["target"]] = r
    return dict(sorted(by.items()))


def pair_ratios(order: list[str], per_round: dict[int, dict[str, float | None]]
                ) -> list[dict[str, Any]]:
    """For each pair of targets (a listed before b): the per-round ratios a ÷ b of a figure,
    their median and range (rounds where either is missing or b is not positive are left
    out)."""
    out = []
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            xs = []
            for fig in per_round.values():
                va, vb = fig.get(a), fig.get(b)
                if va is not None and vb is not None and vb > 0:
                    xs.append(va / vb)
            if xs:
                out.append({"a": a, "b": b, "median": statistics.median(xs), "min": min(xs),
                            "max": max(xs), "rounds": xs})
    return out


def _figures(runs: list[Run], fn: Callable[[Run], float | None]
             ) -> dict[int, dict[str, float | None]]:
    return {k: {t: fn(r) for t, r in tg.items()} for k, tg in _rounds(runs).items()}


def _med(runs: list[Run], target: str, fn: Callable[[Run], float | None]) -> float | None:
    return R.med([v for r in runs if r["target"] == target and (v := fn(r)) is not None])


def _ratio_rows(pairs: list[dict[str, Any]], what: str, digits: int = 3) -> list[str]:
    rows = [f"| {what} | median of the rounds' ratios | range | rounds |", "|---|---|---|---|"]
    for x in pairs:
        rows.append(f"| `{x['a']}` ÷ `{x['b']}` | {x['median']:.{digits}f} | "
                    f"{x['min']:.{digits}f}–{x['max']:.{digits}f} | {len(x['rounds'])} |")
    return rows if pairs else ["(no pairs to compare)"]


def _find(pairs: list[dict[str, Any]], a: str, b: str) -> dict[str, Any] | None:
    return next((x for x in pairs if x["a"] == a and x["b"] == b), None)


# ---- short ----------------------------------------------------------------------------------


def short_summary(runs: list[Run], order: list[str]) -> dict[str, Any]:
    """The per-target medians and the pairwise within-round ratios of CPU per request."""
    rows = {}
    for t in order:
        mine = [r for r in runs if r["target"] == t]
        rows[t] = {
            "cpu_us_per_request": _med(mine, t, cpu_per_request),
            "requests_per_s": R.med([r["requests_per_s"] for r in mine if "error" not in r]),
            "errors": sum(R.nerr(r) for r in mine if "error" not in r),
            "failed": sum("error" in r for r in mine),
        }
    gateways = [t for t in order if any(cpu_per_request(r) for r in runs if r["target"] == t)]
    return {"rows": rows, "ratios": pair_ratios(gateways, _figures(runs, cpu_per_request))}


def short_markdown(s: dict[str, Any]) -> str:
    rows = ["| target | CPU per request (µs, median) | requests/s | errors | failed runs |",
            "|---|---|---|---|---|"]
    for t, x in s["rows"].items():
        rows.append(f"| `{t}` | {R.fmt(x['cpu_us_per_request'])} | "
                    f"{R.fmt(x['requests_per_s'], 0)} | {x['errors']} | {x['failed']} |")
    return "\n".join([*rows, "", "CPU per request, ratios within each round:", "",
                      *_ratio_rows(s["ratios"], "CPU per request")])


def short_verdicts(s: dict[str, Any], against: str, goal: float) -> list[dict[str, Any]]:
    name = f"CPU per short request ≤ {goal:g}× `{against}`'s (same run)"
    x = _find(s["ratios"], "sieproxy", f"sieproxy@{against}")
    if x is None:
        return [R.verdict(name, None, f"`sieproxy` and `sieproxy@{against}` not both measured")]
    mine = s["rows"]["sieproxy"]["cpu_us_per_request"]
    theirs = s["rows"][f"sieproxy@{against}"]["cpu_us_per_request"]
    return [R.verdict(name, x["median"] <= goal,
                      f"{x['median']:.3f}× (rounds {x['min']:.3f}–{x['max']:.3f}; "
                      f"{R.fmt(mine)} against {R.fmt(theirs)} µs)")]


# ---- burst ----------------------------------------------------------------------------------


def added(runs: list[Run], q: str) -> dict[int, dict[str, float | None]]:
    """Per round, each target's TTFT at ``q`` minus direct's in the same round, ms."""
    out: dict[int, dict[str, float | None]] = {}
    for k, tg in _rounds(runs).items():
        d = tg.get("direct")
        base = ttft(d, q) if d is not None else None
        out[k] = {t: (v - base if (v := ttft(r, q)) is not None and base is not None else None)
                  for t, r in tg.items() if t != "direct"}
    return out


def burst_summary(runs: list[Run], order: list[str]) -> dict[str, Any]:
    a50, a99 = added(runs, "p50"), added(runs, "p99")
    rows = {}
    for t in order:
        mine = [r for r in runs if r["target"] == t]

        def mid(fig: dict[int, dict[str, float | None]], t: str = t) -> float | None:
            return R.med([v for f in fig.values() if (v := f.get(t)) is not None])

        rows[t] = {
            "ttft_p50": _med(mine, t, lambda r: ttft(r, "p50")),
            "ttft_p99": _med(mine, t, lambda r: ttft(r, "p99")),
            "added_p50": mid(a50) if t != "direct" else None,
            "added_p99": mid(a99) if t != "direct" else None,
            "samples": R.med([r["ttft_ms"].get("count", 0) for r in mine if "error" not in r]),
            "errors": sum(R.nerr(r) for r in mine if "error" not in r),
            "failed": sum("error" in r for r in mine),
        }
    others = [t for t in order if t != "direct"]
    return {"rows": rows, "ratios": pair_ratios(others, a50),
            "ratios_p99": pair_ratios(others, a99)}


def burst_markdown(s: dict[str, Any]) -> str:
    rows = ["| target | TTFT p50 ms | TTFT p99 ms | added p50 ms | added p99 ms | "
            "first tokens timed per burst | errors | failed runs |",
            "|---|---|---|---|---|---|---|---|"]
    for t, x in s["rows"].items():
        rows.append(f"| `{t}` | {R.fmt(x['ttft_p50'])} | {R.fmt(x['ttft_p99'])} | "
                    f"{R.fmt(x['added_p50'])} | {R.fmt(x['added_p99'])} | "
                    f"{R.fmt(x['samples'], 0)} | {x['errors']} | {x['failed']} |")
    return "\n".join([*rows, "", "Added time to first token (p50), ratios within each round:", "",
                      *_ratio_rows(s["ratios"], "added TTFT p50", 2), "",
                      "Added time to first token (p99), ratios within each round:", "",
                      *_ratio_rows(s["ratios_p99"], "added TTFT p99", 2)])


def burst_verdicts(s: dict[str, Any], against: str, goal: float) -> list[dict[str, Any]]:
    name = f"burst of new streams: added TTFT p50 ≤ {goal:g}× `{against}`'s (same run)"
    x = _find(s["ratios"], "sieproxy", f"sieproxy@{against}")
    if x is None:
        return [R.verdict(name, None, f"`sieproxy` and `sieproxy@{against}` not both measured")]
    mine = s["rows"]["sieproxy"]["added_p50"]
    theirs = s["rows"][f"sieproxy@{against}"]["added_p50"]
    return [R.verdict(name, x["median"] <= goal,
                      f"{x['median']:.2f}× (rounds {x['min']:.2f}–{x['max']:.2f}; "
                      f"+{R.fmt(mine)} against +{R.fmt(theirs)} ms)")]
