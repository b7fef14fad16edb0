"""The decode kernel's two matmul paths (engine/cpu/kernels.py, ``small_gemm``): AVX-512 where
the CPU has it, AVX2 otherwise. The engine's numerics must not depend on which one a machine
runs: every output element is the same FMA chain over K, so the two are bit-identical, for
every row count a decode step can have and for weights whose column count is not a multiple
of the tile width."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.cpu.kernels import SMALL_ROWS, Kernels, load_kernels, pack_weight


@pytest.fixture
def kernels() -> Iterator[Kernels]:
    k = load_kernels()
    if k is None:
        pytest.skip("no AVX2, no compiler, or disabled: the engine uses torch ops here")
    before = k.gemm_isa(-1)
    yield k
    k.gemm_isa(before)


def test_avx512_is_used_where_the_cpu_has_it(kernels: Kernels) -> None:
    has = "AVX512" in torch.backends.cpu.get_cpu_capability()
    assert kernels.gemm_isa(1) == (1 if has else 0)
    assert kernels.gemm_isa(0) == 0
    assert kernels.gemm_isa(-1) == 0  # -1 only asks


@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (64, 16 * 7 + 5), (40, 16 * 13)])
def test_both_paths_are_bit_identical_and_right(kernels: Kernels, k: int, n: int) -> None:
    if kernels.gemm_isa(1) != 1:
        pytest.skip("this CPU has no AVX-512: only the AVX2 path runs here")
    gen = torch.Generator().manual_seed(k * 1000 + n)
    weight = torch.randn(k, n, generator=gen)
    packed = pack_weight(weight)
    for rows in range(1, SMALL_ROWS + 1):
        x = torch.randn(rows, k, generator=gen)
        kernels.gemm_isa(1)
        wide = kernels.small_gemm(x, packed)[:, :n]
        kernels.gemm_isa(0)
        narrow = kernels.small_gemm(x, packed)[:, :n]
        assert torch.equal(wide, narrow), f"rows={rows}"
        torch.testing.assert_close(wide, x.double().mm(weight.double()).float(),
                                   rtol=1e-4, atol=1e-4)


def test_rows_with_a_stride_and_the_padding_columns(kernels: Kernels) -> None:
    """Rows of a wider tensor (a view, as the model passes slices) and the zero columns past
    ``n`` that the packing pads to a whole block."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(96, 40, generator=gen)
    packed = pack_weight(weight)
    wide_x = torch.randn(16, 200, generator=gen)
    x = wide_x[:, 10:106]
    assert x.stride(0) == 200
    for isa in (1, 0):
        kernels.gemm_isa(isa)
        out = kernels.small_gemm(x, packed)
        assert out.shape == (16, 48)
        torch.testing.assert_close(out[:, :40], x.mm(weight), rtol=1e-4, atol=1e-4)
        assert torch.equal(out[:, 40:], torch.zeros(16, 8))
