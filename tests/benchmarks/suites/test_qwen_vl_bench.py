"""The Qwen2.5-VL bench model (:mod:`benchmarks.suites.qwen_vl_bench`) is what its docstring says:
the engine reads it as Qwen2.5-VL, the frontend's preprocessing and transformers' make the
same 99-token image of each bench image, and the chat template writes the vision tokens
for an image part, which tokenize to the checkpoint's special ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import transformers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from benchmarks.suites import qwen_vl_bench
from model_shards.config.model import ModelConfig
from model_shards.config.qwen2_5_vl import qwen_vl_config
from server.media.qwen2_5_vl.image import QwenVLPreprocessor


def test_bench_model_images_and_template(tmp_path: Path) -> None:
    model_dir = qwen_vl_bench.ensure_model(tmp_path / "qwen")
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert (cfg.hidden_size, cfg.num_layers) == (512, 6)
    vl = qwen_vl_config(cfg.extra, cfg.head_dim)
    ours = QwenVLPreprocessor.from_file(model_dir / "preprocessor_config.json")
    theirs = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    images = qwen_vl_bench.images(2)
    features = theirs(images=images, return_tensors="np")
    for i, image in enumerate(images):
        mine = ours(image)
        assert mine.grid_thw == (1, 18, 22) and mine.num_tokens == 99
        assert list(features["image_grid_thw"][i]) == list(mine.grid_thw)
        rows = features["pixel_values"][i * 396 : (i + 1) * 396]
        np.testing.assert_allclose(mine.pixels, rows, rtol=0, atol=1e-5)
    assert not np.array_equal(ours(images[0]).pixels, ours(images[1]).pixels)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    content = [{"type": "image"}, {"type": "text", "text": "hi"}]
    messages: Any = [{"role": "user", "content": content}]
    text = str(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    assert "<|vision_start|><|image_pad|><|vision_end|>hi" in text
    ids = tok(text, add_special_tokens=False)["input_ids"]
    start = ids.index(vl.vision_start_token_id)
    assert ids[start : start + 3] == [
        vl.vision_start_token_id,
        vl.image_token_id,
        vl.vision_end_token_id,
    ]
