"""The CPU engine's compiled kernels are cached per torch installation (engine/cpu/kernels.py,
``extension_name``): tox's test and serve environments each keep their own build instead of
rebuilding the one they share whenever the other built it last."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.cpu.kernels import extension_name, load_kernels


def test_one_name_per_torch_installation(tmp_path: Path) -> None:
    a, b = tmp_path / "env-a" / "torch", tmp_path / "env-b" / "torch"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (tmp_path / "link").symlink_to(a)
    assert extension_name(str(a)) == extension_name(str(a))
    assert extension_name(str(a)) != extension_name(str(b))
    assert extension_name(str(tmp_path / "link")) == extension_name(str(a))  # the real path
    assert extension_name(str(a)).isidentifier()  # it is the module's name too
    assert extension_name() == extension_name(os.path.dirname(torch.__file__))


def test_the_kernels_are_built_under_that_name() -> None:
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("no AVX2, no compiler, or disabled: the engine uses torch ops here")
    assert kernels.small_gemm.__module__ == extension_name()


def test_a_cold_build_is_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first build takes about a minute: a line says so before the wait, another after.
    A cached build says nothing. (The compiler is stood in for: the build is not the point.)"""
    from torch.utils import cpp_extension

    from engine.cpu import kernels

    monkeypatch.setattr(kernels, "_kernels", None)  # restored afterwards, with _loaded
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    name = extension_name()
    built = tmp_path / name / f"{name}.so"

    def fake_build(**kw: object) -> object:
        built.parent.mkdir(parents=True, exist_ok=True)
        built.write_bytes(b"")
        return type("M", (), {f.name: None for f in kernels.fields(kernels.Kernels)})

    monkeypatch.setattr(cpp_extension, "load_inline", fake_build)
    for expect_lines in (2, 0):
        monkeypatch.setattr(kernels, "_loaded", False)
        assert kernels.load_kernels() is not None
        err = capsys.readouterr().err
        assert len([ln for ln in err.splitlines() if "decode kernels" in ln]) == expect_lines, err
