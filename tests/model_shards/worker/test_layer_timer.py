"""model_shards.worker.layer_timer: hooks only inside the block; benchmarks.suites.ttft shows
the kinds."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.suites.ttft import labels_in_order, stage_ms
from model_shards.worker.layer_timer import PREFIX, timed


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(4, 4)
        self.attn = nn.Identity()
        self.o_proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(x)))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(4)
        self.self_attn = _Attn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x))


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return x


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_kinds_accumulate_inside_the_block_only() -> None:
    model = _Model()
    ids = torch.tensor([1, 2, 3])
    totals: dict[str, int] = {}
    with timed(model, totals):
        assert _hooks(model) > 0
        model.model(ids)
    assert _hooks(model) == 0  # the normal path runs without hooks
    assert set(totals) == {
        "embedding",
        "norms",
        "attention block",
        "attention GEMM",
        "attention kernel",
    }
    assert totals["attention GEMM"] + totals["attention kernel"] <= totals["attention block"]
    before = dict(totals)
    model.model(ids)
    assert totals == before  # nothing counted outside the block


def test_ttft_rows_show_the_kinds_under_prefill() -> None:
    record = {
        "engine": {"plan_sent": 0, "forward_done": 3_000_000, PREFIX + "MLP block": 1_500_000}
    }
    out = stage_ms({}, record)
    assert out["prefill compute (all layers)"] == 3.0 and out["↳ MLP block"] == 1.5
    labels = labels_in_order()
    assert labels.index("↳ MLP block") == labels.index("prefill compute (all layers)") + 6
