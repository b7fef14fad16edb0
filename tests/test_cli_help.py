"""The command lines: ``--help`` and ``--version`` of ``sieproxy`` and ``sieproxy-engine`` (plain
text without docstring markup, the defaults, examples), and a failed start as one line."""

from __future__ import annotations

import re
import signal
from pathlib import Path

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


def test_a_port_taken_after_the_check_is_still_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The port checked free by ``claim_ports`` and taken before Hypercorn binds it: the bind's
    error (inside Trio's exception group) is one line and exit status 1, not a traceback."""
    import socket

    from sieproxy.operations import serve as serve_mod

    monkeypatch.setattr(serve_mod, "claim_ports", lambda settings: None)  # lose the race
    monkeypatch.setattr(serve_mod, "tune_gc", lambda: None)
    config = tmp_path / "g.toml"
    config.write_text('[models.m]\nengines = ["http://127.0.0.1:9"]\nchat_template = "x"\n')
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = sieproxy_main(["serve", "--config", str(config), "--port", str(port)])
            # whatever main() leaves must not be inherited: SIG_IGN would survive an exec, and
            # every process started from this one afterwards would ignore SIGTERM
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
            assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        finally:  # main() leaves its exit-time handlers installed
            for sig, handler in saved.items():
                signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith("sieproxy: cannot start: ") and "Traceback" not in err, err
    assert "address already in use" in err.lower() or "in use" in err.lower(), err
