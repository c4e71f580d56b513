"""Qwen2.5-VL video preprocessing (server/media/qwen2_5_vl/video.py) against transformers'
``Qwen2VLVideoProcessor`` on the same frames and the same saved config.

transformers' video processor has only a torchvision backend and torchvision is not
installable here, so the reference is transformers' own video processor, loaded with
``from_pretrained`` from the same directory (config loading, smart_resize, the per-frame
cap, fused rescale + normalise, last-frame padding, patchify), over a stand-in for the
two torchvision functions it calls, transcribed from torchvision's source
(:mod:`tests.vlm.qwen_vl_hf_video`). ``second_per_grid`` is transformers'
``Qwen2_5_VLProcessor`` formula ``temporal_patch_size / sampled_fps``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from server.media.qwen2_5_vl.video import VIDEO_CONFIG, QwenVLVideoPreprocessor
from tests.vlm.qwen_vl_hf_video import hf_video

CONFIG: dict[str, Any] = {
    "video_processor_type": "Qwen2VLVideoProcessor",
    "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 30},
    "image_mean": [0.5, 0.4, 0.3],
    "image_std": [0.2, 0.25, 0.3],
    "resample": 3,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def _frames(count: int, height: int, width: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    ("count", "height", "width", "extra"),
    [
        (4, 50, 70, {}),  # upscaled to the minimum, even frame count
        (3, 300, 90, {}),  # odd: the last frame repeated, downscaled to the maximum
        (1, 56, 56, {}),  # one frame, no resize at all
        (5, 40, 64, {"resample": 2}),  # bilinear
        (6, 120, 160, {"cap_pixels_per_frame": True, "max_video_tokens": 20}),
        (2, 33, 47, {"temporal_patch_size": 3, "image_mean": [0.1] * 3}),
    ],
)
def test_patches_and_grid_equal_transformers(
    tmp_path: Path, count: int, height: int, width: int, extra: dict[str, Any]
) -> None:
    config = {**CONFIG, **extra}
    (tmp_path / VIDEO_CONFIG).write_text(json.dumps(config))
    ours = QwenVLVideoPreprocessor.from_dir(tmp_path)
    frames = _frames(count, height, width)
    want_pixels, want_grid = hf_video(frames, tmp_path)
    got = ours(frames, fps=2.0)
    assert list(got.grid_thw) == want_grid
    assert got.pixels.shape == want_pixels.shape and got.pixels.dtype == np.float32
    np.testing.assert_array_equal(got.pixels, want_pixels)
    tp = config["temporal_patch_size"]
    assert got.grid_thw[0] == -(-count // tp)
    assert got.second_per_grid == tp / 2.0  # transformers: temporal_patch_size / fps
    t, h, w = got.grid_thw
    assert got.num_tokens == t * h * w // 4


def test_config_falls_back_to_preprocessor_config(tmp_path: Path) -> None:
    """Older checkpoints: no video config, the image one's min/max_pixels are the video's
    (transformers' video processor builds itself from it); the video defaults otherwise."""
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**CONFIG, "size": None, "min_pixels": 3136, "max_pixels": 28 * 28 * 9})
    )
    ours = QwenVLVideoPreprocessor.from_dir(tmp_path)
    assert (ours.min_pixels, ours.max_pixels) == (3136, 28 * 28 * 9)
    frames = _frames(2, 90, 120, seed=3)
    want_pixels, want_grid = hf_video(frames, tmp_path)
    got = ours(frames, fps=1.0)
    assert list(got.grid_thw) == want_grid
    np.testing.assert_array_equal(got.pixels, want_pixels)
    (tmp_path / VIDEO_CONFIG).write_text(json.dumps({"video_processor_type": "x"}))
    defaults = QwenVLVideoPreprocessor.from_dir(tmp_path)
    assert (defaults.min_pixels, defaults.max_pixels) == (128 * 28 * 28, 28 * 28 * 768)


def test_malformed_config_names_the_file(tmp_path: Path) -> None:
    (tmp_path / VIDEO_CONFIG).write_text(json.dumps({**CONFIG, "resample": 1}))
    with pytest.raises(ValueError, match=f"{VIDEO_CONFIG}: video resample 1"):
        QwenVLVideoPreprocessor.from_dir(tmp_path)
    (tmp_path / VIDEO_CONFIG).write_text(json.dumps({**CONFIG, "patch_size": "big"}))
    with pytest.raises(ValueError, match="malformed Qwen2-VL video config"):
        QwenVLVideoPreprocessor.from_dir(tmp_path)
