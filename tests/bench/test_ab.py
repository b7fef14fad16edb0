"""The A/B target of the bench (``sieproxy@REV``): another build of the gateway, run beside this
one in the same invocation. It must run the files of that revision (not the working tree's),
serve like the gateway, and get its own ratio columns; otherwise an A/B in one run would compare
a build with itself."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from bench import report as R
from bench.targets import ROOT, Target, source_tree, start_target
from tests.bench.test_native_harness import Raw, _data, _post, engine, exe

__all__ = ["engine", "exe"]  # fixtures, used by name


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture(scope="module")
def head_tree() -> Iterator[os.PathLike[str]]:
    try:
        _git("rev-parse", "--verify", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no revision to build")
    yield source_tree("HEAD")


def test_a_revisions_tree_holds_that_revisions_files(head_tree: os.PathLike[str]) -> None:
    tree = os.fspath(head_tree)
    sha = _git("rev-parse", "HEAD").strip()
    assert os.path.basename(tree) == sha[:12]
    for path in ("sieproxy/front/app.py", "sieproxy/core/shaping/merger.py", "pyproject.toml"):
        with open(os.path.join(tree, path)) as f:
            assert f.read() == _git("show", f"HEAD:{path}"), path
    stamp = os.stat(os.path.join(tree, "sieproxy", "__init__.py")).st_mtime_ns
    assert os.fspath(source_tree(sha)) == tree  # unpacked once, found again by its sha
    assert os.stat(os.path.join(tree, "sieproxy", "__init__.py")).st_mtime_ns == stamp


def test_an_ab_target_runs_that_build(head_tree: os.PathLike[str], engine: int) -> None:
    t: Target = start_target("sieproxy@HEAD", engine, None)
    try:
        assert t.name == "sieproxy@HEAD"
        (pid,) = t.pids
        assert os.readlink(f"/proc/{pid}/cwd") == os.fspath(head_tree)
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert env[b"PYTHONPATH"] == os.fsencode(head_tree)
        c = Raw(t.port)
        try:
            chat = {"model": "bench-model", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True, "max_tokens": 4}
            c.send(_post("/v1/chat/completions", chat))
            status, _ = c.head()
            assert status == 200
            events = c.events()
        finally:
            c.close()
        assert events[-1] == b"data: [DONE]"
        assert _data(events[0])["choices"][0]["delta"]["role"] == "assistant"
    finally:
        t.stop()


def _run(target: str, repeat: int, cpu: float, ttft: float) -> dict[str, object]:
    return {"n": 1, "concurrency": 256, "itl_ms": 20.0, "repeat": repeat, "target": target,
            "sut_cpu_us_per_chunk": cpu, "ttft_ms": {"p50": ttft}, "chunks_per_s": 100.0,
            "all_first_ms": {}}


def test_the_ratio_table_compares_the_two_builds_round_by_round() -> None:
    runs = [_run("direct", 0, 0.0, 0.5), _run("sieproxy", 0, 40.0, 1.5),
            _run("sieproxy@abc", 0, 50.0, 1.7),
            _run("direct", 1, 0.0, 0.6), _run("sieproxy", 1, 60.0, 1.6),
            _run("sieproxy@abc", 1, 50.0, 1.8)]
    ratios = R.pair_ratios(runs)[(1, 256, 20.0)]
    assert ratios["cpu_sieproxy_over_sieproxy@abc"] == pytest.approx((0.8 + 1.2) / 2)
    assert ratios["added_ttft_p50_sieproxy@abc"] == pytest.approx((1.2 + 1.2) / 2)
    table = R.ratio_table({(1, 256, 20.0): ratios})
    # The median of the rounds' ratios, and their range: 0.8 in one round, 1.2 in the other.
    assert "CPU/chunk sieproxy ÷ sieproxy@abc (per-round range)" in table
    assert "| 1.000 (0.800–1.200) |" in table
    assert "added TTFT p50 sieproxy@abc ms" in table
