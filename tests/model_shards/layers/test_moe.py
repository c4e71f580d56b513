"""The MoE layer's parts on one process: the router against transformers' routers, every
backend's ``fused_moe`` against a per-token float64 loop, the checkpoint-name mapping, and an
expert-parallel rank reading only its own experts from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

from model_shards.backends import Backend, ReferenceBackend
from model_shards.backends.base import ExpertWeights
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load
from model_shards.backends.cuda.backend import CudaBackend
from model_shards.config.moe import MoEConfig
from model_shards.layers.context import ShardContext
from model_shards.layers.moe import FusedExperts, expert_param_of, route
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import ParallelState
from model_shards.worker.checkpoint import Checkpoint

assert build_and_load(), "CI's machine has a compiler: the cpu backend must build"


def _moe(**fields: object) -> MoEConfig:
    base: dict[str, object] = {
        "num_experts": 6,
        "top_k": 2,
        "expert_intermediate_size": 10,
        "scoring": "softmax",
        "renormalize": True,
    }
    return MoEConfig(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_route_matches_transformers_routers(norm_topk_prob: bool) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(17, 24)
    mixtral = MixtralTopKRouter(transformers.MixtralConfig(hidden_size=24, num_local_experts=6))
    qwen_cfg = transformers.Qwen2MoeConfig(
        hidden_size=24, num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob
    )
    qwen = Qwen2MoeTopKRouter(qwen_cfg)
    cases = [(mixtral, _moe()), (qwen, _moe(renormalize=norm_topk_prob))]
    for router, moe in cases:
        with torch.no_grad():
            router.weight.normal_()
            logits, ref_weights, ref_ids = router(hidden)
        weights, ids = route(logits, moe)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_route_matches_deepseek_v2_router(method: str) -> None:
    """Group-limited top-k (and plain), routed scaling, no renormalisation; transformers
    leaves the top-k unsorted, so each row's (id, weight) pairs are compared as sets."""
    torch.manual_seed(3)
    hidden = torch.randn(29, 24)
    cfg = transformers.DeepseekV2Config(
        hidden_size=24,
        num_attention_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=3,
        topk_method=method,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    )
    router = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        logits, ref_weights, ref_ids = router(hidden)
    grouped = method == "group_limited_greedy"
    moe = _moe(
        num_experts=8,
        top_k=3,
        renormalize=False,
        routed_scaling=1.5,
        num_groups=4 if grouped else 1,
        topk_groups=2 if grouped else 1,
    )
    weights, ids = route(logits, moe)
    for row in range(hidden.shape[0]):
        ours = dict(zip(ids[row].tolist(), weights[row].tolist(), strict=True))
        ref = dict(zip(ref_ids[row].tolist(), ref_weights[row].tolist(), strict=True))
        assert ours.keys() == ref.keys(), f"row {row}"
        assert all(abs(ours[e] - ref[e]) < 1e-6 for e in ours)


def test_sigmoid_routing_scales_renormalised_weights() -> None:
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0], [3.0, 2.5, -2.0, 1.0]])
    weights, ids = route(logits, _moe(num_experts=4, scoring="sigmoid", routed_scaling=2.5))
    assert ids.tolist() == [[2, 0], [0, 1]]
    s = torch.sigmoid(logits)
    expected = torch.stack([s[0, [2, 0]], s[1, [0, 1]]])
    torch.testing.assert_close(weights, 2.5 * expected / expected.sum(-1, keepdim=True))


