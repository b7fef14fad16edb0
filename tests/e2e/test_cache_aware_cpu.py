"""Cache-aware routing end to end: two CPU engines publishing KV events (``--kv-events-config``,
SGLang's JSON; each advertises its bound endpoints in ``/server_info``), a real gateway with
``routing = "cache_aware"`` and the model's own tokenizer. A repeated long prefix lands where
the engine holds it, and the engine's reported ``cached_tokens`` equals the prediction."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")
pytest.importorskip("xgrammar")
import trio  # noqa: E402

from sieproxy.fleet.cache_route import CacheAwarePolicy  # noqa: E402
from sieproxy.operations.serve import build_app, serve  # noqa: E402
from sieproxy.settings.load import GatewaySettings, ModelSettings, Settings  # noqa: E402
from tests.procs import spawn_python, stop_process, wait_line, wait_ready  # noqa: E402

pytestmark = pytest.mark.model

MODEL = "smol"
READY_TIMEOUT = 600.0
EVENTS = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    procs, urls = [], []
    try:
        for i in range(2):
            path = tmp_path_factory.mktemp(f"engine{i}") / "engine.log"
            proc = spawn_python(
                ["-m", "engine", "serve", "--model", "default",
                 "--host", "127.0.0.1", "--port", "0", "--served-model-name", MODEL,
                 "--max-running", "4", "--threads", "1", "--prefix-cache-tokens", "4096",
                 "--kv-events-config", EVENTS],
                path,
            )  # fmt: skip
            procs.append(proc)
            url = wait_line(proc, path, r"listening on (http://\S+)", READY_TIMEOUT)
            wait_ready(url, READY_TIMEOUT, path="/health", proc=proc, log=path)
            urls.append(url)
        yield urls
    finally:
        for proc in procs:
            stop_process(proc, grace=20)


async def test_a_repeated_prefix_lands_where_the_engine_caches_it(two_engines: list[str]) -> None:
    model_dir = httpx.get(two_engines[0] + "/model_info", timeout=30).json()["tokenizer_path"]
    settings = Settings(
        gateway=GatewaySettings(host="127.0.0.1", port=0, health_interval=0.2, access_log=False),
        models={MODEL: ModelSettings(engines=list(two_engines), tokenizer=model_dir,
                                     routing="cache_aware")},
    )
    system = " ".join(f"Rule {i}: answer in the fewest words, and never say number {i}."
                      for i in range(40))  # about 700 tokens
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            app = build_app(settings)
            stop = trio.Event()
            binds = await nursery.start(partial(serve, settings, shutdown_trigger=stop, app=app))
            policy = app.extensions["sieproxy"].pools[MODEL].policy
            assert isinstance(policy, CacheAwarePolicy)
            async with httpx.AsyncClient(base_url=binds[0], timeout=300) as client:
                while (await client.get("/readyz")).status_code != 200:
                    await trio.sleep(0.1)
                while not (policy.tokenizer is not None and len(policy.caches) == 2 and all(
                        rc.stream is not None and rc.stream.joined
                        for rc in policy.caches.values())):
                    await trio.sleep(0.1)

                async def ask(question: str) -> int:
                    r = await client.post("/v1/chat/completions", json={
                        "model": MODEL, "max_tokens": 2, "temperature": 0,
                        "messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": question}]})
                    assert r.status_code == 200, r.text
                    cached: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                    return cached

                assert await ask("What is rule 3?") == 0
                # the engine's events reach the gateway's index of the replica that served it
                while not any(rc.stream is not None and len(rc.stream.index) >= 40
                              for rc in policy.caches.values()):
                    await trio.sleep(0.05)
                for q in ("What is rule 7?", "And rule 12?", "Which rule mentions 30?"):
                    assert await ask(q) >= 600
                served = [rc for rc in policy.caches.values() if sum(rc.outcomes.values())]
                assert len(served) == 1, "every repeat went to the replica holding the prefix"
                rc = served[0]
                # four requests (the first predicted and reported 0), every prediction exact
                assert rc.outcomes["exact"] == 4 and rc.predicted == rc.reported >= 1800
            stop.set()
            nursery.cancel_scope.cancel()
