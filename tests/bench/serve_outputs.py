"""Shared by the tests that run ``python -m bench serve`` as a subprocess (tests/bench/ against
the fake engine, tests/e2e/ against the gateway on the real model and llama.cpp's server): the
run itself, and the check that what it wrote (table, JSON, JSONL, plots, HTML) exists and
agrees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.serve.metrics import RequestRecord, figures
from bench.serve.output import LATENCIES, STATS, num

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
#: What every run with ``--results-dir`` writes; a sweep (several points) adds ``SWEEP``.
FILES = {"summary.txt", "results.json", "requests.jsonl", "report.html", "cdf-ttft.svg",
         "cdf-tpot.svg", "cdf-itl.svg", "cdf-e2e.svg"}
SWEEP = {"sweep-throughput.svg", "sweep-latency.svg"}


def serve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m bench serve ARGS`` in a subprocess, from the checkout."""
    return subprocess.run([sys.executable, "-m", "bench", "serve", *args], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def records(path: Path) -> dict[str, list[RequestRecord]]:
    """A ``requests.jsonl``'s records by point label."""
    out: dict[str, list[RequestRecord]] = {}
    fields = RequestRecord.__dataclass_fields__
    for line in path.read_text().splitlines():
        d = json.loads(line)
        out.setdefault(d["point"], []).append(RequestRecord(**{k: d[k] for k in fields}))
    return out


def same(a: Any, b: Any) -> None:
    """Equal, floats to 1e-9 relative, through nested dicts and lists."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == pytest.approx(b, rel=1e-9)


def check_outputs(out: Path, stdout: str, slos: dict[str, float] | None = None
                  ) -> tuple[dict[str, Any], dict[str, list[RequestRecord]]]:
    """Every output of a run into ``out`` exists and agrees with the others: the table on
    stdout is ``summary.txt``; each point's figures in ``results.json`` are those recomputed
    from ``requests.jsonl``'s records (under ``slos``, the run's ``--slo``s); the table and
    ``report.html`` print them; the plots are inline in the HTML. Returns the JSON document and
    the records by point."""
    doc = json.loads((out / "results.json").read_text())
    points = doc["points"]
    assert {p.name for p in out.iterdir()} == FILES | (SWEEP if len(points) > 1 else set())
    assert (out / "summary.txt").read_text() == stdout
    recs = records(out / "requests.jsonl")
    assert sorted(recs) == sorted(p["label"] for p in points)
    html = (out / "report.html").read_text()
    assert html.count("<svg") == 4 + (2 if len(points) > 1 else 0)
    assert "<script" not in html and "src=" not in html  # self-contained
    for p in points:
        f = p["figures"]
        assert f["requests"] == len(recs[p["label"]])
        same(json.loads(json.dumps(figures(recs[p["label"]], slos or {}))), f)
        block = stdout.split(f"== {p['label']} ==", 1)[1].split("==", 1)[0]
        assert f"request throughput (/s)   {num(f['request_throughput'])}" in block
        assert f"output tokens (/s)        {num(f['output_token_throughput'])}" in block
        for key, name in LATENCIES:
            row = next(ln for ln in block.splitlines() if ln.startswith(name + " "))
            assert row.split()[1:] == [num(f[key].get(q)) for q in STATS] + [
                str(f[key]["count"])]
            assert all(f"<td>{num(f[key][q])}</td>" in html for q in STATS)
    return doc, recs
