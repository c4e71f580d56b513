"""The all-to-all path of data-parallel attention + expert-parallel MoE, in a spawned world
of 2 ranks holding 3 whole experts each: every rank sends its own tokens (a different
number each, one rank none at all: an idle replica still joins) to the experts' ranks and
back, and gets what one process holding all 6 experts computes for those tokens."""

from __future__ import annotations

import pytest
import torch

from model_shards.backends import ReferenceBackend
from model_shards.backends.base import ExpertWeights
from model_shards.config.moe import MoEConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.moe import FusedExperts, dispatch_to_experts, route
from model_shards.parallel.comm import Comm
from tests.world import run_world

MOE = MoEConfig(
    num_experts=6, top_k=2, expert_intermediate_size=10, scoring="softmax", renormalize=True
)
H = 16
# tokens per rank in each round: rank 1 idle first, then both busy, then rank 0 idle
ROUNDS = [(7, 0), (3, 5), (0, 4)]


def _full_experts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    w13 = torch.randn(6, 20, H, generator=gen)
    w2 = torch.randn(6, H, 10, generator=gen)
    router = torch.randn(6, H, generator=gen)
    return w13, w2, router


def _rank(peers: Comm) -> None:
    ops = ReferenceBackend()
    experts = FusedExperts(H, MOE, ShardContext(peers, ops, torch.float32, expert_parallel=True))
    w13, w2, router = _full_experts()
    local = slice(experts.first_expert, experts.first_expert + experts.num_local)
    experts.w13_weight.data.copy_(w13[local])
    experts.w2_weight.data.copy_(w2[local])
    for round_, counts in enumerate(ROUNDS):
        t = counts[peers.ps.tp_rank]
        x = torch.randn(t, H, generator=torch.Generator().manual_seed(100 * round_ + t))
        weights, ids = route(x @ router.T, MOE)
        out = dispatch_to_experts(x, weights, ids, experts, peers)
        expected = ops.fused_moe(x, ExpertWeights(w13, w2), weights, ids)
        assert out.shape == (t, H)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_tokens_reach_the_experts_of_other_ranks_and_come_back() -> None:
    run_world(_rank, 2, 1, timeout=90)
