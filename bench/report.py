"""Summaries, ratios, target verdicts, SVG plots, and the merge into bench/RESULTS.md.

Each subcommand owns one section of RESULTS.md, between ``<!-- bench:NAME:begin -->`` and
``<!-- bench:NAME:end -->``; a re-run replaces its section and leaves the others. Each section
embeds its target verdicts as a JSON comment (``<!-- targets: [...] -->``), from which the
"Targets" table at the top of the file is rebuilt on every write.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
COLORS = {
    "direct": "#4d4d4d", "sieproxy": "#1f77b4", "sieproxy2": "#17becf", "nginx": "#2ca02c",
    "litellm": "#d62728", "hypercorn-w1": "#1f77b4", "hypercorn-w2": "#17becf",
    "hypercorn-relay": "#9467bd", "trio-pipe": "#8c564b", "trio-pipe-streams": "#e377c2",
    "trio-pump": "#bcbd22",
}
#: Ratios of CPU per chunk between two targets of the same run (numerator, denominator): the
#: gateway against its peers, and against the floors of its own stack (bench/targets.FLOORS).
#: Colours of the series no name in COLORS fits (a sweep's load points), in turn.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]
CPU_PAIRS = [("sieproxy", "nginx"), ("litellm", "sieproxy"), ("sieproxy", "hypercorn-relay"),
             ("trio-pipe", "nginx"), ("trio-pump", "nginx")]


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{nd}f}"
    return str(x)


def p(run: dict[str, Any], key: str, q: str) -> float | None:
    d = run.get(key) or {}
    return d.get(q)


def nerr(run: dict[str, Any]) -> int:
    return sum((run.get("errors") or {}).values()) if "error" not in run else -1


def scen_key(run: dict[str, Any]) -> tuple:
    return (run["n"], run["concurrency"], run["itl_ms"])


def relay_table(runs: list[dict[str, Any]], order: list[str]) -> str:
    """One row per (scenario, target): medians over repeats."""
    rows = [
        "| n | clients | ITL ms | target | TTFT p50 / p90 / p99 ms | all-n-first p50 ms "
        "| gap p50 / p99 ms | chunks/s | req/s | errors | SUT CPU µs/chunk "
        "| engine µs/chunk | loadgen µs/chunk | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, dict[str, list[dict[str, Any]]]] = {}
    for r in runs:
        groups.setdefault(scen_key(r), {}).setdefault(r["target"], []).append(r)
    for key in sorted(groups):
        for t in order:
            rs = [r for r in groups[key].get(t, []) if "error" not in r]
            if not rs:
                if groups[key].get(t):
                    rows.append(f"| {key[0]} | {key[1]} | {fmt(key[2])} | {t} | run failed: "
                                f"{groups[key][t][0]['error'][:80]!r} |||||||||")
                continue

            def m(f, rs=rs):
                return med([f(r) for r in rs])

            ttft = " / ".join(fmt(m(lambda r, q=q: p(r, "ttft_ms", q)), 2)
                              for q in ("p50", "p90", "p99"))
            gap = " / ".join(fmt(m(lambda r, q=q: p(r, "gap_ms", q)), 1) for q in ("p50", "p99"))
            rss = m(lambda r: r.get("sut_rss_peak") or None)
            rows.append(
                f"| {key[0]} | {key[1]} | {fmt(key[2])} | {t} | {ttft} "
                f"| {fmt(m(lambda r: p(r, 'all_first_ms', 'p50')), 2)} | {gap} "
                f"| {fmt(m(lambda r: r['chunks_per_s']), 0)} "
                f"| {fmt(m(lambda r: r['requests_per_s']), 1)} "
                f"| {sum(nerr(r) for r in rs)} "
                f"| {fmt(m(lambda r: r.get('sut_cpu_us_per_chunk')), 1)} "
                f"| {fmt(m(lambda r: r.get('engine_cpu_us_per_chunk')), 1)} "
                f"| {fmt(m(lambda r: r.get('loadgen_cpu_us_per_chunk')), 1)} "
                f"| {fmt(rss / 2**20 if rss else None, 0)} |"
            )
    return "\n".join(rows)


def pair_ratios(runs: list[dict[str, Any]]) -> dict[tuple, dict[str, float | None]]:
    """Per scenario: medians over repeats of ratios computed within each repeat."""
    by: dict[tuple, dict[int, dict[str, dict[str, Any]]]] = {}
    for r in runs:
        if "error" in r:
            continue
        by.setdefault(scen_key(r), {}).setdefault(r["repeat"], {})[r["target"]] = r
    out: dict[tuple, dict[str, float | None]] = {}
    for key, reps in by.items():
        acc: dict[str, list[float]] = {}

        def add(name: str, v: float | None, acc=acc) -> None:
            if v is not None:
                acc.setdefault(name, []).append(v)

        for tg in reps.values():
            d = tg.get("direct")
            cpu = {k: v.get("sut_cpu_us_per_chunk") for k, v in tg.items()}
            builds = [t for t in tg if t.startswith("sieproxy@")]  # A/B: other builds
            for a, b in CPU_PAIRS + [("sieproxy", t) for t in builds]:
                if cpu.get(a) and cpu.get(b):
                    add(f"cpu_{a}_over_{b}", cpu[a] / cpu[b])
            for t in ("sieproxy", "nginx", "litellm", "hypercorn-relay", "trio-pipe", *builds):
                r = tg.get(t)
                if r and d and p(r, "ttft_ms", "p50") is not None and p(d, "ttft_ms", "p50"):
                    add(f"added_ttft_p50_{t}", p(r, "ttft_ms", "p50") - p(d, "ttft_ms", "p50"))
                if r and d and p(r, "all_first_ms", "p50") and p(d, "all_first_ms", "p50"):
                    add(f"fanout_{t}_over_direct",
                        p(r, "all_first_ms", "p50") / p(d, "all_first_ms", "p50"))
                if r and d and d["chunks_per_s"]:
                    add(f"throughput_{t}_over_direct", r["chunks_per_s"] / d["chunks_per_s"])
        out[key] = {k: med(v) for k, v in acc.items()}
        for k, v in acc.items():  # the spread of the per-round ratios (see ``ratio_table``)
            out[key][f"{k}:min"], out[key][f"{k}:max"] = min(v), max(v)
        out[key]["pairs"] = len(reps)
    return out


def ratio_table(ratios: dict[tuple, dict[str, float | None]]) -> str:
    cols = [
        ("cpu_sieproxy_over_nginx", "CPU/chunk sieproxy ÷ nginx", 2),
        ("cpu_litellm_over_sieproxy", "CPU/chunk LiteLLM ÷ sieproxy", 1),
        ("cpu_sieproxy_over_hypercorn-relay", "CPU/chunk sieproxy ÷ hypercorn-relay", 2),
        ("cpu_trio-pipe_over_nginx", "CPU/chunk trio-pipe ÷ nginx", 2),
        ("cpu_trio-pump_over_nginx", "CPU/chunk trio-pump ÷ nginx", 2),
        ("added_ttft_p50_sieproxy", "added TTFT p50 sieproxy ms", 2),
        ("added_ttft_p50_nginx", "added TTFT p50 nginx ms", 2),
        ("added_ttft_p50_litellm", "added TTFT p50 LiteLLM ms", 2),
        ("added_ttft_p50_hypercorn-relay", "added TTFT p50 hypercorn-relay ms", 2),
        ("added_ttft_p50_trio-pipe", "added TTFT p50 trio-pipe ms", 2),
        ("fanout_sieproxy_over_direct", "all-n-first sieproxy ÷ direct", 2),
        ("throughput_sieproxy_over_direct", "chunks/s sieproxy ÷ direct", 2),
        ("throughput_nginx_over_direct", "chunks/s nginx ÷ direct", 2),
        ("throughput_litellm_over_direct", "chunks/s LiteLLM ÷ direct", 2),
    ]
    builds = sorted({k[len("cpu_sieproxy_over_"):] for r in ratios.values() for k in r
                     if k.startswith("cpu_sieproxy_over_sieproxy@") and ":" not in k})
    for t in builds:  # an A/B of two builds of the gateway (``--targets sieproxy,sieproxy@REV``)
        # Its CPU ratio with the range of the per-round ratios: a difference smaller than that
        # spread is not resolved by the run (docs/BENCH-METHOD.md).
        cols += [(f"cpu_sieproxy_over_{t}", f"CPU/chunk sieproxy ÷ {t} (per-round range)", 3),
                 (f"added_ttft_p50_{t}", f"added TTFT p50 {t} ms", 2),
                 (f"throughput_{t}_over_direct", f"chunks/s {t} ÷ direct", 2)]
    used = [c for c in cols if any(r.get(c[0]) is not None for r in ratios.values())]
    if not used:
        return "(no pairs to compare)"
    rows = ["| n | clients | ITL ms | pairs | " + " | ".join(c[1] for c in used) + " |",
            "|---" * (4 + len(used)) + "|"]
    for key in sorted(ratios):
        r = ratios[key]
        rows.append(f"| {key[0]} | {key[1]} | {fmt(key[2])} | {r['pairs']} | "
                    + " | ".join(_ratio_cell(r, c[0], c[2]) for c in used)
                    + " |")
    return "\n".join(rows)


def _ratio_cell(r: dict[str, float | None], k: str, digits: int) -> str:
    """A ratio; an A/B build comparison's CPU ratio with its per-round range."""
    cell = fmt(r.get(k), digits)
    lo, hi = r.get(f"{k}:min"), r.get(f"{k}:max")
    ab = k.startswith("cpu_sieproxy_over_sieproxy@")
    if ab and lo is not None and hi is not None and (r.get("pairs") or 0) > 1:
        cell += f" ({fmt(lo, digits)}–{fmt(hi, digits)})"
    return cell


