"""The keys file: hashes only, refused with the line named, `sieproxy keys add|list|revoke`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sieproxy.cli import main
from sieproxy.core.errors import AuthenticationError
from sieproxy.core.tenancy.quota import Limits
from sieproxy.front.auth import Authenticator
from sieproxy.settings.keys import parse_keys
from sieproxy.settings.load import ConfigError, load_settings
from tests.tenancy.conftest import key_line, write_keys

SERVED = {"m1", "m2"}


def test_a_key_maps_to_its_tenant_models_priority_and_limits() -> None:
    text = "\n".join([
        "# team A's keys",
        key_line("ka", "team-a", models=["m1"], rpm=10, tpm=1000, concurrency=2),
        "",
        key_line("kb", "team-b", priority="batch", weight=2.0),
    ])  # fmt: skip
    keys = parse_keys(text, "k.jsonl", SERVED)
    a = keys[hashlib.sha256(b"ka").hexdigest()]
    assert a.tenant.name == "team-a" and a.tenant.limits == Limits(10, 1000, 2)
    assert a.may_use("m1") and not a.may_use("m2")
    b = keys[hashlib.sha256(b"kb").hexdigest()]
    assert b.tenant.priority == "batch" and b.tenant.weight == 2.0 and b.models is None
    assert b.tenant.limits.unlimited


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ('{"id": "x", "sha256": "abc", "tenant": "t"}', "64 lower-case hex"),
        (key_line("k1", "t").replace('"sha256": "', '"sha256": "G'), "64 lower-case hex"),
        (key_line("k0", "t"), "the same key (hash) as line 1"),
        (key_line("k1", "t", models=["m3"]), "'m3' is not a served model"),
        (key_line("k1", "t", rpm=0), "`rpm` must be >= 1"),
        (key_line("k1", "t", priority="urgent"), "`priority` must be one of"),
        (key_line("k1", "t", rpm=5), "every key of a tenant must give the same"),
        (key_line("k1", "t a"), "`tenant` must be"),
        (key_line("k1", "t", plan="gold"), "unknown field `plan`"),
        ("not json", "not a JSON object"),
        (key_line("k1", "t").replace("key-", "key-X").replace('"id": "key-X', '"id": "key-'), ""),
    ],
)
def test_a_hostile_line_refuses_the_file_naming_the_line(bad: str, why: str) -> None:
    text = key_line("k0", "t") + "\n# comment\n" + bad + "\n"
    if not why:  # the same id as line 1
        first = json.loads(key_line("k0", "t"))
        line = json.loads(key_line("k1", "t"))
        line["id"] = first["id"]
        text = key_line("k0", "t") + "\n# comment\n" + json.dumps(line) + "\n"
        why = "the same `id` as line 1"
    with pytest.raises(ConfigError) as exc:
        parse_keys(text, "keys.jsonl", SERVED)
    assert "keys.jsonl: line 3: " in str(exc.value) and why in str(exc.value), str(exc.value)


def _config(tmp: Path, keys: Path) -> Path:
    cfg = tmp / "gw.toml"
    cfg.write_text(
        f'[gateway]\nkeys_file = "{keys}"\n\n[models.m1]\nengines = ["http://127.0.0.1:9"]\n'
        'chat_template = "{{ messages }}"\n'
    )
    return cfg


def test_a_hostile_file_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = write_keys(tmp_path / "keys.jsonl", key_line("k0", "t"), key_line("k0", "u"))
    with pytest.raises(ConfigError, match=r"line 2: the same key \(hash\) as line 1"):
        load_settings(_config(tmp_path, keys))
    assert main(["config", "--config", str(_config(tmp_path, keys))]) == 2
    assert "line 2" in capsys.readouterr().err


def test_keys_commands_add_list_revoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys.jsonl"
    cfg = _config(tmp_path, keys)
    assert main(["keys", "add", "--config", str(cfg), "--tenant", "team-a", "--rpm", "60",
                 "--tpm", "5000", "--models", "m1"]) == 0  # fmt: skip
    key = capsys.readouterr().out.strip()
    assert key.startswith("sk-sie-") and len(key) > 40
    text = keys.read_text()
    assert key not in text and hashlib.sha256(key.encode()).hexdigest() in text
    assert keys.stat().st_mode & 0o077 == 0  # private to its owner
    # a second key of the tenant takes its limits
    assert main(["keys", "add", "--config", str(cfg), "--tenant", "team-a"]) == 0
    key2 = capsys.readouterr().out.strip()
    s = load_settings(cfg)
    auth = Authenticator(False, [], parse_keys(keys.read_text(), "k", {"m1"}))
    for k in (key, key2):
        entry = auth.check(f"Bearer {k}".encode())
        assert entry is not None and entry.tenant.limits == Limits(60, 5000, None)
    assert s.gateway.keys_file == str(keys)
    assert main(["keys", "list", "--config", str(cfg)]) == 0
    listed = capsys.readouterr().out
    assert "team-a" in listed and key not in listed and key2 not in listed
    ids = [json.loads(ln)["id"] for ln in keys.read_text().splitlines()]
    assert all(i in listed for i in ids)
    # an unknown model or a bad limit is refused, the file unchanged
    assert main(["keys", "add", "--config", str(cfg), "--tenant", "b", "--models", "nope"]) == 2
    assert "'nope' is not a served model" in capsys.readouterr().err
    assert len(keys.read_text().splitlines()) == 2
    # revoke one key by id, then the tenant's others
    assert main(["keys", "revoke", ids[0], "--config", str(cfg)]) == 0
    auth = Authenticator(False, [], parse_keys(keys.read_text(), "k", {"m1"}))
    with pytest.raises(AuthenticationError):
        auth.check(f"Bearer {key}".encode())
    assert auth.check(f"Bearer {key2}".encode()) is not None
    assert main(["keys", "revoke", "team-a", "--config", str(cfg)]) == 0
    assert keys.read_text() == ""
    assert main(["keys", "revoke", "team-a", "--config", str(cfg)]) == 1


def test_old_tokens_are_tenants_with_no_limits() -> None:
    auth = Authenticator(True, [b"old-token"])
    entry = auth.check(b"Bearer old-token")
    assert entry is not None and entry.tenant.limits.unlimited and entry.models is None
    assert entry.tenant.name == "token-" + hashlib.sha256(b"old-token").hexdigest()[:8]


def test_redis_url_and_batch_promote_after_are_checked(tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys.jsonl", key_line("k0", "t"))
    cfg = _config(tmp_path, keys)
    text = cfg.read_text()
    cfg.write_text(text.replace("[gateway]\n", '[gateway]\nredis_url = "http://x"\n'))
    with pytest.raises(ConfigError, match=r"gateway\.redis_url"):
        load_settings(cfg)
    cfg.write_text(text.replace("[gateway]\n", "[gateway]\nbatch_promote_after = 0\n"))
    with pytest.raises(ConfigError, match=r"gateway\.batch_promote_after"):
        load_settings(cfg)
    cfg.write_text(text.replace("[gateway]\n", '[gateway]\nredis_url = "redis://h:6379/0"\n'))
    assert load_settings(cfg).gateway.redis_url == "redis://h:6379/0"


def test_a_keys_file_turns_auth_on() -> None:
    auth = Authenticator(False, [], parse_keys(key_line("k0", "t"), "k", SERVED))
    with pytest.raises(AuthenticationError):
        auth.check(None)
    entry = auth.check(b"Bearer k0")
    assert entry is not None and entry.tenant.name == "t"
