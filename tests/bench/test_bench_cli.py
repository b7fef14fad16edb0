"""``python -m bench``'s command line: an unknown target is an error naming the valid ones,
``--help`` lists the targets and the serve command, and a run writes nothing into the
repository unless asked (``--results-dir``, ``--record``)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import __main__ as B
from bench import report as R
from bench import targets as T

ROOT = Path(__file__).resolve().parents[2]


def _tree_digest() -> dict[str, str]:
    """What a run could touch in the checkout: RESULTS.md, the SVGs beside it, bench/out/."""
    files = [*sorted((ROOT / "bench").glob("*.svg")), ROOT / "bench" / "RESULTS.md"]
    digest = {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    out = ROOT / "bench" / "out"
    digest["out"] = ",".join(sorted(p.name for p in out.iterdir())) if out.exists() else ""
    return digest


@pytest.mark.parametrize("target", ["http://127.0.0.1:8001/v1", "vllm", "hypercorn-wx"])
def test_an_unknown_target_exits_2_naming_the_valid_ones(target: str) -> None:
    r = subprocess.run([sys.executable, "-m", "bench", "relay", "--targets",
                        f"direct,{target}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert f"unknown target {target!r}" in r.stderr
    assert "valid targets: direct, sieproxy, nginx, litellm, " in r.stderr
    assert ("bench serve --base-url" in r.stderr) == ("://" in target)


def test_known_targets_parse() -> None:
    a = B.build_parser().parse_args(["latency", "--targets",
                                     "direct,sieproxy@HEAD~1,hypercorn-w2,trio-pipe"])
    assert a.targets == ["direct", "sieproxy@HEAD~1", "hypercorn-w2", "trio-pipe"]


def test_help_lists_the_targets_and_the_serve_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        B.build_parser().parse_args(["relay", "--help"])
    assert exc.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # wrapped lines may break at a hyphen
    for name in ("direct", "sieproxy", "nginx", "litellm", *T.FLOORS, "sieproxy@REV",
                 "hypercorn-wK", "--record", "--results-dir"):
        assert name in text
    with pytest.raises(SystemExit):
        B.build_parser().parse_args(["--help"])
    top = capsys.readouterr().out
    assert "serve" in top and "--base-url" in top
    with pytest.raises(SystemExit):
        B.build_parser().parse_args(["serve", "--help"])
    serve = capsys.readouterr().out
    for flag in ("--endpoint", "--api-key", "--ca-file", "--insecure", "--dataset", "--trace",
                 "--dataset-turns", "--request-rate", "--burstiness", "--slo", "--metrics-url",
                 "--tokenizer"):
        assert flag in serve


def test_a_default_run_writes_nothing(tmp_path: Path) -> None:
    before = _tree_digest()
    r = subprocess.run([sys.executable, "-m", "bench", "fleet", "--conversations", "12",
                        "--replicas", "2", "--sessions", "3"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "## fleet" in r.stdout and "raw results" not in r.stderr
    assert _tree_digest() == before


def test_results_dir_and_record_say_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "res"
    assert B.main(["fleet", "--conversations", "12", "--replicas", "2", "--sessions", "3",
                   "--results-dir", str(out)]) == 0
    (raw,) = out.glob("*-fleet.json")
    assert json.loads(raw.read_text())["meta"]["params"]["conversations"] == 12
    a = B.build_parser().parse_args(["latency"])
    assert B._plot(a, "x.svg") is None and B._out_dir(a) is None
    a = B.build_parser().parse_args(["latency", "--results-dir", str(out)])
    assert B._plot(a, "x.svg") == out / "x.svg" and B._out_dir(a) == out
    a = B.build_parser().parse_args(["latency", "--record"])
    assert B._plot(a, "x.svg") == B.BENCH_DIR / "x.svg" and B._out_dir(a) == T.OUT
    # --record rewrites this subcommand's section of RESULTS.md (here a copy)
    monkeypatch.setattr(R, "RESULTS", tmp_path / "RESULTS.md")
    monkeypatch.setattr(T, "OUT", tmp_path / "out")
    assert B.main(["fleet", "--conversations", "12", "--replicas", "2", "--sessions", "3",
                   "--record"]) == 0
    assert "<!-- bench:fleet:begin -->" in R.RESULTS.read_text()
    assert list((tmp_path / "out").glob("*-fleet.json"))
