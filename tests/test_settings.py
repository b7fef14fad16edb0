"""Configuration: defaults, environment overrides, and bad files failing at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from sieproxy.serve import build_state
from sieproxy.settings import DEFAULT_MODEL_NAME, ConfigError, load_settings

GOOD = """
[gateway]
port = 9000
[models.m]
engines = ["http://127.0.0.1:30000", { url = "http://127.0.0.1:30001", pool = "batch" }]
chat_template = "{{ messages[0]['content'] }}"
tool_parser = "hermes"
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "gateway.toml"
    p.write_text(text)
    return p


def test_no_file_means_the_embedded_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIEPROXY_CONFIG", raising=False)
    s = load_settings(None)
    assert s.embedded_engine.enabled
    assert s.gateway.default_max_tokens == 1024
    state = build_state(s)
    assert list(state.profiles) == [DEFAULT_MODEL_NAME]
    assert not state.pools[DEFAULT_MODEL_NAME].gate_open  # template discovered from the engine
    # the bundled model's template ignores `tools`: the gateway teaches (and parses) smollm2
    assert state.profiles[DEFAULT_MODEL_NAME].tool_parser == "smollm2"


def test_good_file_and_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIE_GATEWAY_DEFAULT_MAX_TOKENS", "77")
    monkeypatch.setenv("SIEPROXY_AUTH_TOKENS", "a, b")
    s = load_settings(_write(tmp_path, GOOD))
    assert s.gateway.port == 9000
    assert s.gateway.default_max_tokens == 77
    assert s.gateway.auth is True
    assert s.auth_tokens() == [b"a", b"b"]
    assert [e.pool for e in s.engine_specs("m")] == [None, "batch"]
    assert not s.embedded_engine.enabled
    assert build_state(s).profiles["m"].default_max_tokens == 77
    assert build_state(s).profiles["m"].max_tool_calls == 4
    capped = load_settings(_write(tmp_path, GOOD + "max_tool_calls = 2\n"))
    assert build_state(capped).profiles["m"].max_tool_calls == 2


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("[gateway]\nport = 'x'\n", "gateway.port", "Expected `int`"),
        ("[gateway]\nprot = 1\n", "gateway", "unknown key `prot`"),
        ("[gateway]\nport = 70000\n", "gateway.port", "[0, 65535]"),
        ("[gateway]\ntoken_gap_timeout = 0\n", "gateway.token_gap_timeout", "positive"),
        ("[gateway]\nlog_level = 'loud'\n", "gateway.log_level", "one of"),
        ("[models.m]\nengines = []\n", "models.m.engines", "at least one"),
        ("[models.m]\nengines = ['ftp://x']\n", "models.m.engines[0]", "http(s)"),
        ("[models.m]\nengines = ['http://x']\ninputs = ['audio']\n", "models.m.inputs", "audio"),
        ("[models.m]\nengines = ['http://x']\ntokenizer = '/nonexistent'\n",
         "models.m.tokenizer", "not a directory"),
        ("[models.m]\nengines = ['http://x']\nmax_tool_calls = 0\n",
         "models.m.max_tool_calls", ">= 1"),
    ],
)
def test_bad_file_names_file_key_problem(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(p)
    msg = str(info.value)
    assert str(p) in msg and key in msg and problem in msg, msg


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("tool_parser = 'nope'", "models.m.tool_parser"),
        ("reasoning_parser = 'nope'", "models.m.reasoning_parser"),
    ],
)
def test_unknown_parser_fails_at_start(tmp_path: Path, extra: str, key: str) -> None:
    s = load_settings(_write(tmp_path, f"[models.m]\nengines = ['http://x']\n{extra}\n"))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_state(s)


def test_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(_write(tmp_path, "[gateway\n"))


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.toml")
