"""Qwen2.5-VL M-RoPE positions (model_shards/models/qwen2_5_vl/rope.py) against
transformers' ``Qwen2_5_VLModel.get_rope_index`` on the same token layout."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from model_shards.models.qwen2_5_vl.rope import IMAGE, TEXT, VIDEO, mrope_positions


def _hf_rope_index(
    types: list[int],
    images: list[tuple[int, int, int]],
    videos: list[tuple[int, int, int]],
    seconds: list[float],
) -> tuple[torch.Tensor, int, float]:
    """transformers' positions, delta and ``tokens_per_second`` for one sequence."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = Qwen2_5_VLConfig()
    vision: Any = config.vision_config
    model: Any = Qwen2_5_VLModel  # unbound methods on a stand-in ``self`` (no weights)
    fake = SimpleNamespace(
        config=config,
        get_vision_position_ids=lambda *a, **k: model.get_vision_position_ids(None, *a, **k),
    )
    ids = torch.zeros(1, len(types), dtype=torch.long)
    positions, deltas = model.get_rope_index(
        fake,
        ids,
        torch.tensor([types]),
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
        second_per_grid_ts=torch.tensor(seconds) if seconds else None,
    )
    return (
        positions[:, 0],
        int(deltas[0, 0]),
        float(vision.tokens_per_second),
    )


def test_positions_equal_transformers() -> None:
    images = [(1, 4, 6), (1, 10, 2)]
    videos = [(2, 4, 4)]
    seconds = [0.5]
    types = [TEXT] * 3 + [IMAGE] * 6 + [TEXT] * 2 + [VIDEO] * 8 + [TEXT] + [IMAGE] * 5 + [TEXT] * 4
    want, want_delta, tps = _hf_rope_index(types, images, videos, seconds)
    got, delta = mrope_positions(types, images, videos, 2, tps, seconds)
    assert torch.equal(got, want)
    assert delta == want_delta
    assert int(got[0, 11 + 4]) - int(got[0, 11]) == int(tps * 0.5)  # video frame spacing


def test_text_only_is_plain_positions() -> None:
    got, delta = mrope_positions([TEXT] * 5, [], [], 2)
    assert torch.equal(got, torch.arange(5).expand(3, -1)) and delta == 0


def test_rejects_run_not_matching_grid() -> None:
    import pytest

    with pytest.raises(ValueError, match="media tokens"):
        mrope_positions([TEXT, IMAGE, IMAGE], [(1, 4, 4)], [], 2)