# ---- verdicts -----------------------------------------------------------------------------------


def verdict(name: str, ok: bool | None, figure: str) -> dict[str, Any]:
    return {"target": name, "met": ok, "figure": figure}


def targets_table(entries: list[dict[str, Any]]) -> str:
    rows = ["| target | met? | figure |", "|---|---|---|"]
    for e in entries:
        m = {True: "**met**", False: "**not met**", None: "not measured"}[e["met"]]
        rows.append(f"| {e['target']} | {m} | {e['figure']} |")
    return "\n".join(rows)


# ---- SVG plots ----------------------------------------------------------------------------------


def _svg(w: int, h: int, body: list[str], title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'font-family="sans-serif" font-size="11">'
        f'<rect width="{w}" height="{h}" fill="white"/>'
        f'<text x="{w / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>'
        + "".join(body) + "</svg>"
    )


def _color(name: str, i: int) -> str:
    return COLORS.get(name, PALETTE[i % len(PALETTE)])


def cdf_svg(series: dict[str, list[float]], title: str, xlabel: str, path: Path | None) -> None:
    """Empirical CDFs on a log x axis (nothing is drawn without a ``path``)."""
    import math

    series = {k: sorted(v) for k, v in series.items() if v}
    if not series or path is None:
        return
    w, h, lm, r, t, b = 640, 380, 55, 130, 30, 45
    allv = [x for v in series.values() for x in v if x > 0]
    lo = 10 ** math.floor(math.log10(max(min(allv), 1e-3)))
    hi = 10 ** math.ceil(math.log10(max(allv)))

    def X(v: float) -> float:
        v = max(v, lo)
        span = math.log10(hi) - math.log10(lo)
        return lm + (math.log10(v) - math.log10(lo)) / span * (w - lm - r)

    def Y(q: float) -> float:
        return t + (1 - q) * (h - t - b)

    body = [f'<line x1="{lm}" y1="{Y(0)}" x2="{w - r}" y2="{Y(0)}" stroke="black"/>',
            f'<line x1="{lm}" y1="{Y(0)}" x2="{lm}" y2="{Y(1)}" stroke="black"/>']
    d = lo
    while d <= hi * 1.001:
        body.append(f'<line x1="{X(d):.1f}" y1="{Y(0)}" x2="{X(d):.1f}" y2="{Y(1)}" '
                    f'stroke="#ddd"/><text x="{X(d):.1f}" y="{Y(0) + 14}" '
                    f'text-anchor="middle">{d:g}</text>')
        d *= 10
    for q in (0, 0.5, 0.9, 0.99, 1):
        body.append(f'<text x="{lm - 5}" y="{Y(q) + 4:.1f}" text-anchor="end">{q:g}</text>')
    body.append(f'<text x="{(lm + w - r) / 2}" y="{h - 8}" text-anchor="middle">{xlabel}</text>')
    for i, (name, v) in enumerate(series.items()):
        n = len(v)
        step = max(1, n // 400)
        pts = " ".join(f"{X(v[j]):.1f},{Y((j + 1) / n):.1f}" for j in range(0, n, step))
        pts += f" {X(v[-1]):.1f},{Y(1):.1f}"
        c = _color(name, i)
        body.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6" points="{pts}"/>')
        body.append(f'<rect x="{w - r + 10}" y="{t + 18 * i}" width="12" height="10" fill="{c}"/>'
                    f'<text x="{w - r + 26}" y="{t + 18 * i + 9}">{name} ({n})</text>')
    path.write_text(_svg(w, h, body, title))


def bars_svg(groups: list[tuple[str, dict[str, float]]], title: str, ylabel: str,
             path: Path | None, log: bool = True) -> None:
    """Grouped bars (one group per scenario, one bar per target), log y axis."""
    import math

    vals = [v for _, g in groups for v in g.values() if v]
    if not vals or path is None:
        return
    names: list[str] = []
    for _, g in groups:
        names += [k for k in g if k not in names]
    w, h, lm, r, t, b = max(640, 110 * len(groups) + 200), 380, 60, 130, 30, 70
    lo = 10 ** math.floor(math.log10(min(vals))) if log else 0
    hi = 10 ** math.ceil(math.log10(max(vals))) if log else max(vals) * 1.1

    def Y(v: float) -> float:
        if log:
            f = (math.log10(max(v, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        else:
            f = v / hi
        return t + (1 - f) * (h - t - b)

    body = [f'<line x1="{lm}" y1="{Y(lo if log else 0)}" x2="{w - r}" y2="{Y(lo if log else 0)}" '
            f'stroke="black"/>']
    d = lo if log else 0
    while log and d <= hi * 1.001:
        body.append(f'<line x1="{lm}" y1="{Y(d):.1f}" x2="{w - r}" y2="{Y(d):.1f}" stroke="#ddd"/>'
                    f'<text x="{lm - 5}" y="{Y(d) + 4:.1f}" text-anchor="end">{d:g}</text>')
        d *= 10
    body.append(f'<text x="14" y="{(t + h - b) / 2}" transform="rotate(-90 14 {(t + h - b) / 2})" '
                f'text-anchor="middle">{ylabel}</text>')
    gw = (w - lm - r) / len(groups)
    bw = gw * 0.8 / max(1, len(names))
    for gi, (label, g) in enumerate(groups):
        x0 = lm + gi * gw + gw * 0.1
        for ni, name in enumerate(names):
            v = g.get(name)
            if not v:
                continue
            x = x0 + ni * bw
            c = COLORS.get(name, "#9467bd")
            body.append(f'<rect x="{x:.1f}" y="{Y(v):.1f}" width="{bw - 2:.1f}" '
                        f'height="{Y(lo if log else 0) - Y(v):.1f}" fill="{c}"/>'
                        f'<text x="{x + bw / 2:.1f}" y="{Y(v) - 3:.1f}" text-anchor="middle" '
                        f'font-size="9">{v:.0f}</text>')
        body.append(f'<text x="{lm + gi * gw + gw / 2:.1f}" y="{h - b + 16}" '
                    f'text-anchor="middle">{label}</text>')
    for i, name in enumerate(names):
        c = COLORS.get(name, "#9467bd")
        body.append(f'<rect x="{w - r + 10}" y="{t + 18 * i}" width="12" height="10" fill="{c}"/>'
                    f'<text x="{w - r + 26}" y="{t + 18 * i + 9}">{name}</text>')
    path.write_text(_svg(w, h, body, title))


def line_svg(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str,
             ylabel: str, path: Path | None) -> None:
    pts_all = [p for v in series.values() for p in v]
    if not pts_all or path is None:
        return
    w, h, lm, r, t, b = 640, 340, 60, 130, 30, 45
    x1 = max(x for x, _ in pts_all) or 1
    y1 = max(y for _, y in pts_all) * 1.1 or 1

    def X(x: float) -> float:
        return lm + x / x1 * (w - lm - r)

    def Y(y: float) -> float:
        return t + (1 - y / y1) * (h - t - b)

    body = [f'<line x1="{lm}" y1="{Y(0)}" x2="{w - r}" y2="{Y(0)}" stroke="black"/>',
            f'<line x1="{lm}" y1="{Y(0)}" x2="{lm}" y2="{t}" stroke="black"/>',
            f'<text x="{(lm + w - r) / 2}" y="{h - 8}" text-anchor="middle">{xlabel}</text>',
            f'<text x="14" y="{(t + h - b) / 2}" transform="rotate(-90 14 {(t + h - b) / 2})" '
            f'text-anchor="middle">{ylabel}</text>']
    for k in range(5):
        yv = y1 * k / 4
        body.append(f'<text x="{lm - 5}" y="{Y(yv) + 4:.1f}" text-anchor="end">{yv:.0f}</text>')
        xv = x1 * k / 4
        body.append(f'<text x="{X(xv):.1f}" y="{Y(0) + 14}" text-anchor="middle">{xv:.0f}</text>')
    for i, (name, v) in enumerate(series.items()):
        c = _color(name, i)
        pts = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in v)
        body.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6" points="{pts}"/>'
                    f'<rect x="{w - r + 10}" y="{t + 18 * i}" width="12" height="10" fill="{c}"/>'
                    f'<text x="{w - r + 26}" y="{t + 18 * i + 9}">{name}</text>')
    path.write_text(_svg(w, h, body, title))


# ---- RESULTS.md ---------------------------------------------------------------------------------

_HEADER = """# sieproxy benchmark results

Produced by `python -m bench …` (see [docs/BENCH-METHOD.md](../docs/BENCH-METHOD.md) for the
method: what a chunk is, how CPU per chunk is read from the OS, CPU pinning, and why every
ratio is computed between runs of the same invocation). Each section below is rewritten by the
subcommand named in its heading; the targets table is rebuilt from the sections' verdicts.

These are benchmark results from one 2-core machine, not timed unit tests.
"""


def write_section(name: str, markdown: str, verdicts: list[dict[str, Any]]) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else ""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    block = f"{begin}\n<!-- targets: {json.dumps(verdicts)} -->\n{markdown.strip()}\n{end}"
    found = {m.group(1): m.group(0) for m in re.finditer(
        r"<!-- bench:(\w+):begin -->.*?<!-- bench:\1:end -->", text, flags=re.S)}
    found[name] = block
    order = ["notes", "relay", "latency", "short", "burst", "disconnect", "streams", "soak",
             "workers"]
    names = [n for n in order if n in found] + sorted(n for n in found if n not in order)
    allv: list[dict[str, Any]] = []
    for n in names:
        m = re.search(r"<!-- targets: (.*?) -->", found[n])
        if m:
            allv += json.loads(m.group(1))
    out = [_HEADER, "## Targets (latest verdict of each)\n", targets_table(allv), ""]
    out += [found[n] + "\n" for n in names]
    RESULTS.write_text("\n".join(out))
