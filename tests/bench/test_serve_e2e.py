"""``python -m bench serve`` end to end against the fake engine's OpenAI-compatible endpoints
(a real subprocess each): the table, JSON, JSONL, plots and HTML exist and agree; a trace is
replayed on its schedule."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bench.serve_outputs import ENV, ROOT, check_outputs, records, serve
from tests.procs import stop_process


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.fake", "--port", "0", "--ttft-ms", "10", "--itl-ms", "2"],
        stdout=subprocess.PIPE, env=ENV, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # printed once the engine listens
        assert "listening on http://" in line, line
        yield line.split("listening on ", 1)[1].strip()
    finally:
        stop_process(proc)


def test_a_sweep_writes_outputs_that_agree(engine_url: str, tmp_path: Path) -> None:
    out = tmp_path / "results"
    r = serve("--base-url", engine_url, "--model", "fake-model", "--concurrency", "1,3",
              "--num-requests", "12", "--input-len", "16", "--output-len", "8",
              "--warmup-requests", "2", "--slo", "ttft_ms=5000", "--slo", "tpot_ms=0.001",
              "--results-dir", str(out), "--progress", "on")
    assert r.returncode == 0, r.stderr
    assert "concurrency=1 [" in r.stderr  # the progress bar, forced on
    doc, _ = check_outputs(out, r.stdout, {"ttft_ms": 5000.0, "tpot_ms": 0.001})
    assert doc["config"]["args"]["concurrency"] == [1, 3]
    assert doc["config"]["url"] == engine_url + "/v1/chat/completions"
    points = doc["points"]
    assert [p["label"] for p in points] == ["concurrency=1", "concurrency=3"]
    for p in points:
        f = p["figures"]
        assert f["requests"] == f["completed"] == 12 and f["errors"] == {}
        assert f["output_tokens"] == 12 * 8 and f["tokens_counted_by"] == {"usage": 12}
        assert f["goodput"]["requests_met"] == 0  # nobody makes 1 µs per token
        assert f["itl_ms"]["count"] == 12 * 7
        assert p["server_metrics"] == {"available": False, "url": engine_url + "/metrics",
                                       "reason": "HTTP 404"}
    sweep = r.stdout.split("== sweep ==", 1)[1]
    assert sweep.count("concurrency=") == 2


def test_completions_with_a_rate_and_a_trace(engine_url: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    stamps = [0, 150, 300, 900, 1200]
    trace.write_text("\n".join(json.dumps({"timestamp": 5000 + t, "input_length": 20,
                                           "output_length": 4}) for t in stamps))
    r = serve("--base-url", engine_url + "/v1", "--model", "m", "--endpoint", "completions",
              "--trace", str(trace), "--results-dir", str(tmp_path / "t"))
    assert r.returncode == 0, r.stderr
    recs = records(tmp_path / "t" / "requests.jsonl")["trace"]
    assert sorted(x.scheduled_s for x in recs) == pytest.approx([t / 1000 for t in stamps])
    for x in recs:
        assert x.ok and x.output_tokens == 4
        assert x.start_s >= x.scheduled_s - 0.005  # never before its time (clock rounding)
    assert r.stderr == "" or "[" not in r.stderr  # no progress bar: stderr is not a terminal
    rate = serve("--base-url", engine_url, "--model", "m", "--request-rate", "40",
                 "--arrival", "gamma", "--burstiness", "0.5", "--duration", "1",
                 "--output-len", "uniform:2,6", "--workload", "shared-prefix",
                 "--prefix-count", "2", "--prefix-len", "30")
    assert rate.returncode == 0, rate.stderr
    assert "== rate=40/s ==" in rate.stdout and "0 failed" in rate.stdout


def test_a_sharegpt_file_replayed_whole_resends_each_conversations_history(
        engine_url: str, tmp_path: Path) -> None:
    talks = [[("human", "What is a socket?"), ("gpt", "w" * 24), ("human", "And a port?"),
              ("gpt", "w" * 12), ("human", "Thanks, bye."), ("gpt", "w" * 8)],
             [("human", "Hello there."), ("gpt", "w" * 16), ("human", "How are you today?"),
              ("gpt", "w" * 20)]]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": [{"from": who, "value": text}
                                                   for who, text in t]} for t in talks]))
    out = tmp_path / "sg"
    # one client: the two conversations one after the other, five requests in all
    r = serve("--base-url", engine_url, "--model", "m", "--dataset", str(path),
              "--dataset-turns", "all", "--num-requests", "5", "--results-dir", str(out))
    assert r.returncode == 0, r.stderr
    doc, recs = check_outputs(out, r.stdout)
    assert doc["config"]["workload"] == "dataset"
    assert doc["config"]["args"]["dataset_turns"] == "all"
    turns: dict[int, list[tuple[int, int, int]]] = {}
    for x in recs["concurrency=1"]:
        assert x.ok and x.input_tokens is not None and x.output_tokens is not None
        turns.setdefault(x.conversation, []).append((x.turn, x.input_tokens, x.output_tokens))
    got = [sorted(v) for _, v in sorted(turns.items())]
    # each turn asks for its recorded reply's length (4 characters a token)...
    assert [[o for _, _, o in c] for c in got] == [[6, 3, 2], [4, 5]]
    # ... and resends the history: the earlier turns, and the replies received to them
    for talk, conv in zip(talks, got, strict=True):
        asked = [text for who, text in talk if who == "human"]
        assert conv[0][1] == len(asked[0].split())  # the fake engine counts words
        for k in range(1, len(conv)):
            assert conv[k][1] > conv[k - 1][1] + len(asked[k].split())
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": 7}]}]))
    bad = serve("--base-url", engine_url, "--model", "m", "--dataset", str(path))
    assert bad.returncode == 2 and bad.stdout == ""
    assert f"error: --dataset {path}: entry 0, message 0: expected" in bad.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--concurrency", "2", "--request-rate", "1"], "not both"),
    (["--slo", "ttft=5"], "NAME one of"),
    (["--input-len", "uniform:9,3"], "bad length"),
    (["--dataset", "/nonexistent/d.jsonl"], "No such file"),
    (["--extra-body", "[1]"], "JSON object"),
    (["--header", "no colon"], "expected 'Name: value'"),
    (["--dataset-turns", "all"], "--dataset-turns all replays a ShareGPT --dataset (.json)"),
    (["--dataset", "d.jsonl", "--dataset-turns", "all"], "a JSONL record's messages"),
    (["--dataset-turns", "some"], "invalid choice: 'some'"),
])
def test_bad_command_lines_exit_with_a_reason(args: list[str], message: str) -> None:
    r = serve("--base-url", "http://127.0.0.1:9", "--model", "m", *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert r.stdout == ""


def test_the_gateway_in_front_of_the_fake_engine_and_its_metrics(tmp_path: Path) -> None:
    """Through the gateway (one ``sieproxy serve`` process, bench/targets.py's configuration):
    its Prometheus counters, scraped around the point, count exactly the requests sent."""
    from bench import targets as T

    eng = T.start_engine(10.0, 2.0, 8, None, True, "fake")
    try:
        gw = T.start_sieproxy(eng.port, None)
        try:
            r = serve("--base-url", f"http://127.0.0.1:{gw.port}/v1", "--model", "bench-model",
                      "--concurrency", "2", "--num-requests", "10", "--output-len", "8",
                      "--results-dir", str(tmp_path / "gw"))
        finally:
            gw.stop()
    finally:
        eng.stop()
    assert r.returncode == 0, r.stderr
    (point,) = json.loads((tmp_path / "gw" / "results.json").read_text())["points"]
    assert point["figures"]["completed"] == 10
    m = point["server_metrics"]
    assert m["available"] is True and m["url"] == f"http://127.0.0.1:{gw.port}/metrics"
    sent = {k: v for k, v in m["counters_delta"].items()
            if k.startswith("sieproxy_requests_total{") and 'status="200"' in k}
    assert sum(sent.values()) == 10
