"""Packed CPU GEMM of the cpu backend (our AVX-512 or AVX2 kernel in float32 and bfloat16,
else oneDNN): same numbers as F.linear, row results independent of the batch and of the
thread count, on every ISA this machine's build has; the packed layout lives beside the
dense parameter."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_shards.backends import ReferenceBackend
from model_shards.backends.cpu.backend import CpuBackend, PackedGemm
from model_shards.backends.cpu.build import build_and_load
from model_shards.layers.context import ShardContext
from model_shards.layers.linear import LinearBase, ReplicatedLinear, prepare_weights
from model_shards.layers.vocab import ParallelLMHead, VocabParallelEmbedding

assert build_and_load(), "CI's machine has a compiler: the cpu backend must build"
CPU = CpuBackend()
needs_packing = pytest.mark.skipif(
    CPU.pack_linear(torch.zeros(1, 1)) is None,
    reason="no packed GEMM here (neither our AVX-512 kernel nor oneDNN)",
)


def _with_own_gemm(dtype: torch.dtype, *more: object) -> object:
    """A parameter set ``(dtype, *more)``, skipped where our GEMM does not serve ``dtype``."""
    skip = pytest.mark.skipif(
        not torch.ops.shardserve_cpu.gemm_vectorized(dtype),
        reason=f"no vectorized {dtype} GEMM on this machine (neither AVX-512 nor AVX2)",
    )
    return pytest.param(dtype, *more, marks=skip, id=str(dtype).removeprefix("torch."))


OWN_GEMM_DTYPES = [_with_own_gemm(torch.float32), _with_own_gemm(torch.bfloat16)]
# "widest": the tiles gemm picks here; "avx2" as well where that is AVX-512 for some dtype
_WIDEST = {torch.ops.shardserve_cpu.gemm_isa(d) for d in (torch.float32, torch.bfloat16)}
ISAS = ["widest", "avx2"] if "avx512" in _WIDEST else ["widest"]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test with the AVX-512 tiles and again with the AVX2 ones, where both exist."""
    torch.ops.shardserve_cpu.gemm_isa(torch.float32, request.param)
    try:
        yield request.param
    finally:
        torch.ops.shardserve_cpu.gemm_isa(torch.float32, "widest")


# what a result may differ from the float64 product by, relative: float32 accumulation, then
# (bfloat16) one rounding of the output, which the accumulation order may move by one step
OWN_GEMM_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}


def _linear(dtype: torch.dtype, bias: bool = True, ops: object = CPU) -> ReplicatedLinear:
    torch.manual_seed(0)
    layer = ReplicatedLinear(96, 160, bias=bias, ctx=ShardContext.single_process(ops, dtype))  # type: ignore[arg-type]
    layer.weight.data.normal_(0, 0.05)
    if layer.bias is not None:
        layer.bias.data.normal_()
    return layer


@needs_packing
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_packed_matches_f_linear(dtype: torch.dtype, tol: float) -> None:
    layer = _linear(dtype)
    dense, bias = layer.weight.detach().clone(), layer.bias
    x = torch.randn(37, 96).to(dtype)
    want = F.linear(x.float(), dense.float(), None if bias is None else bias.float())
    assert prepare_weights(layer) == 1
    assert isinstance(layer.packed, PackedGemm)
    assert torch.equal(layer.weight, dense)  # the dense parameter stays beside the packed one
    got = layer(x).float()
    assert torch.allclose(got, want, rtol=tol, atol=tol), (got - want).abs().max()


@needs_packing
def test_packed_rows_do_not_depend_on_the_batch() -> None:
    layer = _linear(torch.float32)
    prepare_weights(layer)
    x = torch.randn(80, 96)
    full = layer(x)
    for start, stop in [(0, 1), (5, 6), (3, 20), (0, 33), (41, 80)]:
        assert torch.equal(layer(x[start:stop]), full[start:stop]), (start, stop)


@needs_packing
def test_tied_lm_head_shares_the_embedding_table() -> None:
    ctx = ShardContext.single_process(CPU)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = VocabParallelEmbedding(50, 16, ctx)
            self.head = ParallelLMHead(50, 16, ctx)
            self.head.weight = self.embed.weight

    model = Tied()
    model.embed.weight.data.normal_()
    ids = torch.tensor([3, 7, 49])
    logits_before = model.head(model.embed(ids))
    assert prepare_weights(model) == 1
    assert model.embed.weight.shape == (50, 16)  # lookups still read the table
    assert torch.allclose(model.head(model.embed(ids)), logits_before, atol=1e-5)


def test_reference_backend_keeps_f_linear() -> None:
    layer = _linear(torch.float16, ops=ReferenceBackend())
    assert prepare_weights(layer) == 0
    assert layer.packed is None and layer.weight.shape == (160, 96)
    assert isinstance(layer, LinearBase)


def _own_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = torch.ops.shardserve_cpu.pack_gemm(w)
    return torch.ops.shardserve_cpu.gemm(x, packed, w.shape[0], bias)