def _expert_inputs(
    dtype: torch.dtype, t: int = 23
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, weights and ids ``[T, k]``
    with some ids ``-1`` (held by another rank) and expert 3 routed nothing."""
    gen = torch.Generator().manual_seed(1)
    e, h, i, k = 5, 40, 12, 2
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (0.2 * torch.randn(e, 2 * i, h, generator=gen)).to(dtype)
    w2 = (0.2 * torch.randn(e, h, i, generator=gen)).to(dtype)
    scores = torch.rand(t, e, generator=gen)
    scores[:, 3] = -1.0
    weights, ids = scores.topk(k, dim=-1)
    ids[::4, 1] = -1
    ids[5] = -1  # a row routed to no local expert
    return x, w13, w2, weights.softmax(-1), ids


def _per_token(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The contract, one token and one expert at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            if e < 0:
                continue
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (w2[e].double() @ (F.silu(gate) * up))
    return out


def _backends() -> list[Backend]:
    return [ReferenceBackend(), CpuBackend(), CudaBackend()]  # cuda: Triton, interpreted on CPU


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("ops", _backends(), ids=lambda b: b.name)
def test_fused_moe_matches_the_per_token_loop(
    ops: Backend, dtype: torch.dtype, rtol: float
) -> None:
    x, w13, w2, weights, ids = _expert_inputs(dtype)
    expected = _per_token(x, w13, w2, weights, ids)
    packed13 = tuple(ops.pack_linear(w) for w in w13)
    packed2 = tuple(ops.pack_linear(w) for w in w2)
    for experts in (ExpertWeights(w13, w2), ExpertWeights(w13, w2, packed13, packed2)):
        out = ops.fused_moe(x, experts, weights, ids)
        assert out.dtype == dtype and out.shape == x.shape
        err = ((out.double() - expected).abs().max() / expected.abs().max()).item()
        assert err < rtol, f"{ops.name} {dtype}: relative error {err:.2e}"
        assert torch.equal(out[5], torch.zeros_like(out[5]))


@pytest.mark.skipif(
    CpuBackend().pack_linear(torch.zeros(1, 1)) is None,
    reason="no packed GEMM here (neither our AVX-512 kernel nor oneDNN): F.linear's rows vary",
)
def test_cpu_fused_moe_rows_do_not_depend_on_the_batch() -> None:
    ops = CpuBackend()
    x, w13, w2, weights, ids = _expert_inputs(torch.float32)
    experts = ExpertWeights(
        w13, w2, tuple(map(ops.pack_linear, w13)), tuple(map(ops.pack_linear, w2))
    )
    whole = ops.fused_moe(x, experts, weights, ids)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 11)):
        part = ops.fused_moe(x[rows], experts, weights[rows], ids[rows])
        assert torch.equal(part, whole[rows]), f"{ops.name}: rows {rows}"


def test_expert_param_of_maps_each_naming() -> None:
    qwen = ("gate_proj", "up_proj", "down_proj")
    mixtral = ("w1", "w3", "w2")
    got = expert_param_of("model.layers.2.mlp.experts.11.up_proj.weight", qwen)
    assert got == ("model.layers.2.mlp.experts.w13_weight", (11, "up"))
    got = expert_param_of("model.layers.0.block_sparse_moe.experts.3.w2.weight", mixtral)
    assert got == ("model.layers.0.block_sparse_moe.experts.w2_weight", (3, "down"))
    assert expert_param_of("model.layers.0.mlp.shared_expert.gate_proj.weight", qwen) is None
    assert expert_param_of("model.layers.0.mlp.experts.1.w1.weight", qwen) is None


def _rank_ctx(tp_rank: int, tp: int, expert_parallel: bool) -> ShardContext:
    """A rank's context for building and loading layers (no collective is called)."""
    ps = ParallelState(tp_rank, tp_rank, tp, 0, 1, torch.device("cpu"), None, None, None, 0.0)
    return ShardContext(Comm(ps), ReferenceBackend(), torch.float32, expert_parallel)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_reads_only_its_experts_share(tmp_path: Path, expert_parallel: bool) -> None:
    """tp=2: with expert parallelism rank 1 reads experts 3..5 whole, else a half of all six;
    either way half of the experts' bytes."""
    moe, h = _moe(), 16
    gen = torch.Generator().manual_seed(2)
    tensors = {
        f"mlp.experts.{e}.{p}.weight": torch.randn(shape, generator=gen)
        for e in range(6)
        for p, shape in (("gate_proj", (10, h)), ("up_proj", (10, h)), ("down_proj", (h, 10)))
    }
    save_file(tensors, tmp_path / "model.safetensors")
    experts = FusedExperts(h, moe, _rank_ctx(1, 2, expert_parallel))
    names = ("gate_proj", "up_proj", "down_proj")
    params = dict(experts.named_parameters())
    with Checkpoint(tmp_path) as checkpoint:
        for name in sorted(tensors):
            found = expert_param_of(name, names)
            assert found is not None
            param = params[found[0].removeprefix("mlp.experts.")]
            param.weight_loader(param, checkpoint.source(name), found[1])  # type: ignore[attr-defined]
        bytes_read = checkpoint.bytes_read
    assert bytes_read == sum(t.numel() * 4 for t in tensors.values()) // 2
    if expert_parallel:
        assert experts.w13_weight.shape == (3, 20, h) and experts.first_expert == 3
        for local, e in enumerate(range(3, 6)):
            gate_up = torch.cat(
                [
                    tensors[f"mlp.experts.{e}.gate_proj.weight"],
                    tensors[f"mlp.experts.{e}.up_proj.weight"],
                ]
            )
            assert torch.equal(experts.w13_weight[local], gate_up)
            assert torch.equal(
                experts.w2_weight[local], tensors[f"mlp.experts.{e}.down_proj.weight"]
            )
        ids = torch.tensor([[0, 4], [5, 3], [1, 2]])
        assert experts.local_ids(ids).tolist() == [[-1, 1], [2, 0], [-1, -1]]
    else:
        assert experts.w13_weight.shape == (6, 10, h)
        for e in range(6):
            gate_up = torch.cat(
                [
                    tensors[f"mlp.experts.{e}.gate_proj.weight"][5:],
                    tensors[f"mlp.experts.{e}.up_proj.weight"][5:],
                ]
            )
            assert torch.equal(experts.w13_weight[e], gate_up)
            assert torch.equal(
                experts.w2_weight[e], tensors[f"mlp.experts.{e}.down_proj.weight"][:, 5:]
            )
