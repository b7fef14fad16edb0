"""A serve run's outputs: the terminal table, JSON, per-request JSONL, SVG plots and one
self-contained HTML report.

Everything derives from the same :class:`Point` list (one per load point of the run, with its
records and :func:`bench.serve.metrics.figures`), so the table, the JSON and the HTML show the
same numbers, and the JSONL holds the records they were computed from. Nothing is written
unless a results directory is given. Plots reuse bench/report.py's SVG writers.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import report as R
from bench.serve.metrics import RequestRecord

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
STATS = ("mean", "p50", "p90", "p99")


@dataclass
class Point:
    """One load point: its label (``concurrency=4``), its load value, records and figures."""

    label: str
    x: float
    records: list[RequestRecord]
    figures: dict[str, Any]
    server_metrics: dict[str, Any]


def num(x: Any, nd: int = 2) -> str:
    """A figure as the table prints it (the test of agreement formats JSON values this way)."""
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{nd}f}"


def point_table(p: Point) -> str:
    f = p.figures
    lines = [f"== {p.label} ==",
             f"{'requests':<26}{f['requests']} ({f['completed']} completed, {f['failed']} "
             "failed)",
             f"{'duration (s)':<26}{num(f['duration_s'])}",
             f"{'request throughput (/s)':<26}{num(f['request_throughput'])}",
             f"{'output tokens (/s)':<26}{num(f['output_token_throughput'])}",
             f"{'total tokens (/s)':<26}{num(f['total_token_throughput'])}",
             f"{'tokens counted by':<26}"
             + (", ".join(f"{k} ({v})" for k, v in f["tokens_counted_by"].items()) or "-")]
    g = f["goodput"]
    if g["slos"]:
        slos = ", ".join(f"{k}<={v:g}" for k, v in g["slos"].items())
        lines.append(f"{'goodput (/s)':<26}{num(g['request_goodput'])} "
                     f"({g['requests_met']} of {f['requests']} met {slos})")
    if f["errors"]:
        lines.append(f"{'errors':<26}" + ", ".join(f"{k}: {v}" for k, v in f["errors"].items()))
    lines += ["", f"{'latency (ms)':<14}" + "".join(f"{s:>11}" for s in (*STATS, "count"))]
    for key, name in LATENCIES:
        s = f[key]
        lines.append(f"{name:<14}" + "".join(f"{num(s.get(q)):>11}" for q in STATS)
                     + f"{s['count']:>11}")
    return "\n".join(lines)


def sweep_table(points: list[Point]) -> str:
    head = (f"{'load':<18}{'req/s':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'TPOT p50':>10}{'ITL p50':>9}{'E2E p50':>10}{'E2E p99':>10}{'goodput/s':>11}"
            f"{'errors':>8}")
    rows = [head]
    for p in points:
        f = p.figures
        rows.append(f"{p.label:<18}{num(f['request_throughput']):>9}"
                    f"{num(f['output_token_throughput']):>11}"
                    f"{num(f['ttft_ms'].get('p50')):>10}{num(f['ttft_ms'].get('p99')):>10}"
                    f"{num(f['tpot_ms'].get('p50')):>10}{num(f['itl_ms'].get('p50')):>9}"
                    f"{num(f['e2e_ms'].get('p50')):>10}{num(f['e2e_ms'].get('p99')):>10}"
                    f"{num(f['goodput']['request_goodput']):>11}{f['failed']:>8}")
    return "\n".join(rows)


def terminal(points: list[Point]) -> str:
    parts = [point_table(p) for p in points]
    if len(points) > 1:
        parts.append("== sweep ==\n" + sweep_table(points))
    return "\n\n".join(parts) + "\n"


def document(config: dict[str, Any], points: list[Point]) -> dict[str, Any]:
    """The JSON output: the run's whole configuration and every figure of every point."""
    return {"config": config,
            "points": [{"label": p.label, "x": p.x, "figures": p.figures,
                        "server_metrics": p.server_metrics} for p in points]}


