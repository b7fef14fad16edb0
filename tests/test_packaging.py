"""The serve environment's declaration: the engine's packages only, and a Ctrl-C that drains.

``tox -e serve`` is the README's way to run the gateway. Its environment must not pull the test
tools, must let the user point pip at PyTorch's CPU-only index (``PIP_EXTRA_INDEX_URL``), and
must give the gateway time to drain on Ctrl-C instead of tox's default 0.3 s before SIGTERM.
"""

from __future__ import annotations

import configparser
import re
import tomllib
from pathlib import Path

from sieproxy.settings.load import GatewaySettings

ROOT = Path(__file__).resolve().parent.parent
TEST_ONLY = {"pytest", "pytest-trio", "schemathesis", "hypothesis", "pip-audit", "peft", "openai"}


def _tox() -> configparser.ConfigParser:
    ini = configparser.ConfigParser(interpolation=None)
    ini.read(ROOT / "tox.ini")
    return ini


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def _lines(value: str) -> list[str]:
    return [v.strip() for v in value.splitlines() if v.strip() and not v.strip().startswith("#")]


def test_serve_env_installs_the_engine_extras_only() -> None:
    serve = _tox()["testenv:serve"]
    assert _lines(serve["extras"]) == ["cpu"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert not _names(extras["cpu"]) & TEST_ONLY
    assert _names(extras["test"]) >= TEST_ONLY  # they do exist, in the test extra
    assert "deps" not in serve


def test_pip_settings_reach_the_serve_env() -> None:
    """``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu tox -e serve`` works."""
    ini = _tox()
    serve = ini["testenv:serve"]
    passenv = _lines(serve.get("passenv", ini["testenv"]["passenv"]))
    assert "PIP_*" in passenv
    assert "install_command" not in serve and "install_command" not in ini["testenv"]


def test_tox_waits_for_the_drain_on_ctrl_c() -> None:
    g = GatewaySettings()
    serve = _tox()["testenv:serve"]
    needed = g.shutdown_grace + g.abort_timeout + 1 + 10  # drain, aborts, engine stop
    assert float(serve["suicide_timeout"]) >= needed
    assert float(serve["interrupt_timeout"]) >= needed


def test_serve_env_stops_with_tox() -> None:
    """A SIGKILLed tox leaves no gateway behind (``SIEPROXY_EXIT_WITH_PARENT``)."""
    ini = _tox()
    setenv = _lines(ini["testenv:serve"]["setenv"])
    assert "SIEPROXY_EXIT_WITH_PARENT = 1" in setenv
    assert "{[testenv]setenv}" in setenv  # the common settings stay
