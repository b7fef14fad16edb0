"""``python -m bench short`` and ``bench burst``: the cost of a new request. CPU per request is
the gateway's CPU over completed requests; added TTFT is a target's percentile minus direct's in
the same round; every ratio between two builds is computed within a round."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import newreq as NR

ROOT = Path(__file__).resolve().parents[2]


def _short(target: str, repeat: int, cpu_s: float, done: int = 1000) -> dict[str, Any]:
    return {"target": target, "repeat": repeat, "sut_pids": [1], "sut_cpu": cpu_s,
            "window_completed": done, "requests_per_s": done / 8, "errors": {}}


def test_cpu_per_request_is_the_windows_cpu_over_its_completed_requests() -> None:
    assert NR.cpu_per_request(_short("sieproxy", 0, 0.5, 1000)) == pytest.approx(500.0)
    assert NR.cpu_per_request({**_short("direct", 0, 0.0), "sut_pids": []}) is None
    assert NR.cpu_per_request(_short("sieproxy", 0, 0.5, 0)) is None
    assert NR.cpu_per_request({**_short("sieproxy", 0, 0.5), "error": "exited"}) is None


def test_short_ratios_are_taken_within_each_round() -> None:
    # Round 0 is a slow round for both builds; the ratio holds within each round.
    runs = [_short("sieproxy", 0, 0.6), _short("sieproxy@old", 0, 1.2),
            _short("sieproxy", 1, 0.2), _short("sieproxy@old", 1, 0.5),
            _short("sieproxy", 2, 0.3), _short("sieproxy@old", 2, 0.6)]
    s = NR.short_summary(runs, ["sieproxy", "sieproxy@old"])
    (x,) = s["ratios"]
    assert (x["a"], x["b"]) == ("sieproxy", "sieproxy@old")
    assert x["median"] == pytest.approx(0.5) and x["min"] == pytest.approx(0.4)
    assert x["max"] == pytest.approx(0.5)
    assert s["rows"]["sieproxy"]["cpu_us_per_request"] == pytest.approx(300.0)
    md = NR.short_markdown(s)
    assert "| `sieproxy` ÷ `sieproxy@old` | 0.500 | 0.400–0.500 | 3 |" in md
    (v,) = NR.short_verdicts(s, "old", 0.5)
    assert v["met"] is True and v["figure"].startswith("0.500× (rounds 0.400–0.500; 300.0")
    (none,) = NR.short_verdicts(s, "other", 0.5)
    assert none["met"] is None


def _burst(target: str, repeat: int, p50: float, p99: float) -> dict[str, Any]:
    return {"target": target, "repeat": repeat, "ttft_ms": {"p50": p50, "p99": p99,
                                                            "count": 256}, "errors": {}}


def test_burst_added_ttft_subtracts_direct_of_the_same_round() -> None:
    runs = [_burst("direct", 0, 10.0, 20.0), _burst("sieproxy", 0, 30.0, 60.0),
            _burst("sieproxy@old", 0, 50.0, 100.0),
            _burst("direct", 1, 40.0, 50.0), _burst("sieproxy", 1, 50.0, 70.0),
            _burst("sieproxy@old", 1, 60.0, 90.0)]
    assert NR.added(runs, "p50") == {0: {"sieproxy": 20.0, "sieproxy@old": 40.0},
                                     1: {"sieproxy": 10.0, "sieproxy@old": 20.0}}
    s = NR.burst_summary(runs, ["direct", "sieproxy", "sieproxy@old"])
    assert s["rows"]["sieproxy"]["added_p50"] == pytest.approx(15.0)
    assert s["rows"]["direct"]["added_p50"] is None
    (x,) = s["ratios"]
    assert x["median"] == pytest.approx(0.5) and len(x["rounds"]) == 2
    (y,) = s["ratios_p99"]
    assert y["rounds"] == [pytest.approx(40 / 80), pytest.approx(20 / 40)]
    (v,) = NR.burst_verdicts(s, "old", 0.5)
    assert v["met"] is True and "+15.0 against +30.0 ms" in v["figure"]


def test_a_round_without_direct_or_with_a_failed_run_gives_no_ratio() -> None:
    runs = [_burst("sieproxy", 0, 30.0, 60.0), _burst("sieproxy@old", 0, 50.0, 100.0),
            _burst("direct", 1, 10.0, 20.0), {**_burst("sieproxy", 1, 0, 0), "error": "x"},
            _burst("sieproxy@old", 1, 60.0, 90.0)]
    s = NR.burst_summary(runs, ["direct", "sieproxy", "sieproxy@old"])
    assert s["ratios"] == []
    assert s["rows"]["sieproxy"]["failed"] == 1
    (v,) = NR.burst_verdicts(s, "old", 0.5)
    assert v["met"] is None


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args, "--no-results", "--no-pin"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


def test_small_runs_end_to_end() -> None:
    """The real subcommands, small: the gateway against the fast engine, a row per target, a
    ratio between two targets of the run, and RESULTS.md left alone."""
    before = hashlib.sha256((ROOT / "bench" / "RESULTS.md").read_bytes()).hexdigest()
    p = _bench("short", "--targets", "sieproxy,sieproxy@HEAD", "--clients", "4", "--duration", "1",
               "--warmup", "0.5", "--repeat", "1")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "| `sieproxy` |" in p.stdout and "CPU per request" in p.stdout
    row = next(ln for ln in p.stdout.splitlines() if ln.startswith("| `sieproxy` |"))
    assert float(row.split("|")[2]) > 0  # µs per request, read from the OS
    assert "| `sieproxy` ÷ `sieproxy@HEAD` |" in p.stdout
    q = _bench("burst", "--targets", "direct,sieproxy", "--streams", "8", "--tokens", "5",
               "--itl-ms", "5", "--repeat", "1")
    assert q.returncode == 0, q.stderr[-2000:]
    row = next(ln for ln in q.stdout.splitlines() if ln.startswith("| `sieproxy` |"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[6] == "8" and cells[7] == "0"  # every stream's first token timed, no error
    after = hashlib.sha256((ROOT / "bench" / "RESULTS.md").read_bytes()).hexdigest()
    assert before == after
