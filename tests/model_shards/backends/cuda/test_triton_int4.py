"""The Triton W4A16 GEMM (:mod:`model_shards.backends.cuda.triton_ops.int4_gemm`) against the
reference backend's ``int4_linear`` (dequantize, one float32 GEMM), in Triton's interpreter
without a GPU: odd M, M = 1 through split-K, groups of 16/32/64/128, zeros given and symmetric
(8), GPTQ ``desc_act`` groups (a permuted ``g_idx``), bias; and the fixed summation order:
split-K and one pass give the same bits, and a row's bits do not depend on its batch.

Tolerance, elementwise and derived rather than tuned: the kernel rounds each dequantized
weight to ``x``'s dtype (unit roundoff ``u``: 2^-8 bfloat16, 2^-11 float16, 0 float32) and the
output once, and sums in float32 in another order than the reference, so
``|y - ref| <= u (|x| @ |W|^T + |ref|) + 1e-5 |x| @ |W|^T``.

The compiled kernel at a decode shape (K = 4096: eight partitions) is a GPU test, skipped on
CPU (the interpreter would take minutes) and run by ``make gpu-check``'s parity part.
"""

from __future__ import annotations

import pytest
import torch

from model_shards.backends.cuda.triton_ops.int4_gemm import int4_linear, partition_size
from model_shards.backends.reference import ReferenceBackend
from model_shards.quant.int4 import Int4GroupWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


pytestmark = pytest.mark.usefixtures("one_thread")


def _weight(n: int, k: int, group: int, zeros: bool, desc_act: bool, seed: int) -> Int4GroupWeight:
    """Random nibbles, float16 scales (the checkpoints' dtype), zeros in 0..15 or None, and
    for ``desc_act`` each column's group permuted (GPTQ act-order)."""
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = (0.01 + 0.04 * torch.rand(n, k // group, generator=gen)).half()
    zero = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.uint8)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)] if desc_act else None
    held = Int4GroupWeight(qweight, scales, zero if zeros else None, group, g_idx)
    return Int4GroupWeight(
        held.qweight.to(DEVICE),
        held.scales.to(DEVICE),
        None if held.zeros is None else held.zeros.to(DEVICE),
        group,
        None if g_idx is None else g_idx.to(DEVICE),
    )


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(DEVICE, dtype)


CASES = [
    # M, K, N, group, zeros, desc_act, dtype, bias
    (1, 256, 48, 32, True, False, torch.bfloat16, False),  # decode: split-K
    (3, 256, 80, 64, False, False, torch.float16, True),
    (17, 256, 48, 128, True, False, torch.float32, True),
    (5, 256, 40, 32, True, True, torch.bfloat16, False),  # act-order groups
    (1, 128, 72, 64, False, True, torch.float32, True),
    (70, 128, 40, 32, True, False, torch.bfloat16, True),  # M > 64: tiles of 64 x 128
    (3, 128, 40, 16, True, False, torch.float32, False),  # groups smaller than a K tile
]


@pytest.mark.parametrize(("m", "k", "n", "group", "zeros", "desc_act", "dtype", "bias"), CASES)
def test_matches_reference(
    m: int,
    k: int,
    n: int,
    group: int,
    zeros: bool,
    desc_act: bool,
    dtype: torch.dtype,
    bias: bool,
) -> None:
    w = _weight(n, k, group, zeros, desc_act, seed=m + k + n)
    x = _x(m, k, dtype, seed=m)
    b = _x(1, n, dtype, seed=99)[0] if bias else None
    y = int4_linear(x, w, b)  # [M, N]
    assert y.shape == (m, n) and y.dtype == dtype
    ref = ReferenceBackend().int4_linear(x.float(), w, None if b is None else b.float())
    abs_dot = x.float().abs() @ w.dequantize().abs().t()  # [M, N]
    u = UNIT_ROUNDOFF[dtype]
    bound = u * (abs_dot + ref.abs()) + 1e-5 * abs_dot + 1e-6
    err = (y.float() - ref).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item()}"


def test_split_and_one_pass_agree_bitwise_and_rows_ignore_their_batch() -> None:
    """The K sum's order is fixed by K alone: forced split-K and forced one pass give the
    same bits, and with ``batch_invariant`` tiles a row's bits are the same in batches of
    1, 4 and 9 rows (other rows different after it)."""
    k, n = 256, 40
    assert partition_size(k) < k  # several partitions: the split is real
    w = _weight(n, k, 64, True, False, seed=5)
    b = _x(1, n, torch.bfloat16, seed=6)[0]
    x = _x(9, k, torch.bfloat16, seed=7)
    one_pass = int4_linear(x, w, b, batch_invariant=True, split=False)
    split = int4_linear(x, w, b, batch_invariant=True, split=True)
    assert torch.equal(one_pass, split)
    for rows in (1, 4):
        assert torch.equal(int4_linear(x[:rows], w, b, batch_invariant=True), one_pass[:rows])
    other = torch.cat([x[:2], _x(5, k, torch.bfloat16, seed=8)])
    assert torch.equal(int4_linear(other, w, b, batch_invariant=True)[:2], one_pass[:2])


def _assert_within_bound(y: torch.Tensor, x: torch.Tensor, w: Int4GroupWeight) -> None:
    ref = ReferenceBackend().int4_linear(x.float(), w, None)
    abs_dot = x.float().abs() @ w.dequantize().abs().t()  # [M, N]
    bound = UNIT_ROUNDOFF[x.dtype] * (abs_dot + ref.abs()) + 1e-5 * abs_dot + 1e-6
    assert torch.all((y.float() - ref).abs() <= bound)


@pytest.mark.skipif(DEVICE == "cpu", reason="a decode-sized compiled kernel (make gpu-check)")
def test_gpu_decode_shape() -> None:
    """M = 1 and 7 at K = 4096 (split-K, eight partitions), AWQ-like groups of 128 with zeros;
    split and one pass bitwise equal, and a row the same alone and in the batch."""
    w = _weight(512, 4096, 128, True, False, seed=21)
    x = _x(7, 4096, torch.bfloat16, seed=22)
    for rows in (1, 7):
        _assert_within_bound(int4_linear(x[:rows], w, None), x[:rows], w)
    one_pass = int4_linear(x, w, None, batch_invariant=True, split=False)
    assert torch.equal(int4_linear(x, w, None, batch_invariant=True, split=True), one_pass)
    assert torch.equal(int4_linear(x[:1], w, None, batch_invariant=True), one_pass[:1])


def test_empty_batch_and_bad_arguments() -> None:
    w = _weight(16, 64, 32, False, False, seed=1)
    assert int4_linear(_x(0, 64, torch.float32, 1), w, None).shape == (0, 16)
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        int4_linear(_x(2, 32, torch.float32, 1), w, None)
    with pytest.raises(ValueError, match="bias"):
        int4_linear(_x(2, 64, torch.float32, 1), w, torch.zeros(3, device=DEVICE))
    short = Int4GroupWeight(w.qweight, w.scales[:, :1], None, 32)
    with pytest.raises(ValueError, match="do not cover"):
        int4_linear(_x(2, 64, torch.float32, 1), short, None)
