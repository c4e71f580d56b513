"""The GEMM over row panels (kernels/quant_panels.cpp) and the backend's use of it: every type
gives the same bits as quant_gemm on the GGML layout (test_quant_gemm.py proves that one
exact and within its bound), for every tile of rows of x (M = 1 .. 8, and past a tile), with
bias, bfloat16 and any thread count; layers laid out after loading (LinearBase.prepare) answer
as before, the tied vocabulary table's lookups too.

Only builds with AVX-512 VNNI have the kernel (elsewhere the backend keeps the GGML layout and
quant_gemm, which test_quant_gemm.py covers): the module is skipped there, and
``test_the_backend_lays_out_panels_where_the_build_has_them`` states which case ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load
from model_shards.layers.linear import ColumnParallelLinear, prepare_weights
from model_shards.layers.loading import quant_of
from model_shards.layers.vocab import ParallelLMHead
from model_shards.quant.formats import GGMLType
from model_shards.quant.panels import PANEL_TYPES, to_panels
from tests.model_shards.layers.sharding import BlockTensor, random_blocks, shard_context

assert build_and_load(), "CI's machine has a compiler: the cpu backend must build"
OPS = torch.ops.shardserve_cpu
HAS_PANELS = bool(OPS.quant_panels_isa())
needs_panels = pytest.mark.skipif(not HAS_PANELS, reason="this build has no AVX-512 VNNI")
TYPES = sorted(PANEL_TYPES)


def _cols(qtype: GGMLType) -> int:
    return 512 if qtype >= GGMLType.Q4_K else 96


def test_the_backend_lays_out_panels_where_the_build_has_them() -> None:
    flags = Path("/proc/cpuinfo").read_text()
    vnni = all(f in flags for f in ("avx512bw", "avx512vl", "avx512_vnni", "f16c"))
    assert vnni == HAS_PANELS  # -march=native: the build has what the CPU has
    assert CpuBackend()._panels == HAS_PANELS


@needs_panels
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_same_bits_as_the_ggml_layout_for_every_tile(qtype: GGMLType) -> None:
    k, n = _cols(qtype), 48
    blocks = random_blocks(qtype, n, k, seed=int(qtype))
    panels = to_panels(blocks, qtype)
    x = torch.randn(19, k)  # a full tile of eight, twice, and a remainder of three
    x[5] = 0.0
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 19):
        want = OPS.quant_gemm(x[:m], blocks, int(qtype), None, True)
        assert torch.equal(OPS.quant_gemm_panels(x[:m], panels, int(qtype), None), want), m


@needs_panels
@pytest.mark.parametrize("qtype", [GGMLType.Q5_1, GGMLType.Q4_K], ids=lambda t: t.name)
def test_bfloat16_bias_threads_and_shapes(qtype: GGMLType) -> None:
    k, n = 256, 64
    blocks = random_blocks(qtype, n, k, seed=7)
    panels = to_panels(blocks, qtype)
    x, bias = torch.randn(2, 5, k).bfloat16(), torch.randn(n).bfloat16()
    y = OPS.quant_gemm_panels(x, panels, int(qtype), bias)
    assert y.shape == (2, 5, n) and y.dtype == torch.bfloat16
    assert torch.equal(y, OPS.quant_gemm(x, blocks, int(qtype), bias))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(OPS.quant_gemm_panels(x, panels, int(qtype), bias), y)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="16 n, row_bytes"):
        OPS.quant_gemm_panels(x, panels[:40], int(qtype), None)


@needs_panels
def test_layers_answer_the_same_after_prepare() -> None:
    k = 256
    cpu = CpuBackend()
    ctx = shard_context(0, 1, ops=cpu)
    x = torch.randn(3, k)
    layer = ColumnParallelLinear(k, 72, bias=False, ctx=ctx)  # 64 rows in panels, 8 not
    layer.weight_loader(
        layer.weight, BlockTensor("w", random_blocks(GGMLType.Q4_K, 72, k, 1), GGMLType.Q4_K, k)
    )
    head = ParallelLMHead(40, k, ctx)  # 32 vocab rows in panels, the last 8 not
    head.weight_loader(
        head.weight, BlockTensor("e", random_blocks(GGMLType.Q8_0, 40, k, 2), GGMLType.Q8_0, k)
    )
    before = layer(x), head(x), head.lookup(torch.tensor([39, 0, 21]))
    assert prepare_weights(torch.nn.ModuleList([layer, head])) == 2
    for held in (quant_of(layer.weight), quant_of(head.weight)):
        assert held is not None and [s.tensor.panels for s in held.segments] == [True, False]
    after = layer(x), head(x), head.lookup(torch.tensor([39, 0, 21]))
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)
