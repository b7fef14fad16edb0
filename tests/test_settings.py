"""Configuration: defaults, environment overrides, and bad files failing at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sieproxy.operations.serve import build_state
from sieproxy.settings.load import DEFAULT_MODEL_NAME, ConfigError, load_settings

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


BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}"  # no endfor

#: Values accepted by the types but fatal (or meaningless) later: each must stop the load,
#: naming its key. (file text, key, a word of the problem)
_TWO = "[models.a]\nengines = ['http://x']\n{a}[models.b]\nengines = ['http://y']\n{b}"
REFUSED_AT_LOAD = [
    (_TWO.format(a="aliases = ['b']\n", b=""), "models.a.aliases[0]",
     "'b' is the name of a served model"),
    (_TWO.format(a="aliases = ['claude-*']\n", b="aliases = ['x', 'claude-*']\n"),
     "models.b.aliases[1]", "'claude-*' is already an alias of model 'a'"),
    (_TWO.format(a="aliases = ['[ab]']\n", b=""), "models.a.aliases[0]",
     "pattern '[ab]' matches the served model 'a'"),
    (_TWO.format(a="aliases = ['']\n", b=""), "models.a.aliases[0]", "non-empty"),
    ("[embedded_engine]\nenabled = true\nkind = 'fake'\naliases = ['claude-*']\n"
     "[models.m]\nengines = ['http://x']\naliases = ['claude-*']\n",
     "embedded_engine.aliases[0]", "'claude-*' is already an alias of model 'm'"),
    ("[models.m]\nengines = ['http://x']\ntool_parser = 'nope'\n",
     "models.m.tool_parser", "unknown tool-call parser 'nope'"),
    ("[models.m]\nengines = ['http://x']\nreasoning_parser = 'nope'\n",
     "models.m.reasoning_parser", "unknown reasoning parser 'nope'"),
    (f"[models.m]\nengines = ['http://x']\nchat_template = \"{BROKEN_TEMPLATE}\"\n",
     "models.m.chat_template", "not valid Jinja"),
    ("[gateway]\nlog_level = 'loud'\n", "gateway.log_level", "one of"),
    ("[gateway]\nretry_after = 0\n", "gateway.retry_after", ">= 1"),
    ("[gateway]\nbreaker_failures = 0\n", "gateway.breaker_failures", ">= 1"),
    ("[gateway]\nbreaker_backoff = 0\n", "gateway.breaker_backoff", "positive"),
    ("[gateway]\nbreaker_backoff = -1\n", "gateway.breaker_backoff", "positive"),
    ("[gateway]\nbreaker_backoff_max = 0\n", "gateway.breaker_backoff_max", "breaker_backoff"),
    ("[gateway]\nbreaker_backoff = 5\nbreaker_backoff_max = 4\n",
     "gateway.breaker_backoff_max", "breaker_backoff"),
    ("[gateway]\nadmission_wait = -1\n", "gateway.admission_wait", ">= 0"),
    ("[gateway]\nmessages_ping_interval = -1\n", "gateway.messages_ping_interval", ">= 0"),
    ("[gateway]\nmessages_ping_interval = inf\n", "gateway.messages_ping_interval", ">= 0"),
    ("[gateway]\nmax_image_bytes = 0\n", "gateway.max_image_bytes", ">= 1"),
    ("[gateway]\nmax_sse_line_bytes = 0\n", "gateway.max_sse_line_bytes", ">= 1"),
    ("[gateway]\nmax_sse_line_bytes = -5\n", "gateway.max_sse_line_bytes", ">= 1"),
    ("[gateway]\nmax_keepalive_connections = -1\n", "gateway.max_keepalive_connections", ">= 0"),
    ("[gateway]\ntokens_file = '/nonexistent/tokens'\n", "gateway.tokens_file", "cannot read"),
    ("[models.m]\nengines = ['http://x']\nfallbacks = ['nope']\n",
     "models.m.fallbacks[0]", "unknown model 'nope'"),
    ("[models.m]\nengines = ['http://x']\nfallbacks = [{ pool = 'b' }, { model = 'nope' }]\n",
     "models.m.fallbacks[1]", "unknown model 'nope'"),
    ("[models.m]\nengines = ['http://x']\nfallbacks = ['m']\n",
     "models.m.fallbacks[0]", "falls back to itself"),
    ("[models.m]\nengines = ['http://x']\nfallbacks = [{}]\n",
     "models.m.fallbacks[0]", "name a `model`, a `pool`"),
    ("[models.a]\nengines = ['http://x']\nfallbacks = ['b']\n"
     "[models.b]\nengines = ['http://y']\nfallbacks = ['c']\n"
     "[models.c]\nengines = ['http://z']\nfallbacks = [{ model = 'a', pool = 'p' }]\n",
     "models.a.fallbacks", "cycle (a -> b -> c -> a)"),
    ("[models.m]\nengines = [{ url = 'http://x', discover = 'mdns' }]\n",
     "models.m.engines[0].discover", '"dns"'),
    ("[models.m]\nengines = [{ url = 'http://x', protocol = 'vllm' }]\n",
     "models.m.engines[0].protocol", '"openai", "sglang"'),
    ("[models.m]\nengines = [{ url = 'http://x', discover = 'dns', interval = 0 }]\n",
     "models.m.engines[0].interval", "positive"),
    ("[models.m]\nengines_file = '/nonexistent/engines.txt'\n",
     "models.m.engines_file", "cannot read"),
    ("[gateway]\nload_interval = 0\n", "gateway.load_interval", "positive"),
    ("[models.m]\nengines = ['http://x']\nrouting = 'sticky'\n",
     "models.m.routing", "one of prefix, least_loaded, key_only, cache_aware, not 'sticky'"),
    ("[models.m]\nengines = ['http://x']\nkv_events_port = 5557\n",
     "models.m.kv_events_port", 'routing = "cache_aware" only'),
    ("[models.m]\nengines = ['http://x']\nrouting = 'cache_aware'\nkv_events_port = 0\n",
     "models.m.kv_events_port", "[1, 65535]"),
    ("[models.m]\nengines = ['http://x']\nrouting = 'cache_aware'\nkv_events_replay_port = 70000\n",
     "models.m.kv_events_replay_port", "[1, 65535]"),
    ("[models.m]\nengines = ['http://x']\nrouting = 'cache_aware'\nspill_delay = 0\n",
     "models.m.spill_delay", "positive"),
    ("[models.m]\nengines = ['http://x']\nrouting = 'cache_aware'\nprefill_tokens_per_s = -1\n",
     "models.m.prefill_tokens_per_s", "positive"),
    ("[models.m]\nengines = ['http://x']\nrouting = 'cache_aware'\nkv_events_stale = 0\n",
     "models.m.kv_events_stale", "positive"),
    ("[models.m]\nengines = ['http://x']\nrouting = 'cache_aware'\nspill_batch_share = 1.5\n",
     "models.m.spill_batch_share", "(0, 1]"),
    ("[models.m]\nengines = ['http://x']\nrouting = 'cache_aware'\nmin_match_tokens = -1\n",
     "models.m.min_match_tokens", ">= 0"),
    ("[models.m]\nengines = ['http://x']\nrouting = 'cache_aware'\ncache_tokens = 0\n",
     "models.m.cache_tokens", "positive"),
    ("[models.m]\nengines = [{ url = 'http://x', kv_events = 'tcp://x:1' }]\n",
     "models.m.engines[0].kv_events", 'routing = "cache_aware" only'),
    ("[models.m]\nrouting = 'cache_aware'\n"
     "engines = [{ url = 'http://x', kv_events_replay = 'http://x:1' }]\n",
     "models.m.engines[0].kv_events_replay", "tcp:// or ipc://"),
]  # fmt: skip

#: Files the types or the basic checks refuse.
BAD_FILES = [
    ("[gateway]\nport = 'x'\n", "gateway.port", "Expected `int`"),
    ("[gateway]\nprot = 1\n", "gateway", "unknown key `prot`"),
    ("[gateway]\nport = 70000\n", "gateway.port", "[0, 65535]"),
    ("[gateway]\ntoken_gap_timeout = 0\n", "gateway.token_gap_timeout", "positive"),
    ("[models.m]\nengines = []\n", "models.m.engines", "at least one"),
    ("[models.m]\nengines = ['ftp://x']\n", "models.m.engines[0]", "http(s)"),
    ("[models.m]\nengines = ['http://x']\ninputs = ['audio']\n", "models.m.inputs", "audio"),
    ("[models.m]\nengines = ['http://x']\ntokenizer = '/nonexistent'\n",
     "models.m.tokenizer", "not a directory"),
    ("[models.m]\nengines = ['http://x']\nmax_tool_calls = 0\n",
     "models.m.max_tool_calls", ">= 1"),
    ("[embedded_engine]\nprefix_cache_tokens = -1\n",
     "embedded_engine.prefix_cache_tokens", ">= 0"),
    ("[embedded_engine]\nkind = 'fake'\nprefix_cache_tokens = 64\n",
     "embedded_engine.prefix_cache_tokens", "cpu"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    BAD_FILES + REFUSED_AT_LOAD,
    ids=[k for _, k, _ in BAD_FILES + REFUSED_AT_LOAD],
)
def test_bad_file_names_file_key_problem(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: key `{key}`: ") and problem in msg, msg


def test_zero_is_a_setting_for_admission_wait_and_keepalive(tmp_path: Path) -> None:
    text = (
        "[gateway]\nadmission_wait = 0\nmax_keepalive_connections = 0\n"
        "[models.m]\nengines = ['http://127.0.0.1:9']\n"  # (a file must serve a model)
    )
    g = load_settings(_write(tmp_path, text)).gateway
    assert (g.admission_wait, g.max_keepalive_connections) == (0, 0)


def test_tokenizer_directory_template_is_compiled_at_load(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": BROKEN_TEMPLATE}))
    text = f"[models.m]\nengines = ['http://x']\ntokenizer = '{tok}'\n"
    with pytest.raises(ConfigError, match=r"key `models\.m\.tokenizer`: .*not valid Jinja"):
        load_settings(_write(tmp_path, text))
    (tok / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"key `models\.m\.tokenizer`: .*not readable JSON"):
        load_settings(_write(tmp_path, text))
    (tok / "tokenizer_config.json").unlink()
    (tok / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ConfigError, match=r"key `models\.m\.tokenizer`: .*not readable UTF-8"):
        load_settings(_write(tmp_path, text))
    (tok / "chat_template.jinja").write_text("{{ messages | length }}")
    assert build_state(load_settings(_write(tmp_path, text))).profiles["m"].chat_template


def _one_per_key(cases: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return list({key: (text, key, problem) for text, key, problem in reversed(cases)}.values())


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    _one_per_key(REFUSED_AT_LOAD),
    ids=[k for _, k, _ in _one_per_key(REFUSED_AT_LOAD)],
)
def test_cli_config_refuses_with_one_line(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    """`sieproxy config` (the pre-deployment check) exits 2 with one line naming the key."""
    p = _write(tmp_path, text)
    done = _cli("config", "--config", str(p))
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr.splitlines() == [done.stderr.rstrip("\n")], done.stderr
    assert done.stderr.startswith(f"sieproxy: configuration error: {p}: key `{key}`: ")
    assert problem in done.stderr and "Traceback" not in done.stderr


def test_cli_serve_refuses_before_starting(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "[gateway]\nport = 0\n[models.m]\nengines = ['http://127.0.0.1:9']\n"
        f"chat_template = \"{BROKEN_TEMPLATE}\"\n",
    )
    done = _cli("serve", "--config", str(p), "--host", "127.0.0.1", "--port", "0")
    assert done.returncode == 2, done
    assert done.stderr.startswith(
        f"sieproxy: configuration error: {p}: key `models.m.chat_template`: "
    )
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIEPROXY_", "SIE_"))}
    return subprocess.run(
        [sys.executable, "-m", "sieproxy", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(_write(tmp_path, "[gateway\n"))


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.toml")


def test_embedded_engine_prefix_cache_reaches_the_engine_argv(tmp_path: Path) -> None:
    from sieproxy.operations.child import engine_argv

    text = (
        "[embedded_engine]\nenabled = true\nprefix_cache_tokens = 0\n"
        "extra_args = ['--threads', '1']\n"
    )
    e = load_settings(_write(tmp_path, text)).embedded_engine
    argv = engine_argv(e.model, e.host, e.port, e.served_name, e.engine_args())
    assert argv[-4:] == ["--prefix-cache-tokens", "0", "--threads", "1"]
    default = load_settings(_write(tmp_path, "[embedded_engine]\nenabled = true\n")).embedded_engine
    assert "--prefix-cache-tokens" not in default.engine_args()


def test_fallback_chain_is_followed_depth_first_without_repeats(tmp_path: Path) -> None:
    text = (
        "[models.a]\nengines = ['http://x']\n"
        "fallbacks = ['b', { pool = 'batch' }, 'c']\n"
        "[models.b]\nengines = ['http://y']\nfallbacks = ['c', { pool = 'spare' }]\n"
        "[models.c]\nengines = ['http://z']\nfallbacks = [{ pool = 'p' }]\n"
    )
    s = load_settings(_write(tmp_path, text))
    assert s.fallback_chain("a") == [
        ("b", None), ("c", None), ("c", "p"), ("b", "spare"), ("a", "batch")
    ]
    assert s.fallback_chain("c") == [("c", "p")]


def test_engines_file_lines(tmp_path: Path) -> None:
    f = tmp_path / "engines.txt"
    f.write_text("# fleet\nhttp://10.0.0.1:30000 pool=batch\n\nhttp://10.0.0.2:30000  # new\n")
    text = f"[models.m]\nengines_file = '{f}'\n"
    s = load_settings(_write(tmp_path, text))
    assert s.models["m"].engines == []
    f.write_text("http://10.0.0.1:30000 colour=red\n")
    with pytest.raises(ConfigError) as info:
        load_settings(_write(tmp_path, text))
    assert "models.m.engines_file" in str(info.value) and "line 1" in str(info.value)


@pytest.mark.parametrize(
    ("value", "fast"), [(None, True), ("0", False), ("off", False), ("1", True), ("TRUE", True)]
)
def test_the_fast_paths_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str | None, fast: bool
) -> None:
    """``[gateway] fast_paths`` (on by default), overridden by ``SIEPROXY_FAST_PATHS``."""
    if value is None:
        monkeypatch.delenv("SIEPROXY_FAST_PATHS", raising=False)
    else:
        monkeypatch.setenv("SIEPROXY_FAST_PATHS", value)
    assert load_settings(_write(tmp_path, GOOD)).gateway.fast_paths is fast
    off = GOOD.replace("[gateway]", "[gateway]\nfast_paths = false", 1)
    assert load_settings(_write(tmp_path, off)).gateway.fast_paths is (value is not None and fast)


def test_a_bad_fast_paths_variable_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SIEPROXY_FAST_PATHS", "maybe")
    with pytest.raises(ConfigError, match="SIEPROXY_FAST_PATHS: expected 0 or 1"):
        load_settings(_write(tmp_path, GOOD))


def test_aliases_load(tmp_path: Path) -> None:
    text = "[models.m]\nengines = ['http://x']\naliases = ['claude-*', 'gpt-4o']\n"
    assert load_settings(_write(tmp_path, text)).models["m"].aliases == ["claude-*", "gpt-4o"]
