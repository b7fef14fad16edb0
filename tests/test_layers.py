"""The package tree is the architecture: a module's folder says which layer it is in, and a
layer imports only the layers below it (docs/DESIGN.md, "Layers").

From the bottom: ``core`` (sans-IO, imports nothing of the shell: tests/test_import_ban.py),
``surfaces`` (sans-IO too, checked with the core: each API surface on the core),
``settings``, ``tenancy`` (a tenant's limits, counters and fair-share queue), ``fleet``
(replicas, routing, the upstream client), ``observe`` (metrics, the
access log), ``relay`` (one request's structured concurrency), ``front`` (intake, the app,
the fenced server front), ``operations`` (serving, signals, the engine child). The package
root holds only the entry points (``cli``, ``asgi``, ``__main__``), which may import anything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_import_ban import PKG, _imports, _module_name

#: Each layer and the layers it may import (besides itself).
MAY_IMPORT: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "surfaces": frozenset({"core"}),
    "settings": frozenset({"core"}),
    "tenancy": frozenset({"core", "settings"}),
    "fleet": frozenset({"core", "settings", "tenancy"}),
    "observe": frozenset({"core", "settings", "tenancy", "fleet"}),
    "relay": frozenset({"core", "settings", "tenancy", "fleet", "observe"}),
    "front": frozenset({"core", "surfaces", "settings", "tenancy", "fleet", "observe", "relay"}),
    "operations": frozenset(
        {"core", "surfaces", "settings", "tenancy", "fleet", "observe", "relay", "front"}
    ),
}
#: The package root: entry points and the version, nothing else.
ROOT_MODULES = frozenset({"__init__", "__main__", "asgi", "cli"})


def _layer(module: str) -> str | None:
    """The layer of ``sieproxy.<layer>...``; None for a module at the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PKG / parts[-1]).is_dir() else None


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_is_in_a_layer_or_an_entry_point() -> None:
    strays = []
    for path in _modules():
        rel = path.relative_to(PKG)
        if len(rel.parts) == 1:
            if path.stem not in ROOT_MODULES:
                strays.append(str(rel))
        elif rel.parts[0] not in MAY_IMPORT:
            strays.append(str(rel))
    assert not strays, f"modules outside the layers (docs/DESIGN.md): {strays}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_a_layer_imports_only_the_layers_below_it(path: Path) -> None:
    own = _module_name(path)
    layer = _layer(own)
    if layer is None:
        return  # an entry point
    allowed = MAY_IMPORT[layer] | {layer}
    bad = []
    for imp in _imports(path):
        if not imp.module.startswith("sieproxy."):
            continue
        target = _layer(imp.module)
        if target is None:
            # the package root: only its version is importable from a layer
            if imp.module not in ("sieproxy.__version__",) and imp.module != "sieproxy":
                bad.append(f"{own}:{imp.line} imports {imp.module} (an entry point)")
        elif target not in allowed:
            bad.append(f"{own}:{imp.line} imports {imp.module} ({layer} → {target})")
    assert not bad, "\n".join(bad)


def test_the_rules_catch_an_upward_import(tmp_path: Path) -> None:
    """The check itself: a fleet module that imports the relay is reported."""
    pkg = tmp_path / "sieproxy"
    (pkg / "fleet").mkdir(parents=True)
    (pkg / "relay").mkdir()
    for d in (pkg, pkg / "fleet", pkg / "relay"):
        (d / "__init__.py").write_text("", "utf-8")
    (pkg / "relay" / "body.py").write_text("X = 1\n", "utf-8")
    bad = pkg / "fleet" / "pool.py"
    bad.write_text("from ..relay.body import X\n", "utf-8")
    found = [i.module for i in _imports(bad, tmp_path)]
    assert "sieproxy.relay.body" in found
    assert _layer("sieproxy.relay.body") not in MAY_IMPORT["fleet"]
