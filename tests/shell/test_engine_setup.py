"""A broken engine setup is refused at start, or reported as failed with its reason.

- ``sieproxy config`` / ``serve`` run the embedded engine's own argument parser (and, for the
  CPU engine, the model's lookup) on its command line, starting nothing, and refuse naming
  ``embedded_engine.model`` or ``embedded_engine.extra_args`` (``sieproxy.engine_check``);
- a settings file that serves no model is refused (``models``);
- an engine that exits during start-up is reported once with its last lines of stderr, and
  after a bounded number of failed starts the model is ``failed``: its requests get
  ``503 engine_failed`` (with Retry-After) saying so, ``/readyz`` names it and the reason
  (``sieproxy.child``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from sieproxy.operations.child import supervise_child
from sieproxy.operations.serve import build_app, serve
from sieproxy.settings.load import load_settings
from tests.procs import free_port


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIEPROXY_", "SIE_"))}
    return subprocess.run(
        [sys.executable, "-m", "sieproxy", *argv],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


def _file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sieproxy.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("engine", "key", "problem"),
    [
        ('kind = "cpu"\nmodel = "/nonexistent"', "embedded_engine.model", "not found"),
        ('kind = "cpu"\nextra_args = ["--threads", "abc"]', "embedded_engine.extra_args",
         "--threads: invalid int value: 'abc'"),
        ('kind = "fake"\nextra_args = ["--no-such-flag"]', "embedded_engine.extra_args",
         "unrecognized arguments: --no-such-flag"),
    ],
    ids=["cpu-model", "cpu-extra-args", "fake-extra-args"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["config", "serve"])
def test_the_engines_own_parser_refuses_at_start(
    tmp_path: Path, engine: str, key: str, problem: str, command: str
) -> None:
    p = _file(tmp_path, f"[embedded_engine]\nenabled = true\n{engine}\n")
    args = ["--host", "127.0.0.1", "--port", str(free_port())] if command == "serve" else []
    done = _cli(command, "--config", str(p), *args)
    assert done.returncode == 2, done
    assert done.stderr.startswith(f"sieproxy: configuration error: {p}: key `{key}`: "), done
    assert problem in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "started" not in done.stderr  # nothing was started


def test_a_good_engine_setup_passes(tmp_path: Path) -> None:
    p = _file(tmp_path, '[embedded_engine]\nenabled = true\nkind = "fake"\n'
                        'extra_args = ["--itl-ms", "5"]\n')  # fmt: skip
    done = _cli("config", "--config", str(p))
    assert done.returncode == 0, done.stderr


def test_a_settings_file_with_no_model_is_refused(tmp_path: Path) -> None:
    p = _file(tmp_path, "[gateway]\nport = 0\n")
    done = _cli("config", "--config", str(p))
    assert done.returncode == 2, done
    assert done.stderr.startswith(f"sieproxy: configuration error: {p}: key `models`: ")
    assert "no model is served" in done.stderr


CRASH = "import sys; print('starting'); print('error: no such GPU', file=sys.stderr); sys.exit(3)"


async def test_failed_starts_are_reported_once_then_the_child_is_given_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sieproxy.child")
    reasons: list[str] = []
    with trio.fail_after(60):
        await supervise_child(
            [sys.executable, "-c", CRASH], name="test-engine", backoff=0.01,
            ready=lambda: False, max_failed_starts=3, on_failed=reasons.append,
        )  # fmt: skip
    assert reasons == ["the engine exited during start-up 3 times in a row (last exit code 3)"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors  # the first failure with its lines, then the give-up
    assert "exited during start-up (code 3;" in errors[0] and "error: no such GPU" in errors[0]
    assert "stays down" in errors[1]
    again = [r.getMessage() for r in caplog.records if "again" in r.getMessage()]
    assert len(again) == 1 and "error: no such GPU" not in again[0]  # the second start


async def test_a_child_that_was_ready_is_restarted_and_its_count_reset() -> None:
    reasons: list[str] = []
    starts = 0
    with trio.move_on_after(60) as scope:

        def ready() -> bool:
            nonlocal starts
            starts += 1
            if starts == 5:
                scope.cancel()  # enough restarts seen
            return starts % 2 == 0  # every other launch became ready: never 2 failures in a row

        await supervise_child(
            [sys.executable, "-c", "pass"], name="test-engine", backoff=0.01,
            ready=ready, max_failed_starts=2, on_failed=reasons.append,
        )  # fmt: skip
    assert reasons == [] and starts == 5


async def test_a_model_whose_engine_failed_answers_503_engine_failed(tmp_path: Path) -> None:
    # The fake engine's parser takes the host; binding it fails at start-up, every time.
    p = _file(tmp_path, '[gateway]\nhost = "127.0.0.1"\nport = 0\nhealth_interval = 0.1\n'
                        '[embedded_engine]\nenabled = true\nkind = "fake"\n'
                        'extra_args = ["--host", "256.0.0.1"]\n')  # fmt: skip
    settings = load_settings(p)
    app = build_app(settings)
    state = app.extensions["sieproxy"]
    model = settings.embedded_engine.served_name
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        binds = await nursery.start(partial(serve, settings, shutdown_trigger=stop, app=app))
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as client:
            with trio.fail_after(120):  # three failed starts, 1 s and 2 s apart
                while state.pools[model].failed is None:
                    await trio.sleep(0.1)
            r = await client.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            err = r.json()["error"]
            assert err["code"] == "engine_failed", err
            assert "failed" in err["message"] and "exited during start-up" in err["message"]
            assert "retry shortly" not in err["message"]
            ready = await client.get("/readyz")
            assert ready.status_code == 503
            assert "exited during start-up" in ready.json()["failed"][model]
        stop.set()