def plots(points: list[Point], out: Path, sweep_axis: str) -> list[str]:
    """Latency CDFs (one series per point) and, for a sweep, throughput and latency against
    the load; returns the file names written."""
    names = []
    for key, name in LATENCIES:
        series = {p.label: [v for r in p.records if r.ok
                            for v in (r.itl_ms if key == "itl_ms" else [getattr(r, key)])
                            if v is not None and v > 0] for p in points}
        if any(series.values()):
            R.cdf_svg(series, f"{name}: cumulative distribution", "ms (log)",
                      out / f"cdf-{key[:-3]}.svg")
            names.append(f"cdf-{key[:-3]}.svg")
    if len(points) > 1:
        xs = [p.x for p in points]
        R.line_svg({"output tok/s": [(x, p.figures["output_token_throughput"])
                                     for x, p in zip(xs, points, strict=True)],
                    "requests/s ×100": [(x, p.figures["request_throughput"] * 100)
                                        for x, p in zip(xs, points, strict=True)]},
                   f"Throughput against {sweep_axis}", sweep_axis, "per second",
                   out / "sweep-throughput.svg")
        lat = {}
        for key, name in (("ttft_ms", "TTFT p50"), ("e2e_ms", "E2E p50"),
                          ("tpot_ms", "TPOT p50")):
            pts = [(x, p.figures[key]["p50"]) for x, p in zip(xs, points, strict=True)
                   if "p50" in p.figures[key]]
            if pts:
                lat[name] = pts
        R.line_svg(lat, f"Latency against {sweep_axis}", sweep_axis, "ms",
                   out / "sweep-latency.svg")
        names += ["sweep-throughput.svg", "sweep-latency.svg"]
    return [n for n in names if (out / n).exists()]


def write(out: Path, config: dict[str, Any], points: list[Point], sweep_axis: str) -> list[Path]:
    """Write every output into ``out`` (created); returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    table = terminal(points)
    (out / "summary.txt").write_text(table)
    (out / "results.json").write_text(json.dumps(document(config, points), indent=1))
    with (out / "requests.jsonl").open("w") as f:
        for p in points:
            for r in p.records:
                f.write(json.dumps({"point": p.label, **r.as_json()}) + "\n")
    svgs = plots(points, out, sweep_axis)
    (out / "report.html").write_text(report_html(config, points, table, out, svgs))
    return [out / n for n in ("summary.txt", "results.json", "requests.jsonl", *svgs,
                              "report.html")]


def report_html(config: dict[str, Any], points: list[Point], table: str, out: Path,
                svgs: list[str]) -> str:
    """One HTML file with everything inline (tables, SVG plots, the configuration)."""
    esc = html.escape
    rows = []
    for p in points:
        f = p.figures
        cells = [p.label, num(f["request_throughput"]), num(f["output_token_throughput"])]
        for key, _ in LATENCIES:
            cells += [num(f[key].get(q)) for q in STATS]
        cells += [num(f["goodput"]["request_goodput"]), str(f["failed"])]
        rows.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>")
    head = ["load", "req/s", "out tok/s"] + [f"{n} {q}" for _, n in LATENCIES for q in STATS]
    head += ["goodput/s", "errors"]
    figs = "".join(f"<figure>{(out / s).read_text()}<figcaption>{esc(s)}</figcaption></figure>"
                   for s in svgs)
    errors = "".join(f"<li>{esc(p.label)}: {esc(json.dumps(p.figures['errors']))}</li>"
                     for p in points if p.figures["errors"])
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>bench serve report</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
        "figure{display:inline-block;margin:1em}pre{background:#f6f6f6;padding:1em}</style>"
        "</head><body><h1>bench serve: "
        f"{esc(str(config.get('model')))} at {esc(str(config.get('url')))}</h1>"
        "<h2>Figures (latencies in ms)</h2><table id='figures'><tr>"
        + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"
        + (f"<h2>Errors</h2><ul>{errors}</ul>" if errors else "")
        + f"<h2>Plots</h2>{figs}<h2>Terminal summary</h2><pre>{esc(table)}</pre>"
        f"<h2>Configuration</h2><pre>{esc(json.dumps(config, indent=1))}</pre>"
        "</body></html>\n"
    )
