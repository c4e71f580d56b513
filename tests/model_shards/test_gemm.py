"""Packed CPU GEMM: same numbers as F.linear, row results independent of the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model_shards.layers.gemm import PackableGemm, pack_weights, packing_supported
from model_shards.layers.linear import ReplicatedLinear
from model_shards.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from model_shards.parallel.state import single_process_state

needs_packing = pytest.mark.skipif(
    not packing_supported(torch.zeros(1)), reason="this torch build has no oneDNN"
)


def _linear(dtype: torch.dtype, bias: bool = True) -> ReplicatedLinear:
    torch.manual_seed(0)
    layer = ReplicatedLinear(96, 160, bias, dtype)
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
    assert pack_weights(layer) == 1
    assert layer.packed_weight is not None
    assert layer.weight.numel() == 0  # the dense copy is dropped
    got = layer(x).float()
    assert torch.allclose(got, want, rtol=tol, atol=tol), (got - want).abs().max()


@needs_packing
def test_packed_rows_do_not_depend_on_the_batch() -> None:
    layer = _linear(torch.float32)
    pack_weights(layer)
    x = torch.randn(80, 96)
    full = layer(x)
    for start, stop in [(0, 1), (5, 6), (3, 20), (0, 33), (41, 80)]:
        assert torch.equal(layer(x[start:stop]), full[start:stop]), (start, stop)


@needs_packing
def test_tied_lm_head_keeps_the_embedding_dense() -> None:
    ps = single_process_state()

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = VocabParallelEmbedding(50, 16, torch.float32, ps)
            self.head = ParallelLMHead(50, 16, torch.float32, ps)
            self.head.weight = self.embed.weight

    model = Tied()
    model.embed.weight.data.normal_()
    ids = torch.tensor([3, 7, 49])
    logits_before = model.head(model.embed(ids))
    assert pack_weights(model) == 1
    assert model.embed.weight.shape == (50, 16)  # lookups still read the table
    assert torch.allclose(model.head(model.embed(ids)), logits_before, atol=1e-5)


def test_unsupported_dtype_stays_on_f_linear() -> None:
    layer = _linear(torch.float16)
    assert pack_weights(layer) == 0
    assert layer.packed_weight is None and layer.weight.shape == (160, 96)
    assert isinstance(layer, PackableGemm)