@pytest.mark.parametrize("dtype", OWN_GEMM_DTYPES)
@pytest.mark.parametrize(
    ("rows", "outputs", "inner"),
    [(1, 48, 16), (7, 49, 5), (9, 160, 96), (37, 96, 33), (64, 200, 576), (300, 47, 64)],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_own_gemm_matches_f_linear(
    dtype: torch.dtype, rows: int, outputs: int, inner: int, with_bias: bool, isa: str
) -> None:
    """Every row tile (1..8 rows; AVX2: both tile shapes, k in blocks), a partial last panel
    (outputs not a multiple of 48) and, in bfloat16, an odd K (the last k has no partner)."""
    gen = torch.Generator().manual_seed(rows * 1000 + outputs)
    w = torch.randn(outputs, inner, generator=gen).to(dtype)
    x = torch.randn(rows, inner, generator=gen).to(dtype)
    bias = torch.randn(outputs, generator=gen).to(dtype) if with_bias else None
    got = _own_gemm(x, w, bias)
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got.shape == (rows, outputs) and got.dtype == dtype
    rtol = OWN_GEMM_RTOL[dtype]
    assert torch.allclose(got.double(), want, rtol=rtol, atol=1e-4 * inner**0.5)


@pytest.mark.parametrize("dtype", OWN_GEMM_DTYPES)
@pytest.mark.parametrize("inner", [64, 301])
def test_own_gemm_rows_depend_on_nothing_else(dtype: torch.dtype, inner: int, isa: str) -> None:
    """A row's bits are the same alone, in any batch (AVX2: in either tile shape, with or
    without blocks of k), from a strided input, on 1 or 2 threads."""
    torch.manual_seed(1)
    w, bias = torch.randn(100, inner).to(dtype), torch.randn(100).to(dtype)
    x = torch.randn(70, inner).to(dtype)
    packed = torch.ops.shardserve_cpu.pack_gemm(w)
    full = torch.ops.shardserve_cpu.gemm(x, packed, 100, bias)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for start, stop in [(0, 1), (5, 6), (2, 10), (3, 20), (0, 33), (41, 70)]:
                part = torch.ops.shardserve_cpu.gemm(x[start:stop], packed, 100, bias)
                assert torch.equal(part, full[start:stop]), (n, start, stop)
        wide = torch.cat([x, torch.zeros(70, 16, dtype=dtype)], dim=1)[:, :inner]  # strided rows
        assert torch.equal(torch.ops.shardserve_cpu.gemm(wide, packed, 100, bias), full)
        batched = torch.ops.shardserve_cpu.gemm(x.view(7, 10, inner), packed, 100, bias)
        assert torch.equal(batched, full.view(7, 10, 100))  # leading dims, as F.linear
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", OWN_GEMM_DTYPES)
def test_avx2_tiles_give_the_avx512_numbers(dtype: torch.dtype) -> None:
    """Both ISAs add one exact-order FMA per k from zero: float32 results agree bit for bit
    where both are built; in bfloat16 (vdpbf16ps against widened FMAs in its pair order) to
    within one rounding of the bfloat16 output. Each ISA this build has is also checked
    against the float64 product."""
    torch.manual_seed(2)
    w, x = torch.randn(130, 301).to(dtype), torch.randn(40, 301).to(dtype)
    packed = torch.ops.shardserve_cpu.pack_gemm(w)
    results = {}
    try:
        for use in ISAS:
            torch.ops.shardserve_cpu.gemm_isa(dtype, use)
            results[torch.ops.shardserve_cpu.gemm_isa(dtype)] = torch.ops.shardserve_cpu.gemm(
                x, packed, 130
            )
    finally:
        torch.ops.shardserve_cpu.gemm_isa(dtype, "widest")
    want = F.linear(x.double(), w.double())
    for got in results.values():
        assert torch.allclose(got.double(), want, rtol=OWN_GEMM_RTOL[dtype], atol=1e-3)
    if len(results) == 2 and dtype == torch.float32:
        assert torch.equal(results["avx512"], results["avx2"])
    if len(results) == 2 and dtype == torch.bfloat16:
        assert torch.allclose(results["avx512"], results["avx2"], rtol=2.0**-7, atol=0)


@pytest.mark.parametrize(
    ("dtype", "panel_shape"),
    [_with_own_gemm(torch.float32, (4, 96, 48)), _with_own_gemm(torch.bfloat16, (4, 48, 96))],
)
def test_layers_pack_for_the_own_gemm(dtype: torch.dtype, panel_shape: tuple[int, ...]) -> None:
    """ceil(160 / 48) zero-padded panels; bfloat16 packs k in pairs, two per column. Layers
    take them with the AVX-512 tiles, and in bfloat16 with the AVX2 ones; float32 on AVX2
    keeps oneDNN's layout (faster there)."""
    layer = _linear(dtype)
    assert prepare_weights(layer) == 1
    assert isinstance(layer.packed, PackedGemm)
    own = torch.ops.shardserve_cpu.gemm_isa(dtype) == "avx512" or dtype == torch.bfloat16
    assert layer.packed.out_features == (160 if own else 0)
    if own:
        assert layer.packed.data.shape == panel_shape and layer.packed.data.dtype == dtype
    packed = torch.ops.shardserve_cpu.pack_gemm(layer.weight.detach())
    assert packed.shape == panel_shape and packed.dtype == dtype


@pytest.mark.parametrize("dtype", OWN_GEMM_DTYPES)
def test_own_gemm_rejects_a_mismatched_weight(dtype: torch.dtype) -> None:
    packed = torch.ops.shardserve_cpu.pack_gemm(torch.randn(96, 32).to(dtype))
    with pytest.raises(RuntimeError, match="pack_gemm"):
        torch.ops.shardserve_cpu.gemm(torch.randn(4, 16).to(dtype), packed, 96)
    with pytest.raises(RuntimeError, match="pack_gemm"):
        torch.ops.shardserve_cpu.gemm(torch.randn(4, 32).to(dtype), packed, 200)
    with pytest.raises(RuntimeError, match="pack_gemm"):  # the other dtype's input
        other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
        torch.ops.shardserve_cpu.gemm(torch.randn(4, 32).to(other), packed, 96)
    with pytest.raises(RuntimeError, match="bias"):
        bias = torch.randn(95).to(dtype)
        torch.ops.shardserve_cpu.gemm(torch.randn(4, 32).to(dtype), packed, 96, bias)
