"""The batch-invariant Triton GEMM (:mod:`model_shards.backends.cuda.triton_ops.gemm`) against
the reference backend, and its batch invariance: a row's output is bitwise the same in
batches of other sizes and contents (and, on a GPU, alone and at any position of its
tile). Without a GPU the kernel runs in Triton's interpreter (``tests/conftest.py``), so
shapes are small."""

from __future__ import annotations

import pytest
import torch

from model_shards.backends.cuda.triton_ops.gemm import gemm_config, linear
from model_shards.backends.reference import ReferenceBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # × max |ref|
IN, OUT = 96, 80  # in: 3 K-blocks of 32 (fp32) / 32 (16-bit); out: one full, one partial N tile


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The reference backend's linear on float32 copies (the exact-ish answer)."""
    bias = None if b is None else b.float()
    return ReferenceBackend().linear(x.float(), w.float(), None, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("t", "k", "n"), [(1, 48, 40), (3, 96, 80), (17, 48, 80), (40, 96, 40)])
def test_matches_reference(dtype: torch.dtype, with_bias: bool, t: int, k: int, n: int) -> None:
    x, w = _rand((t, k), dtype, 1), _rand((n, k), dtype, 2)
    b = _rand((n,), dtype, 3) if with_bias else None
    y = linear(x, w, b)  # [T, out]
    assert y.shape == (t, n) and y.dtype == dtype
    ref = _reference(x, w, b)
    err = (y.float() - ref).abs().max().item()
    assert err <= TOL[dtype] * ref.abs().max().item(), err
    # against the reference in the input dtype too (its own rounding of the sum)
    ref_native = ReferenceBackend().linear(x, w, None, b).float()
    assert (y.float() - ref_native).abs().max().item() <= 2 * TOL[dtype] * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_batch_size_invariance(dtype: torch.dtype, with_bias: bool) -> None:
    """Each row agrees bitwise whatever the batch size (1, 5, 16, 32, 33, 70: one and
    two M tiles), whatever the rows after it, and in any M tile (behind 64 or 128 other rows:
    same position inside its tile, another program)."""
    x, w = _rand((70, IN), dtype, 4), _rand((OUT, IN), dtype, 5)
    b = _rand((OUT,), dtype, 6) if with_bias else None
    full = linear(x, w, b)  # [70, out]
    for t in (1, 5, 16, 32, 33):
        assert torch.equal(linear(x[:t], w, b), full[:t]), f"prefix of {t} rows"
    others = torch.cat([x[:9], _rand((30, IN), dtype, 7)])  # [39, in], other rows after
    assert torch.equal(linear(others, w, b)[:9], full[:9]), "other rows after"
    for lead in (64, 128):
        behind = torch.cat([_rand((lead, IN), dtype, 8), x])  # [lead + 70, in]
        assert torch.equal(linear(behind, w, b)[lead:], full), f"behind {lead} rows"


@pytest.mark.skipif(
    DEVICE == "cpu",
    reason="the interpreter's tl.dot is numpy's (OpenBLAS) sgemm, whose float32 result for "
    "a tile row depends on the row's slot in the BLAS register block; on a GPU it must not",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_position_invariance(dtype: torch.dtype) -> None:
    """A row agrees bitwise alone and at any position inside its tile."""
    x, w, b = _rand((70, IN), dtype, 4), _rand((OUT, IN), dtype, 5), _rand((OUT,), dtype, 6)
    full = linear(x, w, b)  # [70, out]
    for r in (0, 4, 32, 63, 64, 69):
        assert torch.equal(linear(x[r : r + 1], w, b), full[r : r + 1]), f"row {r} alone"
    for lead in (3, 61):  # 61: rows 0..2 at tile rows 61..63, row 3 onwards in tile two
        shifted = torch.cat([_rand((lead, IN), dtype, 7), x[:9]])  # [lead + 9, in]
        assert torch.equal(linear(shifted, w, b)[lead:], full[:9]), f"behind {lead} rows"


def test_strided_and_transposed_x() -> None:
    """A row-strided view and a column-major x give the contiguous answer bitwise."""
    w, b = _rand((OUT, IN), torch.float32, 8), _rand((OUT,), torch.float32, 9)
    wide = _rand((17, IN + 24), torch.float32, 10)
    x = wide[:, 8 : 8 + IN]  # [17, in], row stride in + 24
    expect = linear(x.contiguous(), w, b)
    assert torch.equal(linear(x, w, b), expect)
    x_t = x.contiguous().t().contiguous().t()  # [17, in], column-major
    assert x_t.stride(1) != 1
    assert torch.equal(linear(x_t, w, b), expect)


def test_empty_batch_and_config() -> None:
    w = _rand((OUT, IN), torch.bfloat16, 11)
    assert linear(w[:0], w, None).shape == (0, OUT)
    for dtype in (torch.float32, torch.bfloat16):  # every tl.dot dim >= 16, powers of two
        cfg = gemm_config(IN, OUT, dtype)
        for size in (cfg.block_m, cfg.block_n, cfg.block_k):
            assert size >= 16 and size & (size - 1) == 0


def test_rejects_bad_arguments() -> None:
    x, w = _rand((3, IN), torch.float32, 12), _rand((OUT, IN), torch.float32, 13)
    with pytest.raises(ValueError, match="in=48"):
        linear(x[:, :48], w, None)
    with pytest.raises(ValueError, match="share"):
        linear(x, w.to(torch.bfloat16), None)
    with pytest.raises(ValueError, match="bias"):
        linear(x, w, torch.zeros(OUT + 1, device=DEVICE))
