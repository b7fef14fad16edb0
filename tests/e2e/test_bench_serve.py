"""``python -m bench serve`` (a subprocess, as a user runs it) against two real deployments of
the default model: the gateway in front of the CPU engine, and llama.cpp's server on the
model's GGUF. Each small run's table, JSON, JSONL, plots and HTML exist and agree (the fake
engine's runs: tests/bench/test_serve_e2e.py)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.bench.serve_outputs import check_outputs, serve

from .conftest import MODEL, CpuEngine, cpu_gateway

pytestmark = pytest.mark.model

REQUESTS = 4
#: A few short requests at two clients: seconds on the real model.
LOAD = ("--model", MODEL, "--concurrency", "2", "--num-requests", str(REQUESTS),
        "--input-len", "16", "--output-len", "8")


def _agree(out: Path, stdout: str) -> dict[str, Any]:
    """The run's outputs agree, every request succeeded with at most its 8 tokens; returns its
    one load point from the JSON."""
    doc, recs = check_outputs(out, stdout)
    assert doc["config"]["model"] == MODEL and doc["config"]["args"]["concurrency"] == [2]
    (point,) = doc["points"]
    f = point["figures"]
    assert f["requests"] == f["completed"] == REQUESTS and f["errors"] == {}
    assert all(1 <= (x.output_tokens or 0) <= 8 for x in recs["concurrency=2"])
    assert f["ttft_ms"]["count"] == f["e2e_ms"]["count"] == REQUESTS
    return dict(point)


async def test_the_gateway_on_the_default_model(cpu_engine: CpuEngine, tmp_path: Path) -> None:
    out = tmp_path / "gw"
    async with cpu_gateway(cpu_engine) as gw:  # Hypercorn on a loopback port, in this process
        r = await trio.to_thread.run_sync(
            partial(serve, "--base-url", gw.url + "/v1", *LOAD, "--results-dir", str(out)))
    assert r.returncode == 0, r.stderr
    point = _agree(out, r.stdout)
    assert point["figures"]["tokens_counted_by"] == {"usage": REQUESTS}
    # the gateway's own counters, scraped around the point, count the requests sent
    m = point["server_metrics"]
    assert m["available"] is True and m["url"] == gw.url + "/metrics"
    served = {k: v for k, v in m["counters_delta"].items()
              if k.startswith("sieproxy_requests_total{") and 'status="200"' in k}
    assert sum(served.values()) == REQUESTS, json.dumps(m["counters_delta"])[:2000]


def test_llama_cpp_server_on_the_default_gguf(llama_server: str, tmp_path: Path) -> None:
    out = tmp_path / "llama"
    r = serve("--base-url", llama_server, *LOAD, "--results-dir", str(out))
    assert r.returncode == 0, r.stderr
    point = _agree(out, r.stdout)
    # no usage in its streams: its output tokens are its text events (docs/BENCH-METHOD.md)
    assert point["figures"]["tokens_counted_by"] == {"chunks": REQUESTS}
    assert point["server_metrics"]["available"] is False
