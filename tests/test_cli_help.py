"""``--help`` and ``--version`` of ``sieproxy`` and ``sieproxy-engine``: plain text (no
reStructuredText markup from docstrings), the defaults, and examples."""

from __future__ import annotations

import re

import pytest

from engine.cli import main as engine_main
from sieproxy import __version__
from sieproxy.cli import main as sieproxy_main


def _run(main: object, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = main(argv)  # type: ignore[operator]
    except SystemExit as exc:  # argparse's --help / --version
        code = exc.code
    assert code in (0, None)
    return str(capsys.readouterr().out)


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["config", "--help"]])
def test_sieproxy_help_is_plain_with_defaults(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(sieproxy_main, argv, capsys)
    assert "``" not in out and ":func:" not in out, out
    if argv[0] in ("serve", "config"):
        assert "--config FILE" in out, out
    if argv[0] != "config":
        assert "examples:" in out and "sieproxy serve --port 8001" in out, out
    if argv[0] == "serve":
        assert "(default: gateway.port, 8000)" in out, out


def test_engine_help_is_plain_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(engine_main, ["--help"], capsys)
    assert "``" not in out, out
    assert "examples:" in out and "sieproxy-engine serve --port 30000" in out, out
    for command in ("serve", "prepare", "fake", "launch"):
        assert f"  {command} " in out, command


def test_versions(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(sieproxy_main, ["--version"], capsys).strip() == f"sieproxy {__version__}"
    assert _run(engine_main, ["--version"], capsys).strip().startswith("sieproxy-engine ")


@pytest.mark.parametrize("command", ["serve", "prepare", "fake", "launch"])
def test_engine_command_help_shows_defaults_and_an_example(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _run(engine_main, [command, "--help"], capsys)
    assert "``" not in out, out
    assert "example: sieproxy-engine " + command in out, out
    assert "(default: " in out, out
    assert not re.search(r"\(default[^)]*\)\s*\(default", out), out  # said once per option
    assert f"usage: sieproxy-engine {command}" in out
