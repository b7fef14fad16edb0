"""``sieproxy serve --model PATH`` / ``--engine URL``: one model, no configuration file
(``sieproxy.quickstart``), from the settings they build to the real command end to end."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sieproxy.cli import main
from sieproxy.operations import quickstart
from sieproxy.operations.quickstart import (
    EngineIdentity,
    ModelFlags,
    engine_identity,
    serve_settings,
    served_name_for,
    settings_from_flags,
)
from sieproxy.operations.serve import effective_models
from sieproxy.settings.load import DEFAULT_MODEL_NAME, ConfigError
from tests.procs import serve_gateway, spawn_python, stop_process, wait_line


def _model_dir(root: Path, model_type: str) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


def test_served_name_defaults_from_the_path(tmp_path: Path) -> None:
    assert served_name_for("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert served_name_for("/x/Qwen3-0.6B-Q8_0.gguf") == "Qwen3-0.6B"
    assert served_name_for("/x/tiny.gguf") == "tiny"
    assert served_name_for("/models/Qwen2.5-7B-Instruct") == "Qwen2.5-7B-Instruct"
    hub = "/h/hub/models--Qwen--Qwen3-0.6B/snapshots/0123abcd"
    assert served_name_for(hub) == "Qwen/Qwen3-0.6B"
    assert served_name_for("default") == DEFAULT_MODEL_NAME


def test_model_flag_defaults_the_parsers_from_the_family(tmp_path: Path) -> None:
    qwen3 = _model_dir(tmp_path / "Qwen3-0.6B", "qwen3")
    s = settings_from_flags(ModelFlags(model=str(qwen3)))
    e = s.embedded_engine
    assert e.enabled and e.model == str(qwen3.resolve())
    assert (e.served_name, e.tool_parser, e.reasoning_parser) == ("Qwen3-0.6B", "qwen25", "qwen3")
    m = effective_models(s)["Qwen3-0.6B"]
    assert (m.tool_parser, m.reasoning_parser) == ("qwen25", "qwen3")

    # Flags win; "none" turns a family default off.
    s = settings_from_flags(
        ModelFlags(
            model=str(qwen3), served_model_name="q", tool_parser="hermes", reasoning_parser="none"
        )
    )
    e = s.embedded_engine
    assert (e.served_name, e.tool_parser, e.reasoning_parser) == ("q", "hermes", None)

    # Without model_type, the first architecture names the family.
    arch = tmp_path / "by-arch"
    arch.mkdir()
    (arch / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    e = settings_from_flags(ModelFlags(model=str(arch))).embedded_engine
    assert (e.tool_parser, e.reasoning_parser) == ("qwen25", None)

    # A llama-type model (SmolLM2 is one) gets no parser: the type does not say which format.
    llama = _model_dir(tmp_path / "small", "llama")
    e = settings_from_flags(ModelFlags(model=str(llama))).embedded_engine
    assert (e.tool_parser, e.reasoning_parser) == (None, None)


def test_bad_model_flags_are_configuration_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"not a model directory or a \.gguf file"):
        settings_from_flags(ModelFlags(model=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="not an http"):
        settings_from_flags(ModelFlags(engine="ftp://x", served_model_name="m"))
    cfg = tmp_path / "gw.toml"
    cfg.write_text('[models.m]\nengines = ["http://127.0.0.1:9"]\n')
    with pytest.raises(ConfigError, match=r"--config \(.*gw.toml\) is given too"):
        serve_settings(str(cfg), ModelFlags(model="default"))
    # The command says it in one line and exits 2, before anything starts.
    assert main(["serve", "--config", str(cfg), "--engine", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sieproxy: configuration error:") and "[models]" in err
    assert len(err.strip().splitlines()) == 1


def test_engine_flag_needs_a_name_when_the_engine_is_not_up() -> None:
    with pytest.raises(ConfigError, match="start the engine first"):
        settings_from_flags(ModelFlags(engine="http://127.0.0.1:9"))
    s = settings_from_flags(ModelFlags(engine="http://127.0.0.1:9", served_model_name="m"))
    assert not s.embedded_engine.enabled
    assert [str(u) for u in s.models["m"].engines] == ["http://127.0.0.1:9"]


def _client(routes: dict[str, object]) -> httpx.Client:
    """An httpx client whose server answers ``routes`` (path → JSON) and 404 elsewhere."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path in routes:
            return httpx.Response(200, json=routes[request.url.path])
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_engine_identity_tells_sglang_from_an_openai_compatible_server() -> None:
    sglang = engine_identity("http://e:30000/", client=_client({"/model_info": {"a": 1}}))
    assert (sglang.url, sglang.protocol, sglang.info) == ("http://e:30000", "sglang", {"a": 1})
    listed = {"object": "list", "data": [{"id": "org/m", "object": "model"}]}
    for url in ("http://e:8000", "http://e:8000/v1", "http://e:8000/v1/"):
        found = engine_identity(url, client=_client({"/v1/models": listed}))
        assert (found.url, found.protocol, found.models) == ("http://e:8000", "openai", ("org/m",))
    with pytest.raises(ConfigError, match=r"/model_info or /v1/models \(HTTP 404\)"):
        engine_identity("http://e:8000", client=_client({"/v1/models": {"data": []}}))


