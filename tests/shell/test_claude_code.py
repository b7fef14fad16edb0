"""Claude Code itself against the gateway: ``claude -p`` (print mode) with ``ANTHROPIC_BASE_URL``
at a gateway in front of a scripted fake engine, a dummy ``ANTHROPIC_API_KEY`` and the model
names it asks for (``claude-opus-4-8``, ...) served through a ``claude-*`` alias.

The npm package ``@anthropic-ai/claude-code`` (pinned below, the version docs/API.md describes)
is installed into a temporary directory with npm, so the test needs node, npm and the npm registry
(or npm's cache): it skips, saying why, where npm cannot fetch the package in time. The fake
engine answers the first turn with a ``Bash`` tool call in the model's hermes format and the next
turn, which carries the tool's output in a ``tool_result``, with text: Claude Code runs the
command and prints the answer, a whole tool round trip through ``/v1/messages?beta=true``,
streamed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from engine.fake import Call, FakeEngine, Plan
from sieproxy.settings.load import Settings

from .harness import MODEL, running_gateway

pytestmark = pytest.mark.slow

VERSION = "2.1.197"
CALL = (
    '<tool_call>{"name":"Bash","arguments":{"command":"echo hi-from-tool",'
    '"description":"Say hi"}}</tool_call>'
)
ANSWER = ["The", " command", " printed", " hi-from-tool."]


# npm's own waits, so an unreachable registry ends in an error instead of a stall.
NPM_NET = ["--prefer-offline", "--fetch-timeout=30000", "--fetch-retries=1"]


def _npm(args: list[str], timeout: float, what: str) -> None:
    """Run npm; skip the test, saying why, where npm cannot get the package (no registry, no
    cache, a download that does not finish in ``timeout`` seconds): that is the machine's network,
    never the gateway's behaviour."""
    try:
        done = subprocess.run(
            ["npm", *args, *NPM_NET], capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm could not {what} in {timeout:.0f} s (the npm registry is slow or away)")
    if done.returncode != 0:
        said = " / ".join(done.stderr.strip().splitlines()[:2])
        pytest.skip(f"npm could not {what}: {said}")


@pytest.fixture
def claude(tmp_path: Path) -> Path:
    """Claude Code's native binary, installed under ``tmp_path`` before the test's Trio run
    starts (so a skip keeps its reason)."""
    tmp = tmp_path / "npm"
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to run Claude Code")
    package = f"@anthropic-ai/claude-code@{VERSION}"
    _npm(["view", package, "version"], 120, f"reach the registry for {package}")
    _npm(
        ["install", "--no-audit", "--no-fund", "--prefix", str(tmp), package], 900,
        f"install {package}",
    )  # fmt: skip
    # The package's postinstall copies the platform's native binary over a placeholder; npm may
    # not run install scripts, so the binary is taken from its platform package directly.
    found = sorted(tmp.glob("node_modules/@anthropic-ai/claude-code-*/claude"))
    assert found, "no native claude binary was installed"
    return found[0]


def _script(seen: list[dict[str, Any]]) -> Any:
    def script(call: Call) -> Plan:
        seen.append(call.body)
        prompt = call.prompt if isinstance(call.prompt, str) else ""
        if "hi-from-tool" in prompt:  # the tool ran: its output came back
            return Plan(tokens=ANSWER)
        return Plan(tokens=["I", " will", " run", " it.", "\n", CALL[:40], CALL[40:90], CALL[90:]])

    return script


def _aliases(s: Settings) -> None:
    s.models[MODEL].aliases = ["claude-*"]
    s.models[MODEL].tool_parser = "hermes"


@pytest.mark.timeout(1500)  # the install's 900 s and Claude Code's 300 s, with room to spare
async def test_claude_code_completes_a_tool_turn(claude: Path, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    engine = FakeEngine(script=_script(seen))
    home = tmp_path / "home"
    home.mkdir()
    async with running_gateway(engine, settings_hook=_aliases) as gw:
        with trio.fail_after(10):
            while gw.state.profiles[MODEL].context_length is None:  # learned from the engine
                await trio.sleep(0.02)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": gw.url,
            "ANTHROPIC_API_KEY": "dummy",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
        with trio.fail_after(300):
            done = await trio.run_process(
                [str(claude), "-p", "run echo", "--allowedTools", "Bash(echo:*)"],
                env=env, cwd=str(tmp_path), capture_stdout=True, capture_stderr=True,
                check=False,
            )  # fmt: skip
    out = done.stdout.decode()
    assert done.returncode == 0, (out, done.stderr.decode()[-2000:])
    assert "hi-from-tool" in out
    # One generation per turn: the call, then the answer to its result (both streamed).
    assert len(seen) == 2 and all(b["stream"] for b in seen), json.dumps(seen)[:500]
    assert "hi-from-tool" in seen[1]["text"]
    assert seen[0]["sampling_params"]["max_new_tokens"] is None  # 32000/64000: capped to fit
