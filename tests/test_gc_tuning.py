"""The serving entry points tune the garbage collector (``sieproxy.operations.serve.tune_gc``);
building the app alone does not (an embedding host keeps its own collector settings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = (
    "import gc, json; {setup}; "
    "print(json.dumps([list(gc.get_threshold()), gc.get_freeze_count()]))"
)


def probe(setup: str, tmp_path: Path) -> tuple[list[int], int]:
    cfg = tmp_path / "gw.toml"
    cfg.write_text('[models.m]\nengines = ["http://127.0.0.1:9"]\nchat_template = "x"\n')
    env = {**os.environ, "SIEPROXY_CONFIG": str(cfg), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(setup=setup)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    ).stdout
    thresholds, frozen = json.loads(out.strip().splitlines()[-1])
    return thresholds, frozen


def test_asgi_entry_point_tunes_gc(tmp_path: Path) -> None:
    from sieproxy.operations.serve import GC_THRESHOLDS

    thresholds, frozen = probe("import sieproxy.asgi", tmp_path)
    assert tuple(thresholds) == GC_THRESHOLDS
    assert frozen > 10_000  # the imported libraries and the built app are frozen


def test_build_app_alone_leaves_gc_alone(tmp_path: Path) -> None:
    setup = (
        "from sieproxy.settings.load import load_settings; "
        "from sieproxy.operations.serve import build_app; "
        "build_app(load_settings())"
    )
    thresholds, frozen = probe(setup, tmp_path)
    assert thresholds[0] == 700 and frozen == 0
