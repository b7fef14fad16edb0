"""The server front's seam (``sieproxy.front.hypercorn_io.install``, ``Pump.run``): where a private
name of Hypercorn or h11 it relies on is missing, the gateway serves on stock Hypercorn and
Quart and says so in one log line; with ``fast_paths`` off it serves on Hypercorn's own I/O
(``PortableTCPServer``) with no relay pump; where there is no epoll the pump is off and the
streams relay from their own tasks. Each way, streamed and whole answers and a refusal are
served correctly."""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import select
from pathlib import Path
from typing import Any

import h11._writers
import hypercorn.trio.run as hypercorn_run
import pytest
from hypercorn.trio.tcp_server import TCPServer as HypercornTCPServer

from engine.fake import FakeEngine, Plan
from sieproxy.front import hypercorn_io
from sieproxy.front.hypercorn_io import PortableTCPServer, TCPServer, fence

from .harness import Gateway, running_gateway, sse_events

TOKENS = [f" t{k}" for k in range(12)]


def _engine() -> FakeEngine:
    return FakeEngine(script=lambda call: Plan(tokens=TOKENS, itl=0.005))


async def _serves_correctly(gw: Gateway) -> None:
    """A streamed chat (every token, then ``[DONE]``), a whole one, and a 400 envelope."""
    r = await gw.chat(max_tokens=len(TOKENS), stream=True)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == "".join(TOKENS)
    r = await gw.chat(max_tokens=len(TOKENS))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == text
    r = await gw.chat(max_tokens=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def _front_lines(caplog: pytest.LogCaptureFixture, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


def _no_chunk_writer(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made: list[int] = []
    init = hypercorn_io.ChunkWriter.__init__

    def counting(self: hypercorn_io.ChunkWriter, *args: Any) -> None:
        made.append(1)
        init(self, *args)

    monkeypatch.setattr(hypercorn_io.ChunkWriter, "__init__", counting)
    return made


def test_the_installed_libraries_have_everything_the_front_relies_on() -> None:
    """On the versions pyproject.toml allows, nothing is missing: an upgrade that drops a name
    fails here, not only as a log line and slower serving."""
    assert hypercorn_io.missing() == []


def _private_names_used(tree: ast.AST) -> set[str]:
    """The single-underscore names ``tree`` reads, writes or calls as an attribute (``x._y``,
    ``getattr(x, "_y")``) or passes as a keyword (``_parsed=``)."""
    used: set[str] = set()
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.keyword):
            name = node.arg
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
        ):
            name = node.args[1].value
        if isinstance(name, str) and name.startswith("_") and not name.startswith("__"):
            used.add(name)
    return used


def _own_private_names(module: Any, tree: ast.AST) -> set[str]:
    """The private attributes the package's own classes in ``module`` define (slots, methods,
    ``self._x =``), less those another library's base class already has (an override of a
    private method is reliance on it, not an own name)."""
    own: dict[str, type] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(module, node.name)
        names = set(getattr(cls, "__slots__", ()))
        for item in ast.walk(node):
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(item.name)
            elif (
                isinstance(item, ast.Attribute)
                and isinstance(item.ctx, ast.Store)
                and isinstance(item.value, ast.Name)
                and item.value.id == "self"
            ):
                names.add(item.attr)
        own.update(dict.fromkeys(names, cls))
    foreign = {
        base
        for cls in own.values()
        for base in cls.__mro__
        if not base.__module__.startswith("sieproxy.") and base is not object
    }
    return {
        name
        for name in own
        if not any(hasattr(base, name) or name in fence._named(base) for base in foreign)
    }


def test_the_fence_lists_every_private_name_the_package_uses() -> None:
    """Every other library's private name that a module of ``sieproxy.front.hypercorn_io``
    touches is one ``missing()`` checks at start (``_RELIED_ON``, ``_PRIVATE``, or h11's
    ``_parsed``, which it tries), and no module imports another library's private module: those
    names are looked up through the fence."""
    checked = {"_parsed"}  # missing() builds an h11.Response with it
    checked |= {name.rsplit(".", 1)[1] for name in fence._PRIVATE}
    for _cls, on_class, on_instances in fence._RELIED_ON:
        checked |= {*on_class, *on_instances}
    package = Path(inspect.getfile(fence)).parent
    modules = sorted(package.glob("*.py"))
    assert {p.stem for p in modules} >= {"__init__", "fence", "connection", "body"}
    trees: dict[str, ast.AST] = {}
    own: set[str] = set()  # the package's own classes' names, usable in any of its modules
    for path in modules:
        name = fence.__package__ + ("" if path.stem == "__init__" else f".{path.stem}")
        trees[name] = tree = ast.parse(path.read_text("utf-8"))
        own |= _own_private_names(importlib.import_module(name), tree)
    unchecked: dict[str, set[str]] = {}
    for name, tree in trees.items():
        private_imports = [
            n.module
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            and n.module
            and not n.level
            and any(part.startswith("_") for part in n.module.split("."))
            and n.module != "__future__"
        ]
        assert private_imports == [], f"{name} imports private modules: {private_imports}"
        gaps = _private_names_used(tree) - own - checked
        if gaps:
            unchecked[name] = gaps
    assert unchecked == {}


@pytest.mark.parametrize(
    ("simulate", "named"),
    [
        (
            lambda mp: mp.delattr(HypercornTCPServer, "_initiate_server_close"),
            "hypercorn.trio.tcp_server.TCPServer._initiate_server_close",
        ),
        (lambda mp: mp.delattr(h11._writers, "ChunkedWriter"), "h11._writers.ChunkedWriter"),
    ],
    ids=["a-hypercorn-method", "an-h11-module-name"],
)
async def test_a_missing_private_name_falls_back_to_stock_hypercorn_in_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, simulate: Any, named: str
) -> None:
    caplog.set_level(logging.INFO, logger="sieproxy")
    simulate(monkeypatch)
    assert hypercorn_io.missing() == [named]
    made = _no_chunk_writer(monkeypatch)
    async with running_gateway(_engine()) as gw:
        assert hypercorn_run.TCPServer is HypercornTCPServer  # type: ignore[attr-defined]
        await _serves_correctly(gw)
    lines = _front_lines(caplog, "server front:")
    assert len(lines) == 1 and "stock Hypercorn and Quart" in lines[0] and named in lines[0]
    assert "\n" not in lines[0]
    assert made == []  # no fast path: Hypercorn framed every body


