"""The worst-case media of one step (:mod:`model_shards.config.vision_budget`), the items the GPU
KV budget's vision-tower measurement encodes
(:func:`model_shards.worker.gpu_memory.vision_peak_bytes`
is CUDA-only; its tower call, :func:`~model_shards.worker.gpu_memory.encode_dummy_media`, runs
here): on tiny random Qwen2.5-VL and LLaVA checkpoints the dummy items pass the model's
media checks, are at least as large as anything the frontend's preprocessing makes, and
encode through the real towers to ``[length, H]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.config.vision_budget import MediaCaps, grid_of, worst_case_media
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from model_shards.worker.gpu_memory import encode_dummy_media
from server.media.image import ClipPreprocessor
from server.media.qwen2_5_vl.image import QwenVLPreprocessor
from tests.vlm import llava_checkpoint, qwen2_5_vl_checkpoint

MAX_LEN = 256


def _worker(model_dir: Path) -> Worker:
    cfg = ModelConfig.from_dir(model_dir)
    replica = ReplicaConfig(str(model_dir), dtype="float32", max_num_seqs=4, block_size=4)
    return Worker.build(replica, cfg, Comm(single_process_state()), MAX_LEN)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen2_5_vl_checkpoint.build(tmp_path_factory.mktemp("qwen") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llava_checkpoint.build(tmp_path_factory.mktemp("llava") / "llava")


def test_grid_keeps_every_unit_a_legal_shape_allows() -> None:
    assert grid_of(40) == (5, 8)
    assert grid_of(36) == (6, 6)
    assert grid_of(1) == (1, 1)
    assert grid_of(199) == (1, 199)  # a prime under smart_resize's 200:1 bound
    assert grid_of(211) == (14, 15)  # a prime past it: 1 x 211 is no legal shape, 210 is


def test_qwen_items_are_the_largest_the_frontend_makes(qwen_dir: Path) -> None:
    caps = MediaCaps.from_dir(qwen_dir)
    assert caps.image_max_pixels == qwen2_5_vl_checkpoint.PREPROCESSOR["max_pixels"]
    assert caps.video_max_pixels == caps.image_max_pixels  # no video config: the image one
    image, video = (batch for batch in worst_case_media(_raw(qwen_dir), 64, MAX_LEN, caps))
    assert [i.kind for i in image] == ["image"] and [i.kind for i in video] == ["video"]
    # 40 units of 28 x 28 pixels, but a thin image's short side is held at one unit:
    # 16 x 3190 pixels resizes to 28 x 2492 (89 units, 2.2x max_pixels)
    assert image[0].grid_thw == [1, 2, 178] and image[0].length == 89
    # 32 frames: 16 temporal patches, each frame cut to fit 256 placeholders in all
    assert video[0].grid_thw == [16, 8, 8] and video[0].length == MAX_LEN
    pre = QwenVLPreprocessor.from_file(qwen_dir / "preprocessor_config.json")
    made = [pre(Image.new("RGB", size)).num_tokens for size in _sizes()]
    assert max(made) == image[0].length  # some image reaches the bound, none passes it
    short = worst_case_media(_raw(qwen_dir), 64, 20, caps)
    assert [b[0].grid_thw for b in short] == [[1, 8, 10], [16, 2, 2]]  # 20 and 16 tokens


def test_qwen_items_pass_media_checks_and_encode(qwen_dir: Path) -> None:
    worker = _worker(qwen_dir)
    model = worker.model
    batches = worst_case_media(_raw(qwen_dir), 64, MAX_LEN, MediaCaps.from_dir(qwen_dir))
    for items in batches:
        assert [model.media_problem(i) for i in items] == [None] * len(items)  # type: ignore[attr-defined]
        out = encode_dummy_media(model, items, torch.device("cpu"))
        assert [tuple(o.shape) for o in out] == [(i.length, 64) for i in items]
        assert all(bool(torch.isfinite(o).all()) for o in out)


def test_video_config_caps_frames(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 28 * 28 * 90}))
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 3136, "longest_edge": 28 * 28 * 12}})
    )
    caps = MediaCaps.from_dir(tmp_path)
    assert (caps.image_max_pixels, caps.video_max_pixels) == (28 * 28 * 90, 28 * 28 * 12)
    assert MediaCaps.from_dir(tmp_path / "missing") == MediaCaps()


def test_llava_items_fill_a_step_and_encode(llava_dir: Path) -> None:
    raw = _raw(llava_dir)
    per = llava_checkpoint.TOKENS_PER_IMAGE  # 25
    # 64 tokens over back-to-back 25-token runs touch at most 4 of them (1 + 25 + 25 + 13)
    (items,) = worst_case_media(raw, 64, MAX_LEN)
    assert len(items) == 4 and len({i.content_hash for i in items}) == 4
    assert len(worst_case_media(raw, 50, MAX_LEN)[0]) == 3
    pre = ClipPreprocessor.from_file(llava_dir / "preprocessor_config.json")
    frontend = pre(Image.fromarray(np.zeros((41, 37, 3), dtype=np.uint8)))
    assert all(i.shape == list(frontend.shape) and i.length == per for i in items)
    worker = _worker(llava_dir)
    out = encode_dummy_media(worker.model, items, torch.device("cpu"))
    assert [tuple(o.shape) for o in out] == [(per, 64)] * 4


def test_text_only_models_have_no_media() -> None:
    assert worst_case_media({"architectures": ["LlamaForCausalLM"]}, 64, MAX_LEN) == []


def _raw(model_dir: Path) -> dict[str, object]:
    return dict(ModelConfig.from_dir(model_dir).extra)


def _sizes() -> list[tuple[int, int]]:
    """Images of many shapes and sizes, up to far past the pixel cap."""
    sizes = [(w, h) for w in (28, 56, 111, 280, 500, 1120, 3000) for h in (28, 70, 333, 900)]
    return [*sizes, (3190, 16), (16, 3190), (2000, 20), (2799, 15)]
