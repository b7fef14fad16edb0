"""``python -m bench streams``: the issue's "1,000 open streams at 50 ms" figure has its own
subcommand and its own row in the targets table — judged from the gateway's runs at that
scenario only, never from a smaller run, and never twice."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import __main__ as B
from bench import report as R

ROOT = Path(__file__).resolve().parents[2]


def _run(target: str = "sieproxy", clients: int = 1000, itl: float = 50.0, gap99: float = 80.0,
         errors: int = 0, cps: float = 20_000.0, failed: bool = False) -> dict[str, Any]:
    r: dict[str, Any] = {"target": target, "n": 1, "concurrency": clients, "itl_ms": itl,
                         "gap_ms": {"p50": 50.0, "p99": gap99}, "errors": {"http": errors},
                         "chunks_per_s": cps}
    if failed:
        r["error"] = "the target exited"
    return r


def test_met_only_with_no_errors_and_p99_gap_under_100_ms() -> None:
    v = B.streams_verdict([_run(gap99=99.0), _run("nginx", gap99=300.0)])
    assert v is not None and v["met"] is True
    assert "1,000 streams, 0 errors, p99 gap 99.0 ms" in v["figure"]
    assert "20,000 chunks/s relayed of 20,000 offered" in v["figure"]
    slow = B.streams_verdict([_run(gap99=100.0, cps=7_362.0)])
    assert slow is not None and slow["met"] is False
    assert "7,362 chunks/s relayed of 20,000 offered" in slow["figure"]
    erring = B.streams_verdict([_run(errors=3)])
    assert erring is not None and erring["met"] is False and "3 errors" in erring["figure"]


def test_medians_over_repeats_and_failed_runs() -> None:
    v = B.streams_verdict([_run(gap99=90.0), _run(gap99=95.0), _run(gap99=400.0)])
    assert v is not None and v["met"] is True and "p99 gap 95.0 ms" in v["figure"]
    dead = B.streams_verdict([_run(failed=True)])
    assert dead is not None and dead["met"] is False
    assert "run failed: the target exited" in dead["figure"]


def test_no_verdict_from_other_scenarios_or_targets() -> None:
    assert B.streams_verdict([_run(clients=999)]) is None
    assert B.streams_verdict([_run(itl=20.0)]) is None
    assert B.streams_verdict([_run("hypercorn-relay")]) is None
    # relay no longer judges this target: one row per target in the table
    assert all(v["target"] != B.STREAMS_TARGET for v in B.relay_verdicts([_run()], {}))


def test_streams_section_sits_before_soak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(R, "RESULTS", tmp_path / "RESULTS.md")
    R.write_section("soak", "## soak", [R.verdict("soak target", True, "fine")])
    R.write_section("streams", "## streams", [R.verdict(B.STREAMS_TARGET, False, "slow")])
    text = R.RESULTS.read_text()
    assert text.index("## streams") < text.index("## soak")
    table = text[text.index("| target | met? |"):text.index("<!-- bench:")]
    assert table.index(B.STREAMS_TARGET) < table.index("soak target")
    assert "| **not met** | slow |" in table


def test_small_run_end_to_end() -> None:
    """A small run of the real subcommand: the gateway and a floor side by side on the native
    harness, a table row each, no verdict from 8 streams, and RESULTS.md left alone."""
    before = hashlib.sha256((ROOT / "bench" / "RESULTS.md").read_bytes()).hexdigest()
    p = subprocess.run(
        [sys.executable, "-m", "bench", "streams", "--streams", "8", "--targets",
         "sieproxy,hypercorn-relay", "--duration", "1", "--warmup", "0.5", "--tokens", "20",
         "--no-results"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    assert "## streams" in out and "8 clients in a closed loop" in out
    relay_rows = [line.split(" | ") for line in out.splitlines()
                  if line.startswith("| 1 | 8 | 50.0 |") and line.count("|") == 15]
    rows = {cells[3]: cells for cells in relay_rows}
    assert set(rows) == {"sieproxy", "hypercorn-relay"}
    for cells in rows.values():
        assert cells[9] == "0"  # errors
        assert float(cells[7].replace(",", "")) > 0  # chunks/s
    assert "CPU/chunk sieproxy ÷ hypercorn-relay" in out
    assert f"| {B.STREAMS_TARGET} | not measured |" in out
    assert "this run: 8 at 50 ms" in out
    after = hashlib.sha256((ROOT / "bench" / "RESULTS.md").read_bytes()).hexdigest()
    assert after == before
