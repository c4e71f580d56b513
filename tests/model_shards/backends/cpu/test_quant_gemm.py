"""The quantized GEMM (kernels/quant_gemm.cpp) on every GGML type, vectorized and scalar:

* against the same arithmetic in torch (activations quantized per block as the kernel does,
  then dequantized weights, float64 sums): equal to float32 summation error, so every block
  decode and integer dot product is exact;
* against the plain reference (dequantize + float matmul): within the bound activation
  quantization implies, derived, not fitted: each activation moves by at most half its
  block's step d_b = max|x_b| / 127, so |y - y_ref| <= sum_b d_b / 2 * sum_{k in b} |W_nk|;
* rows independent of M (odd M, tiles of four and their remainder) and of the thread count;
* in layers: fused segments of mixed types, and a TP=2 row split at a block boundary whose
  partial sums add up to the unsplit layer's output.
"""

from __future__ import annotations

import pytest
import torch

from model_shards.backends import ReferenceBackend
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load
from model_shards.layers.linear import RowParallelLinear
from model_shards.layers.loading import quant_of
from model_shards.quant.dequantize import dequantize
from model_shards.quant.formats import BLOCK_TYPES, GGMLType
from model_shards.quant.weights import QuantizedTensor, QuantizedWeight
from tests.model_shards.layers.sharding import BlockTensor, random_blocks, shard_context

assert build_and_load(), "CI's machine has a compiler: the cpu backend must build"
CPU = CpuBackend()
OPS = torch.ops.shardserve_cpu
TYPES = sorted(BLOCK_TYPES)


def _act_block(qtype: GGMLType) -> int:
    return 256 if qtype >= GGMLType.Q4_K else 32


def _quantized_x(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activations: ``x`` rounded per block, and each block's step ``d``."""
    xb = x.float().reshape(x.shape[0], -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(xb * inv).clamp(-127, 127)
    return (q * d).reshape(x.shape), d.squeeze(-1)


@pytest.mark.parametrize("vectorized", [True, False], ids=["vectorized", "scalar"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_is_the_integer_arithmetic_and_within_the_derived_bound(
    qtype: GGMLType, vectorized: bool
) -> None:
    k = 512 if qtype >= GGMLType.Q4_K else 96  # 2 superblocks / 3 blocks
    n, m = 37, 13  # three weight chunks, tiles of four and a remainder of one
    blocks = random_blocks(qtype, n, k, seed=int(qtype))
    w = dequantize(blocks, qtype, k).double()
    x = torch.randn(m, k)
    x[1] = 0.0  # an all-zero row: d = 0
    y = OPS.quant_gemm(x, blocks, int(qtype), None, vectorized)
    xq, d = _quantized_x(x, _act_block(qtype))
    exact = xq.double() @ w.T
    magnitude = xq.double().abs() @ w.abs().T
    assert torch.all((y.double() - exact).abs() <= 1e-5 * magnitude + 1e-6)
    # against dequantize + matmul: |dx| <= d / 2 per value, summed with |W| per block
    wb = w.abs().reshape(n, -1, _act_block(qtype)).sum(-1)  # [n, blocks]
    bound = (d.double() / 2) @ wb.T
    assert torch.all((y.double() - x.double() @ w.T).abs() <= bound * 1.001 + 1e-5)
    for row in (0, 4, 12):  # in a tile of four, and the remainder
        alone = OPS.quant_gemm(x[row : row + 1], blocks, int(qtype), None, vectorized)
        assert torch.equal(alone[0], y[row])


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q6_K], ids=lambda t: t.name)
def test_bfloat16_bias_and_thread_count(qtype: GGMLType) -> None:
    k, n = 256, 50
    blocks = random_blocks(qtype, n, k, seed=3)
    x, bias = torch.randn(6, k).bfloat16(), torch.randn(n).bfloat16()
    y = OPS.quant_gemm(x, blocks, int(qtype), bias)
    y32 = OPS.quant_gemm(x.float(), blocks, int(qtype), bias.float())
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, y32.bfloat16())  # one rounding, after the bias
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(OPS.quant_gemm(x, blocks, int(qtype), bias), y)
    finally:
        torch.set_num_threads(threads)


def test_mixed_segments_padding_and_bias_match_the_reference() -> None:
    k = 256
    weight = QuantizedWeight(out_features=40, in_features=k)
    weight.add(0, QuantizedTensor(GGMLType.Q4_K, random_blocks(GGMLType.Q4_K, 16, k, 1), k))
    weight.add(16, QuantizedTensor(GGMLType.Q6_K, random_blocks(GGMLType.Q6_K, 8, k, 2), k))
    dense = torch.randn(8, k)
    weight.add(24, QuantizedTensor(GGMLType.F32, dense.view(torch.uint8), k))  # rows 32..39: none
    x, bias = torch.randn(3, k), torch.randn(40)
    got = CPU.quantized_linear(x, weight, bias)
    want = ReferenceBackend().quantized_linear(x, weight, bias)
    _, d = _quantized_x(x, 256)
    bound = (d / 2) @ weight.dequantize().abs().sum(-1, keepdim=True).T
    assert torch.all((got - want).abs() <= bound * 1.001 + 1e-5)
    assert torch.equal(got[:, 32:], bias[32:].expand(3, 8))  # uncovered rows: the bias alone
    torch.testing.assert_close(got[:, 24:32], x @ dense.T + bias[24:32])


def test_tp2_row_split_at_a_block_boundary_sums_to_the_whole() -> None:
    qtype, k, n = GGMLType.Q4_0, 128, 24  # 64 columns per rank: two blocks each
    src = BlockTensor("down", random_blocks(qtype, n, k, 5), qtype, k)
    x = torch.randn(5, k)
    parts = []
    for r in range(2):
        layer = RowParallelLinear(k, n, bias=False, ctx=shard_context(r, 2, ops=CPU))
        layer.weight_loader(layer.weight, src)
        held = quant_of(layer.weight)
        assert held is not None and held.segments[0].tensor.qtype == qtype
        parts.append(layer.gemm(x[:, r * 64 : (r + 1) * 64]))
    whole = RowParallelLinear(k, n, bias=False, ctx=shard_context(0, 1, ops=CPU))
    whole.weight_loader(whole.weight, src)
    # activation blocks do not straddle ranks, so only the float summation order differs
    torch.testing.assert_close(parts[0] + parts[1], whole.gemm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_spoils_its_own_row_only(bad: float) -> None:
    qtype, k = GGMLType.Q4_1, 64
    blocks = random_blocks(qtype, 9, k, seed=6)
    x = torch.randn(5, k)
    clean = OPS.quant_gemm(x, blocks, int(qtype))
    x[2, 40] = bad
    y = OPS.quant_gemm(x, blocks, int(qtype))
    assert not y[2].isfinite().any()  # as x @ W^T would be
    keep = [0, 1, 3, 4]
    assert torch.equal(y[keep], clean[keep])
