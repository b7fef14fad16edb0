"""CPU engine over HTTP: SGLang native protocol on a real loopback socket (httpx on Trio).

One engine subprocess serves the whole module (``python -m engine.cpu.server --port 0``), with a
random-initialized LoRA adapter made by PEFT, ``--max-running 4 --max-queue 2``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")
import trio  # noqa: E402

from tests.procs import stop_process  # noqa: E402

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from engine.cpu.model_store import resolve_model

    base = AutoModelForCausalLM.from_pretrained(str(resolve_model("default")))
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "up_proj"],
    )
    out = tmp_path_factory.mktemp("lora")
    peft.get_peft_model(base, config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def server(lora_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    log_path = tmp_path_factory.mktemp("srv") / "engine.log"
    log = log_path.open("wb")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engine.cpu.server",
            "--port",
            "0",
            "--lora",
            f"t={lora_dir}",
            "--max-running",
            "4",
            "--max-queue",
            "2",
            "--served-model-name",
            "smol",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(ROOT),
    )
    info: dict[str, Any] = {"proc": proc}
    try:
        deadline = time.monotonic() + 120
        url = None
        while time.monotonic() < deadline and url is None:
            m = re.search(r"listening on (http://\S+)", log_path.read_text(errors="replace"))
            if m:
                url = m.group(1)
            elif proc.poll() is not None:
                pytest.fail(f"engine exited: {log_path.read_text()}")
            else:
                time.sleep(0.05)
        assert url, "engine did not bind"
        info["url"] = url
        info["first_health"] = httpx.get(url + "/health", timeout=30).status_code
        while time.monotonic() < deadline:
            if "ready:" in log_path.read_text(errors="replace"):
                break
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.1)
        yield info
    finally:
        stop_process(proc)
        log.close()


def client(server: dict[str, Any]) -> Any:
    return httpx.AsyncClient(base_url=server["url"], timeout=httpx.Timeout(120.0))


async def read_sse(response: Any) -> list[Any]:
    """Parse a whole SSE body; assert exact framing; return objects plus the final '[DONE]'."""
    raw = b""
    async for chunk in response.aiter_raw():
        raw += chunk
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    out: list[Any] = []
    for event in events[:-1]:
        assert event.startswith(b"data: ")
        payload = event[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def test_health_503_while_loading_then_200(server: dict[str, Any]) -> None:
    assert server["first_health"] == 503
    assert httpx.get(server["url"] + "/health_generate", timeout=30).status_code == 200
    assert httpx.get(server["url"] + "/health", timeout=30).status_code == 200


async def test_stream_framing_and_cumulative_text(server: dict[str, Any]) -> None:
    body = {
        "text": "The capital of France is",
        "stream": True,
        "rid": "abc",
        "sampling_params": {"temperature": 0, "max_new_tokens": 12},
    }
    async with client(server) as c, c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(ch["meta_info"]["id"] == "abc" and "index" not in ch for ch in chunks)
    for prev, cur in itertools.pairwise(chunks):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert all(ch["meta_info"]["finish_reason"] is None for ch in chunks[:-1])
    assert all("e2e_latency" not in ch["meta_info"] for ch in chunks[:-1])
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] == {"type": "length", "length": 12}
    assert final["completion_tokens"] == 12 and final["prompt_tokens"] == 5
    assert final["cached_tokens"] == 0 and final["reasoning_tokens"] == 0
    assert final["weight_version"] == "default" and "e2e_latency" in final
    async with client(server) as c:
        r2 = await c.post("/generate", json={**body, "stream": False})
    assert r2.status_code == 200
    assert r2.json()["text"] == chunks[-1]["text"]
    assert r2.json()["output_ids"] == chunks[-1]["output_ids"]


async def test_contract_and_validation_errors(server: dict[str, Any]) -> None:
    async with client(server) as c:
        r = await c.post("/generate", json={"text": "x", "sampling_params": {"bogus": 1}})
        assert r.status_code == 400
        assert isinstance(r.json()["error"], str)
        assert r.json()["error"].startswith("unknown field `bogus`, expected one of")
        r = await c.post(
            "/generate", json={"text": "x", "sampling_params": {"regex": "a", "json_schema": "{}"}}
        )
        assert r.status_code == 400
        assert r.json() == {
            "error": {
                "message": "Only one of json_schema, regex, ebnf, or structural_tag can be set."
            }
        }
        r = await c.post("/generate", json={"text": "x", "lora_path": "missing"})
        assert r.status_code == 400 and "missing" in r.json()["error"]["message"]
        r = await c.post("/generate", json={"text": "x", "image_data": "data:image/png;base64,AA"})
        assert r.status_code == 400 and "image" in r.json()["error"]["message"]
        r = await c.post("/generate", json={"text": "x", "sampling_params": {"top_p": 0}})
        assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
        r = await c.post("/generate", json={"input_ids": [1] * 9000})
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
        r = await c.post(
            "/generate",
            json={"text": "x", "unknown_top_level": 1, "sampling_params": {"max_new_tokens": 1}},
        )
        assert r.status_code == 200  # unknown top-level keys are ignored


async def test_abort_request_ends_stream(server: dict[str, Any]) -> None:
    body = {
        "text": "Tell me a story",
        "stream": True,
        "rid": "to-abort",
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    async with client(server) as c, c.stream("POST", "/generate", json=body) as r:
        lines = r.aiter_raw()
        first = await lines.__anext__()
        assert first.startswith(b"data: ")
        ack = await c.post("/abort_request", json={"rid": "to-abort"})
        assert ack.status_code == 200 and ack.content == b""
        rest = first
        async for chunk in lines:
            rest += chunk
    assert rest.endswith(b"data: [DONE]\n\n")
    final = json.loads(rest.split(b"\n\n")[-3][len(b"data: ") :])
    assert final["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }


async def _running(c: Any) -> int:
    info = (await c.get("/server_info")).json()
    return int(info["internal_states"][0]["num_running_reqs"])


async def test_client_disconnect_aborts(server: dict[str, Any]) -> None:
    body = {
        "text": "Tell me a story",
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    async with client(server) as c:
        async with c.stream("POST", "/generate", json=body) as r:
            await r.aiter_raw().__anext__()
            assert await _running(c) >= 1
        # leaving the stream context closes the connection mid-stream
        with trio.fail_after(30):
            while await _running(c):
                await trio.sleep(0.1)


async def test_queue_full_503(server: dict[str, Any]) -> None:
    rids = [f"busy-{i}" for i in range(6)]
    body = {"sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    async with client(server) as c:
        try:
            async with trio.open_nursery() as nursery:
                for rid in rids:  # 4 running + 2 waiting
                    nursery.start_soon(
                        partial(c.post, "/generate", json={**body, "text": "a", "rid": rid})
                    )
                with trio.fail_after(60):
                    while True:
                        info = (await c.get("/server_info")).json()["internal_states"][0]
                        if info["num_running_reqs"] == 4 and info["num_waiting_reqs"] == 2:
                            break
                        await trio.sleep(0.1)
                r = await c.post("/generate", json={**body, "text": "b"})
                assert r.status_code == 503
                assert r.json()["code"] == 503 and "queue" in r.json()["message"]
                # the load report a gateway balances on (SGLang's /v1/loads and /get_load)
                (rank,) = (await c.get("/v1/loads")).json()["loads"]
                assert (rank["num_running_reqs"], rank["num_waiting_reqs"]) == (4, 2)
                (legacy,) = (await c.get("/get_load")).json()
                assert (legacy["num_reqs"], legacy["num_waiting_reqs"]) == (6, 2)
                for rid in rids:
                    await c.post("/abort_request", json={"rid": rid})
        finally:
            for rid in rids:
                await c.post("/abort_request", json={"rid": rid})


async def test_lora_over_http(server: dict[str, Any]) -> None:
    body = {
        "text": "The capital of France is",
        "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True},
    }
    async with client(server) as c:
        base = (await c.post("/generate", json=body)).json()
        batch = (
            await c.post(
                "/generate",
                json={
                    "text": [body["text"]] * 2,
                    "lora_path": [None, "t"],
                    "sampling_params": body["sampling_params"],
                },
            )
        ).json()
        models = (await c.get("/v1/models")).json()
    assert batch[0]["output_ids"] == base["output_ids"]
    assert batch[1]["output_ids"] != base["output_ids"]
    ids = [m["id"] for m in models["data"]]
    assert ids == ["smol", "t"] and models["data"][1]["parent"] == "smol"


async def test_batch_n_stream_indices_and_logprobs(server: dict[str, Any]) -> None:
    body = {
        "text": "Hello",
        "stream": True,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": {"n": 2, "max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 7},
    }
    async with client(server) as c, c.stream("POST", "/generate", json=body) as r:
        events = await read_sse(r)
    chunks = events[:-1]
    assert {ch["index"] for ch in chunks} == {0, 1}
    finals = [ch for ch in chunks if ch["meta_info"]["finish_reason"] is not None]
    assert len(finals) == 2
    for ch in finals:
        meta = ch["meta_info"]
        assert meta["output_token_logprobs_length"] == 4
        assert len(meta["output_token_logprobs"]) == 4
        assert meta["output_token_logprobs"][0][2] is None  # return_text_in_logprobs false
        assert all(row is not None and len(row) == 2 for row in meta["output_top_logprobs"])


async def test_json_schema_and_stop_over_http(server: dict[str, Any]) -> None:
    # Bounded so the constrained output always closes well within the token cap (a length cut
    # can end any JSON mid-way; that is not what this test is about); seeded for repeatability.
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["x"],
        "additionalProperties": False,
    }
    async with client(server) as c:
        r = await c.post(
            "/generate",
            json={
                "text": "JSON:",
                "sampling_params": {
                    "json_schema": json.dumps(schema),
                    "max_new_tokens": 60,
                    "temperature": 0.7,
                    "sampling_seed": 7,
                },
            },
        )
        assert r.status_code == 200
        assert r.json()["meta_info"]["finish_reason"]["type"] == "stop"
        assert isinstance(json.loads(r.json()["text"])["x"], int)
        r = await c.post(
            "/generate",
            json={
                "text": "Count: 1, 2, 3,",
                "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 12, "stop": " 5,"},
            },
        )
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 5,"}
    assert all(" 5" not in e["text"] for e in events)


async def test_info_endpoints(server: dict[str, Any]) -> None:
    async with client(server) as c:
        for path in ("/server_info", "/get_server_info"):
            info = (await c.get(path)).json()
            assert info["incremental_streaming_output"] is False
            assert info["served_model_name"] == "smol"
            assert info["context_length"] == 8192
            assert info["max_running_requests"] == 4
            assert "version" in info and info["model_path"]
        for path in ("/model_info", "/get_model_info"):
            info = (await c.get(path)).json()
            assert info["is_generation"] is True and info["architectures"] == ["LlamaForCausalLM"]
            assert Path(info["tokenizer_path"], "tokenizer_config.json").is_file()


async def test_cached_tokens_and_flush_cache(server: dict[str, Any]) -> None:
    prompt = (
        "A long shared preamble that several requests repeat word for word, so that its key "
        "and value vectors can be served from the prefix cache instead of being computed again. "
    )
    body = {"sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    async with client(server) as c:
        assert (await c.post("/flush_cache")).status_code == 200
        first = (await c.post("/generate", json={**body, "text": prompt + "One."})).json()
        assert first["meta_info"]["cached_tokens"] == 0
        second = (await c.post("/generate", json={**body, "text": prompt + "Two."})).json()
        cached = second["meta_info"]["cached_tokens"]
        assert 0 < cached < second["meta_info"]["prompt_tokens"]
        stream = {**body, "text": prompt + "Three.", "stream": True}
        async with c.stream("POST", "/generate", json=stream) as r:
            chunks = await read_sse(r)
        assert all(ch["meta_info"]["cached_tokens"] == cached for ch in chunks if ch != "[DONE]")
        info = (await c.get("/server_info")).json()["internal_states"][0]
        assert info["prefix_cache_tokens"] >= cached
        flushed = await c.get("/flush_cache")
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
        info = (await c.get("/server_info")).json()["internal_states"][0]
        assert info["prefix_cache_tokens"] == 0
        again = (await c.post("/generate", json={**body, "text": prompt + "Two."})).json()
        assert again["meta_info"]["cached_tokens"] == 0
        assert again["text"] == second["text"]
