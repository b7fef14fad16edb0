"""``python -m bench token-path``: the gateway's per-token code, counted in instructions. The
harness must run the real relay step on the real core (so that what it counts is what a
relayed token costs), and the command must count each build and divide correctly."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import trio

from bench import __main__ as bench_main
from bench import token_path as TP
from bench.targets import sieproxy_config


def _config(tmp_path: Path) -> str:
    return sieproxy_config(9, 9, str(tmp_path))


def test_the_harness_relays_every_token_as_the_gateway_frames_it(tmp_path: Path) -> None:
    got = trio.run(TP.relay, 1050, _config(tmp_path))
    assert got["tokens"] == got["writes"] == 1050
    # The last write is token 1049 (the engine's chunks cycle: 1049 % 1000 = 49) as the client
    # receives it: one HTTP/1.1 chunk holding one chat.completion.chunk event.
    size, _, rest = got["last"].partition("\r\n")
    event = rest.removesuffix("\r\n")
    assert int(size, 16) == len(event.encode()) and event.startswith("data: ")
    chunk = json.loads(event.removeprefix("data: ").removesuffix("\n\n"))
    assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == "bench-model"
    assert chunk["choices"] == [
        {"index": 0, "delta": {"content": " tok49"}, "logprobs": None, "finish_reason": None}
    ]
    assert got["bytes"] > 1050 * len(got["last"]) * 0.9


def _fake_valgrind(tmp_path: Path, per_token: int) -> None:
    """A ``valgrind`` on PATH that runs the command it is given and reports a count of
    ``1,000,000 + per_token × tokens`` instructions, as callgrind reports its total."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "valgrind"
    script.write_text(
        f"#!{sys.executable}\n"
        "import subprocess, sys\n"
        "cmd = [a for a in sys.argv[1:] if not a.startswith('--')]\n"
        "run = subprocess.run(cmd, check=True)\n"
        f"print(f'==1== Collected : {{1_000_000 + {per_token} * int(cmd[2])}}', "
        "file=sys.stderr)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ['PATH']}"


def test_the_command_divides_the_difference_of_two_runs_per_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", os.environ["PATH"])  # restored after the test
    _fake_valgrind(tmp_path, per_token=123)
    argv = ["token-path", "--tokens", "30,10", "--results-dir", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", ["bench", *argv])
    assert bench_main.main(argv) == 0
    out = capsys.readouterr().out
    assert "| sieproxy | 123 | 1.000 |" in out
    saved = json.loads(next((tmp_path / "out").glob("*-token-path.json")).read_text())
    assert saved["extra"]["per_token"] == {"sieproxy": 123.0}
    assert sorted(r["tokens"] for r in saved["runs"]) == [10, 30]


def test_a_run_that_does_not_relay_every_token_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", os.environ["PATH"])
    _fake_valgrind(tmp_path, per_token=1)
    with pytest.raises(RuntimeError, match="token-path run failed"):
        TP.instructions(5, str(tmp_path / "missing.toml"))


def test_interleaved_streams_each_get_their_turn_of_the_tokens(tmp_path: Path) -> None:
    got = trio.run(TP.relay, 301, _config(tmp_path), 3, True)
    assert got["tokens"] == got["writes"] == 301 and got["seconds"] > 0
    # Token 300 goes to stream 300 % 3 = 0 as that stream's 101st token (its engine's chunks
    # cycle from 0): " tok100", in stream 0's own response (request id "r").
    chunk = json.loads(got["last"].partition("\r\n")[2].removeprefix("data: ").split("\n")[0])
    assert chunk["id"] == "chatcmpl-r"
    assert chunk["choices"][0]["delta"] == {"content": " tok100"}
    got = trio.run(TP.relay, 302, _config(tmp_path), 3, True)
    chunk = json.loads(got["last"].partition("\r\n")[2].removeprefix("data: ").split("\n")[0])
    assert chunk["id"] == "chatcmpl-r1"  # token 301: stream 1, its 101st token
    assert chunk["choices"][0]["delta"] == {"content": " tok100"}


def test_the_streams_command_times_each_number_against_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[int] = []

    def timed(tokens: int, config: str, streams: int) -> float:  # 2 µs per token per stream
        calls.append(streams)
        return 2.0 * streams

    monkeypatch.setattr(TP, "interleaved", timed)
    argv = ["token-path", "--streams", "1,4", "--stream-tokens", "50", "--rounds", "2",
            "--results-dir", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", ["bench", *argv])
    assert bench_main.main(argv) == 0
    assert calls == [1, 4, 4, 1]  # alternating, the order rotated each round
    out = capsys.readouterr().out
    assert "| 1 | 2.00 | 1.00 | 1.00, 1.00 |" in out
    assert "| 4 | 8.00 | 4.00 | 4.00, 4.00 |" in out
    saved = json.loads(next((tmp_path / "out").glob("*-token-path-streams.json")).read_text())
    assert saved["extra"]["4"] == {"us_per_token": 8.0, "ratio": 4.0}
    assert len(saved["runs"]) == 4


def test_a_timed_run_reports_the_real_relay_step(tmp_path: Path) -> None:
    assert 0 < TP.interleaved(40, _config(tmp_path), 2) < 10_000