async def test_with_the_fast_paths_off_hypercorn_does_the_io_and_no_pump_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sieproxy")
    made = _no_chunk_writer(monkeypatch)
    async with running_gateway(_engine(), fast_paths=False) as gw:
        assert hypercorn_run.TCPServer is PortableTCPServer  # type: ignore[attr-defined]
        await _serves_correctly(gw)
        assert not gw.state.pump.running
    assert made == []
    lines = _front_lines(caplog, "server front:")
    assert len(lines) == 1 and "fast paths off" in lines[0]


async def test_without_epoll_the_pump_is_off_and_streams_relay_from_their_tasks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sieproxy")
    monkeypatch.delattr(select, "epoll")
    async with running_gateway(_engine(), fast_paths=True) as gw:
        assert hypercorn_run.TCPServer is TCPServer  # type: ignore[attr-defined]
        await _serves_correctly(gw)
        assert not gw.state.pump.running
    assert len(_front_lines(caplog, "relay pump: off (no epoll")) == 1


async def test_serving_puts_the_workers_class_back() -> None:
    before = hypercorn_run.TCPServer  # type: ignore[attr-defined]
    async with running_gateway(_engine(), fast_paths=True):
        assert hypercorn_run.TCPServer is TCPServer  # type: ignore[attr-defined]
    assert hypercorn_run.TCPServer is before  # type: ignore[attr-defined]


@pytest.mark.parametrize("fast", [True, False])
async def test_the_apps_queue_is_the_gateways_only_with_the_fast_paths(
    monkeypatch: pytest.MonkeyPatch, fast: bool
) -> None:
    """The queue between a connection and its app (``_spawn_app``, set on each connection's own
    task group, not on Hypercorn's module): the route reads a queued body through
    ``Receive.nowait`` with the fast paths on, and Hypercorn's own queue with them off."""
    reads: list[int] = []
    nowait = hypercorn_io.Receive.nowait

    def counting(self: hypercorn_io.Receive) -> Any:
        reads.append(1)
        return nowait(self)

    monkeypatch.setattr(hypercorn_io.Receive, "nowait", counting)
    async with running_gateway(_engine(), fast_paths=fast) as gw:
        r = await gw.chat(max_tokens=2)
        assert r.status_code == 200
    assert bool(reads) is fast
