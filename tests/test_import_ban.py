"""Architecture rules checked on the source.

1. ``sieproxy/core`` and ``sieproxy/surfaces`` are sans-IO: no module in them, nor any module
   of the ``sieproxy`` package it imports (absolute or relative, followed transitively),
   imports an I/O or concurrency library (trio, httpx, quart, quart_trio, hypercorn, anyio,
   socket, asyncio, ...) or has logging side effects (configuring logging, or logging at import
   time; a ``getLogger`` is fine). Checked statically (ast) and at run time (a fresh
   interpreter that imports every core module must not have loaded any of them).
2. Public surface: every module of ``sieproxy/`` and its subpackages defines ``__all__`` as a
   literal list of strings, without duplicates, and every listed name exists in the module.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "sieproxy"
CORE = PKG / "core"

BANNED = frozenset(
    {
        "trio",
        "httpx",
        "httpcore",
        "h11",
        "quart",
        "quart_trio",
        "hypercorn",
        "werkzeug",
        "anyio",
        "socket",
        "ssl",
        "asyncio",
        "selectors",
        "threading",
        "subprocess",
        "multiprocessing",
        "prometheus_client",
    }
)
#: Checked at run time: the I/O stack proper. (``threading`` is loaded by the standard library
#: and third-party dependencies themselves, so only the static check can hold core to it.)
BANNED_AT_RUN_TIME = BANNED - {"threading"}
#: Calls that configure logging (a side effect, even if ``logging`` came in indirectly).
LOGGING_SIDE_EFFECTS = frozenset(
    {"basicConfig", "addHandler", "setLevel", "disable", "captureWarnings", "dictConfig"}
)


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_file(name: str, root: Path = ROOT) -> Path | None:
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name
    line: int


def _imports(path: Path, root: Path = ROOT) -> list[Import]:
    """Every import in ``path`` (module level or not), resolved to absolute dotted names.

    ``from pkg import name`` yields both ``pkg`` and ``pkg.name`` (the name may be a module).
    """
    tree = ast.parse(path.read_text("utf-8"), filename=str(path))
    own = _module_name(path, root)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: -(node.level - 1)]
                base = ".".join(base_parts)
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod == "__future__":
                continue
            out.append(Import(mod, node.lineno))
            out += [Import(f"{mod}.{a.name}", node.lineno) for a in node.names if a.name != "*"]
    return out


def _dynamic_imports(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text("utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if name in ("__import__", "import_module"):
                found.append(f"{path.relative_to(root)}:{node.lineno}: dynamic import")
            if isinstance(f, ast.Attribute) and f.attr in LOGGING_SIDE_EFFECTS:
                owner = ast.unparse(f.value)
                if "log" in owner.lower():
                    found.append(
                        f"{path.relative_to(root)}:{node.lineno}: logging side effect "
                        f"{owner}.{f.attr}()"
                    )
    for node in tree.body:  # import-time statements
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            if isinstance(f, ast.Attribute) and "log" in ast.unparse(f.value).lower():
                found.append(
                    f"{path.relative_to(root)}:{node.lineno}: logs at import time "
                    f"({ast.unparse(f)}())"
                )
    return found


def _core_modules() -> list[Path]:
    """Every sans-IO module: the core and the API surfaces built on it."""
    return sorted([*CORE.rglob("*.py"), *(PKG / "surfaces").rglob("*.py")])


def _violations(start: Path, root: Path = ROOT) -> list[str]:
    """Banned imports reachable from ``start`` through modules of the ``sieproxy`` package."""
    seen: set[Path] = set()
    stack: list[tuple[Path, tuple[str, ...]]] = [(start, (_module_name(start, root),))]
    bad: list[str] = []
    while stack:
        path, chain = stack.pop()
        if path in seen:
            continue
        seen.add(path)
        bad += [f"{' -> '.join(chain)}: {d}" for d in _dynamic_imports(path, root)]
        # Importing a module runs its package's __init__ too.
        parents = []
        name = _module_name(path, root)
        while "." in name:
            name = name.rpartition(".")[0]
            parents.append(name)
        for imp in [*_imports(path, root), *(Import(p, 0) for p in parents)]:
            top = imp.module.split(".")[0]
            if top in BANNED:
                bad.append(
                    f"{' -> '.join(chain)}: line {imp.line} imports {imp.module!r} (not sans-IO)"
                )
            elif top == "sieproxy":
                target = _module_file(imp.module, root)
                if target is not None and target not in seen:
                    stack.append((target, (*chain, imp.module)))
    return bad


def test_core_modules_found() -> None:
    names = {p.stem for p in _core_modules()}
    assert {"validate", "plan", "merger", "prepared", "errors", "sse"} <= names


@pytest.mark.parametrize("path", _core_modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_core_is_sans_io(path: Path) -> None:
    bad = _violations(path)
    assert not bad, "\n".join(bad)


def test_import_walker_catches_escapes(tmp_path: Path) -> None:
    """The walker itself, on a scratch package: relative imports out of core are followed
    (through package ``__init__`` files too), and logging side effects are caught."""
    pkg = tmp_path / "sieproxy"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("", "utf-8")
    (pkg / "core" / "__init__.py").write_text("", "utf-8")
    (pkg / "io_side.py").write_text("import trio.lowlevel\n", "utf-8")
    (pkg / "helpers.py").write_text("from . import io_side\n", "utf-8")
    (pkg / "core" / "clean.py").write_text("import json\nfrom . import pure\n", "utf-8")
    (pkg / "core" / "pure.py").write_text("import logging\nlog = logging.getLogger(__name__)\n")
    (pkg / "core" / "escape.py").write_text("from ..helpers import thing\n", "utf-8")
    (pkg / "core" / "absolute.py").write_text("import sieproxy.io_side as s\n", "utf-8")
    (pkg / "core" / "direct.py").write_text("from socket import socket\n", "utf-8")
    (pkg / "core" / "noisy.py").write_text(
        "import logging\nlogging.basicConfig()\nlog = logging.getLogger()\nlog.info('x')\n"
    )
    core = pkg / "core"
    assert _violations(core / "clean.py", tmp_path) == []
    assert _violations(core / "pure.py", tmp_path) == []
    escape = _violations(core / "escape.py", tmp_path)
    assert any("sieproxy.helpers -> sieproxy.io_side" in b and "trio" in b for b in escape)
    assert any("trio" in b for b in _violations(core / "absolute.py", tmp_path))
    assert any("'socket'" in b for b in _violations(core / "direct.py", tmp_path))
    noisy = _violations(core / "noisy.py", tmp_path)
    assert any("basicConfig" in b for b in noisy) and any("log.info" in b for b in noisy)


def test_core_imports_nothing_banned_at_run_time() -> None:
    """A fresh interpreter imports every core module; none of the banned modules gets loaded."""
    mods = [_module_name(p) for p in _core_modules()]
    code = (
        "import sys\n"
        f"for m in {mods!r}:\n"
        "    __import__(m)\n"
        f"banned = {sorted(BANNED_AT_RUN_TIME)!r}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.strip().splitlines()[-1]
    assert loaded == "[]", f"importing sieproxy.core loaded {loaded}"


# ---- public surface ------------------------------------------------------------------------

#: Entry scripts: importing them runs the program, and they export nothing.
NOT_LIBRARY_MODULES = {"sieproxy.__main__"}
#: Importing these has side effects (building an app from the environment): checked statically.
STATIC_ONLY = {"sieproxy.asgi"}


def _public_modules() -> list[Path]:
    """Every module of the package, its subpackages' too (``core``, ``hypercorn_io``)."""
    return sorted(PKG.rglob("*.py"))