def _found(monkeypatch: pytest.MonkeyPatch, found: EngineIdentity) -> None:
    monkeypatch.setattr(quickstart, "engine_identity", lambda url: found)


def test_engine_flag_fronts_an_openai_compatible_server_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its one model's id is the served name (the gateway asks the engine by it); the engine
    renders (``render = "engine"``), so no template is needed and parser flags are refused."""
    _found(monkeypatch, EngineIdentity("http://e:8000", "openai", {}, ("org/m",)))
    s = settings_from_flags(ModelFlags(engine="http://e:8000/v1"))
    (spec,) = s.models["org/m"].engines
    assert not isinstance(spec, str)
    assert (spec.url, spec.protocol) == ("http://e:8000", "openai")
    assert s.models["org/m"].render_mode() == "engine"
    with pytest.raises(ConfigError, match=r"^--tool-parser: .* OpenAI-compatible .* drop"):
        settings_from_flags(ModelFlags(engine="http://e:8000", tool_parser="hermes"))
    with pytest.raises(ConfigError, match=r"serves org/m, .* use one of them"):
        settings_from_flags(ModelFlags(engine="http://e:8000", served_model_name="other"))
    _found(monkeypatch, EngineIdentity("http://e:8000", "openai", {}, ("a", "b")))
    with pytest.raises(ConfigError, match=r"serves 2 models \(a, b\); choose one with"):
        settings_from_flags(ModelFlags(engine="http://e:8000"))
    named = settings_from_flags(ModelFlags(engine="http://e:8000", served_model_name="b"))
    assert list(named.models) == ["b"]


def test_a_named_engine_that_is_not_up_takes_its_protocol_from_the_url() -> None:
    s = settings_from_flags(ModelFlags(engine="http://127.0.0.1:9/v1", served_model_name="m"))
    (spec,) = s.models["m"].engines
    assert not isinstance(spec, str)
    assert (spec.url, spec.protocol) == ("http://127.0.0.1:9", "openai")


# ---- the real command ------------------------------------------------------------------------


@pytest.fixture(params=["sglang", "openai"])
def fake_engine(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The fake engine as SGLang serves it, or as a hosted OpenAI-compatible endpoint does
    (chat and ``/v1/models`` only; its URL given with ``/v1``, as such endpoints are)."""
    log = tmp_path / "fake.log"
    chat_only = ["--chat-only"] if request.param == "openai" else []
    proc = spawn_python(
        ["-m", "engine.fake", "--port", "0", "--served-model-name", "org/fake-model", *chat_only],
        log,
    )
    try:
        url = wait_line(proc, log, r"listening on (http://\S+)", 60)
        yield url + "/v1" if chat_only else url
    finally:
        stop_process(proc)


def _served_and_answers(url: str, name: str, *, max_tokens: int, timeout: float) -> httpx.Response:
    """``name`` is the one model listed, and a chat request to it gets an answer."""
    models = httpx.get(url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [name]
    body = {
        "model": name,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Say hello."}],
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    return r


def test_serve_engine_url_end_to_end(tmp_path: Path, fake_engine: str) -> None:
    """``sieproxy serve --engine URL``: the name comes from the engine's /model_info, or from
    an OpenAI-compatible engine's /v1/models; a streamed answer comes through too."""
    proc, url = serve_gateway(tmp_path, "--engine", fake_engine, timeout=60)
    try:
        r = _served_and_answers(url, "org/fake-model", max_tokens=3, timeout=30)
        assert r.json()["usage"]["completion_tokens"] == 3
        body = {"model": "org/fake-model", "max_tokens": 3, "stream": True,
                "messages": [{"role": "user", "content": "Say hello."}]}  # fmt: skip
        streamed = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    finally:
        stop_process(proc)


@pytest.mark.model
def test_serve_model_bundled_gguf_end_to_end(tmp_path: Path) -> None:
    """``sieproxy serve --model <the bundled gguf>``: the embedded engine on that file, served
    under the file's name (its quantization suffix dropped)."""
    from engine.cpu.model_store import default_gguf_path

    gguf = default_gguf_path()
    # The embedded engine's port has no flag, and the default (30100) may be another
    # instance's: this run moves it to a free port by the settings the flags produce.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = (
        "import sys, sieproxy.operations.quickstart as q\n"
        "load = q.load_settings\n"
        "def moved(path):\n"
        "    s = load(path)\n"
        f"    s.embedded_engine.port = {port}\n"
        "    return s\n"
        "q.load_settings = moved\n"
        "from sieproxy.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc, url = serve_gateway(tmp_path, "--model", str(gguf), timeout=600, launcher=launcher)
    try:
        _served_and_answers(url, "SmolLM2-135M-Instruct", max_tokens=8, timeout=300)
    finally:
        stop_process(proc, grace=30)
