"""End-to-end fixtures: one real CPU engine subprocess per session, a real gateway per test,
and llama.cpp's server (llama-cpp-python's) on the default model's GGUF, one per module.

The engine (``python -m engine serve --model default``, SmolLM2-135M-Instruct with
xgrammar-constrained decoding) is slow to load, so it is started once and shared; the gateway is
cheap and lives on each test's own trio loop (pytest-trio fixtures are per test), on a real
loopback port that a subprocess can reach too.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")
pytest.importorskip("xgrammar")
import trio  # noqa: E402

from engine.cpu.model_store import default_gguf_path  # noqa: E402
from sieproxy.operations.serve import build_app, serve  # noqa: E402
from sieproxy.settings.load import GatewaySettings, ModelSettings, Settings  # noqa: E402
from tests.procs import free_port, spawn_python, stop_process, wait_line, wait_ready  # noqa: E402

#: The name the engine serves the model under, and the gateway's model name.
MODEL = "smol"
#: Model load takes ~5-60 s; be generous on a loaded 2-core machine.
READY_TIMEOUT = 300.0
#: A guard, not a wait: every wait on llama.cpp's server ends when the thing waited for is
#: ready. It answers nothing (``/v1/models`` included) while it generates, so on a loaded
#: machine an earlier test's last generation can hold it for minutes.
LLAMA_TIMEOUT = 600.0


@dataclass(frozen=True)
class CpuEngine:
    url: str
    model_dir: str
    log_path: Path


@pytest.fixture(scope="session")
def cpu_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CpuEngine]:
    """The CPU engine on a free loopback port (``--port 0``; the bound URL is read from its
    log), ready (``/health`` 200) before the first test; terminated at the end."""
    log_path = tmp_path_factory.mktemp("cpu-engine") / "engine.log"
    proc = spawn_python(
        ["-m", "engine", "serve", "--model", "default", "--host", "127.0.0.1", "--port", "0",
         "--served-model-name", MODEL, "--max-running", "16"],
        log_path,
    )  # fmt: skip
    try:
        url = wait_line(proc, log_path, r"listening on (http://\S+)", READY_TIMEOUT)
        wait_ready(url, READY_TIMEOUT, path="/health", proc=proc, log=log_path)
        info = httpx.get(url + "/model_info", timeout=30).json()
        model_dir = info["tokenizer_path"]
        assert Path(model_dir, "tokenizer_config.json").is_file(), info
        yield CpuEngine(url=url, model_dir=model_dir, log_path=log_path)
    finally:
        stop_process(proc, grace=20)


@dataclass
class CpuGateway:
    url: str
    client: httpx.AsyncClient
    engine: CpuEngine


@contextlib.asynccontextmanager
async def cpu_gateway(
    engine: CpuEngine, *, tool_parser: str | None = None
) -> AsyncIterator[CpuGateway]:
    """A real gateway (Hypercorn on a loopback port) in front of the CPU engine, its chat
    template read from the converted model directory (``tokenizer``)."""
    settings = Settings(
        gateway=GatewaySettings(
            host="127.0.0.1",
            port=0,
            access_log=False,
            # The engine's /health runs a 1-token generation: slow while the batch is full.
            health_interval=30.0,
            health_timeout=120.0,
            admission_wait=60.0,
        ),
        models={
            MODEL: ModelSettings(
                engines=[engine.url], tokenizer=engine.model_dir, tool_parser=tool_parser
            )
        },
    )
    async with trio.open_nursery() as nursery:
        app = build_app(settings)
        stop = trio.Event()
        binds = await nursery.start(partial(serve, settings, shutdown_trigger=stop, app=app))
        url = binds[0]
        timeout = httpx.Timeout(180.0, connect=10.0)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
            with trio.fail_after(120):
                while (await client.get("/readyz")).status_code != 200:
                    await trio.sleep(0.05)
            yield CpuGateway(url, client, engine)
        stop.set()
        nursery.cancel_scope.cancel()


@pytest.fixture
async def gw(cpu_engine: CpuEngine) -> AsyncIterator[CpuGateway]:
    async with cpu_gateway(cpu_engine) as g:
        yield g


def llama_ready(url: str) -> bool:
    """llama.cpp's server answers ``/v1/models``: it is up and not generating."""
    try:
        return httpx.get(url + "/v1/models", timeout=LLAMA_TIMEOUT).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-cpp-python's OpenAI server on the bundled GGUF, serving it as ``smol``."""
    pytest.importorskip("llama_cpp.server.app")
    log_path = tmp_path_factory.mktemp("llama") / "server.log"
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(default_gguf_path()),
             "--model_alias", MODEL, "--host", "127.0.0.1", "--port", str(port),
             "--n_ctx", "2048", "--n_threads", "2",
             # Else each new request cuts the stream in progress (docs/CONFIGURATION.md).
             "--interrupt_requests", "False"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + LLAMA_TIMEOUT
            while not llama_ready(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"llama.cpp server did not start:\n{log_path.read_text()}")
                time.sleep(0.2)  # (nothing listens yet: each try fails at once)
            yield url
        finally:
            stop_process(proc, grace=10)
