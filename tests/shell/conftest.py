"""The server front's two ways: the shell's HTTP, streaming, fault and disconnect modules run
twice, with the fast paths on and off (``SIEPROXY_FAST_PATHS=0``, read by the harness and by
every gateway process a test starts), so the portable path (Hypercorn's own I/O, no relay pump:
what a platform without epoll gets) stays correct. Every other module runs with them on,
whatever the environment says (the fast paths' own tests need them)."""

from __future__ import annotations

import pytest

#: The modules run both ways (``test_x[nofast]`` is the portable run of ``test_x``).
BOTH_WAYS = frozenset(
    (
        "test_contract_http",
        "test_faults",
        "test_hostile",
        "test_http_edges",
        "test_messages_ping",
        "test_openai_sdk",
        "test_relay_merge",
        "test_relay_open",
        "test_shutdown",
        "test_smoke",
        "test_streaming",
    )
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "front" in metafunc.fixturenames and metafunc.module.__name__.rsplit(".")[-1] in BOTH_WAYS:
        metafunc.parametrize("front", ["fast", "nofast"], indirect=True)


@pytest.fixture(autouse=True)
def front(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``fast`` or ``nofast``: the server front the test's gateways use."""
    mode: str = getattr(request, "param", "fast")
    if mode == "nofast":
        monkeypatch.setenv("SIEPROXY_FAST_PATHS", "0")
    else:
        monkeypatch.delenv("SIEPROXY_FAST_PATHS", raising=False)
    return mode