def _static_all(path: Path) -> tuple[list[str] | None, set[str]]:
    """``__all__`` (None if absent) and the names bound at module level."""
    tree = ast.parse(path.read_text("utf-8"), filename=str(path))
    exported: list[str] | None = None
    bound: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for a in node.names:
                bound.add((a.asname or a.name).split(".")[0])
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    bound.add(n.id)
                    if n.id == "__all__":
                        value = getattr(node, "value", None)
                        assert isinstance(value, ast.List | ast.Tuple), (
                            f"{path}: __all__ must be a literal list"
                        )
                        exported = [ast.literal_eval(e) for e in value.elts]
    return exported, bound


@pytest.mark.parametrize(
    "path",
    [p for p in _public_modules() if _module_name(p) not in NOT_LIBRARY_MODULES],
    ids=_module_name,
)
def test_module_declares_its_public_surface(path: Path) -> None:
    name = _module_name(path)
    exported, bound = _static_all(path)
    assert exported is not None, f"{name} does not define __all__"
    assert all(isinstance(e, str) for e in exported), f"{name}.__all__ has non-strings"
    assert len(exported) == len(set(exported)), f"{name}.__all__ has duplicates"
    missing = [e for e in exported if e not in bound]
    assert not missing, f"{name}.__all__ lists names the module does not define: {missing}"
    if name in STATIC_ONLY:
        return
    module = importlib.import_module(name)
    assert list(module.__all__) == exported
    absent = [e for e in exported if not hasattr(module, e)]
    assert not absent, f"{name}.__all__ lists missing names: {absent}"
