"""Qwen2.5-VL vision tower (model_shards/models/qwen2_5_vl/tower.py) against transformers'
``Qwen2_5_VisionTransformerPretrainedModel`` on the same random weights, loaded from a
safetensors file (the checkpoint's ``visual.`` names) by each parameter's
``weight_loader``: two images of different sizes from the frontend's preprocessing, plus
a 2-frame video grid; at tp=1 in this process and at tp=2 in a gloo world."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file

from model_shards.backends import ReferenceBackend
from model_shards.layers.context import ShardContext
from model_shards.models.qwen2_5_vl.tower import (
    QwenVisionConfig,
    QwenVisionTower,
    attention_segments,
    segment_attention,
)
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.checkpoint import Checkpoint
from server.media.qwen2_5_vl.image import QwenVLPreprocessor
from tests.world import run_world

VISION: dict[str, Any] = {
    "depth": 3,
    "hidden_size": 64,
    "num_heads": 4,
    "intermediate_size": 90,
    "out_hidden_size": 48,
    "window_size": 56,  # 2 x 2 merged tokens per window: the test grids hold many
    "fullatt_block_indexes": [1],
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
Grids = list[tuple[int, int, int]]


def _inputs() -> tuple[torch.Tensor, Grids]:
    raw = {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 40, "image_mean": [0.5, 0.4, 0.3]}
    pre = QwenVLPreprocessor.from_dict({**raw, "image_std": [0.2, 0.25, 0.3]}, "test")
    rng = np.random.default_rng(0)
    parts, grids = [], []
    for h, w in ((84, 140), (112, 56)):  # patch grids 6 x 10 and 8 x 4
        image = pre(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
        parts.append(torch.from_numpy(image.pixels))
        grids.append(image.grid_thw)
    assert grids == [(1, 6, 10), (1, 8, 4)]
    video = (2, 4, 6)  # two temporal patches of a 4 x 6 grid
    parts.append(torch.randn(video[0] * video[1] * video[2], parts[0].shape[1]))
    grids.append(video)
    return torch.cat(parts), grids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``model.safetensors`` (random HF tower) and ``io.safetensors`` (its input/output)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    torch.manual_seed(0)
    config = Qwen2_5_VLVisionConfig(**VISION)
    config._attn_implementation = "sdpa"
    model: Any = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, activations away from 0
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.08) + (p.dim() == 1) * 1.0)
        pixels, grids = _inputs()
        want = model(pixels, grid_thw=torch.tensor(grids)).pooler_output
    path = tmp_path_factory.mktemp("qwen_vl_tower")
    state = {f"visual.{k}": v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))  # the checkpoint's names
    grid_t = torch.tensor(grids)
    save_file({"pixels": pixels, "grids": grid_t, "want": want}, str(path / "io.safetensors"))
    return path


def _tower(path: Path, ctx: ShardContext, **overrides: Any) -> QwenVisionTower:
    tower = QwenVisionTower(QwenVisionConfig.from_dict({**VISION, **overrides}), ctx)
    params = dict(tower.named_parameters())
    with Checkpoint(path) as ckpt:
        assert {f"visual.{n}" for n in params} == set(ckpt.names())  # one parameter each
        for name, param in params.items():
            param.weight_loader(param, ckpt.source(f"visual.{name}"))  # type: ignore[attr-defined]
    return tower


def _error(path: Path, ctx: ShardContext, **overrides: Any) -> float:
    """Relative error of the tower's output against transformers'."""
    io = load_file(str(path / "io.safetensors"))
    grids = [(int(t), int(h), int(w)) for t, h, w in io["grids"].tolist()]
    with torch.no_grad():
        got = _tower(path, ctx, **overrides)(io["pixels"], grids)
    want = io["want"]
    assert got.shape == want.shape == (sum(t * h * w for t, h, w in grids) // 4, 48)
    return float((got - want).norm() / want.norm())


def test_tower_equals_transformers(checkpoint: Path) -> None:
    torch.set_num_threads(1)
    ctx = ShardContext.single_process(ReferenceBackend())
    err = _error(checkpoint, ctx)
    assert err <= 1e-4, f"relative error {err:.2e}"
    # windows matter: the same weights with every block attending per frame differ
    assert _error(checkpoint, ctx, fullatt_block_indexes=[0, 1, 2]) > 1e-3


def _tp_rank(comm: Comm, path: str) -> None:
    err = _error(Path(path), ShardContext(comm, ReferenceBackend(), torch.float32))
    assert err <= 1e-4, f"rank {comm.ps.tp_rank}: relative error {err:.2e}"


@pytest.mark.timeout(120)
def test_tower_tp2_equals_transformers(checkpoint: Path) -> None:
    run_world(_tp_rank, 2, 1, str(checkpoint), timeout=100)


def test_tower_rejects_heads_not_split_by_tp() -> None:
    ps = replace(single_process_state(), tp_size=3)
    ctx = ShardContext(Comm(ps), ReferenceBackend(), torch.float32)
    with pytest.raises(ValueError, match="tp=3"):
        QwenVisionTower(QwenVisionConfig.from_dict(VISION), ctx)


def test_full_attention_segments_are_one_per_frame() -> None:
    """A 2-frame video then an image: each frame its own segment (no running-sum drift)."""
    assert attention_segments([(2, 4, 4), (1, 2, 2)]) == [0, 16, 32, 36]


def test_segment_attention_batches_equal_lengths_like_one_call_each() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(40, 4, 8) for _ in range(3))  # [N, nh, hd]
    cu = [0, 16, 16, 32, 36, 40]  # lengths 16, 0, 16, 4, 4
    got = segment_attention(q, k, v, cu)
    for start, end in itertools.pairwise(cu):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
            want = F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)
            torch.testing.assert_close(got[start:end], want, rtol=1e-6, atol=1e-6)
