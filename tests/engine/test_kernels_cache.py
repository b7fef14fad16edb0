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
