"""Qwen2-VL image preprocessing (server/media/qwen2_5_vl/image.py) against transformers'
``Qwen2VLImageProcessor`` on the same saved ``preprocessor_config.json``: pixel values and
``image_grid_thw`` equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from server.media.qwen2_5_vl.image import (
    QwenVLPreprocessor,
    smart_resize,
)


def _save_config(tmp_path: Path) -> Path:
    from transformers import AutoImageProcessor
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_pil

    hf = hf_pil.Qwen2VLImageProcessorPil(
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 30,
        image_mean=[0.5, 0.4, 0.3],
        image_std=[0.2, 0.25, 0.3],
    )
    hf.save_pretrained(tmp_path)
    assert AutoImageProcessor.from_pretrained(tmp_path) is not None
    return tmp_path / "preprocessor_config.json"


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    rgb = [
        rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((50, 70), (300, 90), (20, 20))
    ]
    out = [Image.fromarray(a) for a in rgb]
    out.append(Image.fromarray(rng.integers(0, 256, (64, 40, 4), dtype=np.uint8), "RGBA"))
    return out


def test_pixels_and_grid_equal_transformers(tmp_path: Path) -> None:
    from transformers import AutoImageProcessor

    path = _save_config(tmp_path)
    hf = AutoImageProcessor.from_pretrained(tmp_path)
    ours = QwenVLPreprocessor.from_file(path)
    for image in _images():
        want = hf(images=[image], return_tensors="np")
        got = ours(image)
        assert got.grid_thw == tuple(int(v) for v in want["image_grid_thw"][0])
        assert got.pixels.shape == want["pixel_values"].shape
        np.testing.assert_array_equal(got.pixels, want["pixel_values"])
        t, h, w = got.grid_thw
        assert got.num_tokens == t * h * w // 4


def test_smart_resize_bounds() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

    for height in (17, 50, 70, 333, 1000):
        for width in (20, 70, 91, 640):
            args = (28, 28 * 28 * 4, 28 * 28 * 30)
            assert smart_resize(height, width, *args) == hf_resize(height, width, *args)
    h, w = smart_resize(1000, 300, 28, 28 * 28 * 4, 28 * 28 * 30)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 28 * 28 * 30
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, 28, 1, 10**9)


def test_rejects_other_processor(tmp_path: Path) -> None:
    path = tmp_path / "preprocessor_config.json"
    path.write_text('{"image_processor_type": "CLIPImageProcessor"}')
    with pytest.raises(ValueError, match="not supported"):
        QwenVLPreprocessor.from_file(path)
