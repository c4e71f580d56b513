"""A tiny random Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) checkpoint, its
``preprocessor_config.json``, test images and videos; transformers' reference outputs.

Vision tower: depth 2 (block 1 full attention, block 0 windowed over 2 x 2 merged
tokens), hidden 32, 4 heads, intermediate 64, 14-pixel patches, 2 x 2 merge, 2-frame
temporal patches, ``tokens_per_second`` 2. Language model: Qwen2 shape, hidden 64, 4
heads over 2 KV heads (head_dim 16, ``mrope_section`` [2, 3, 3]), intermediate 128, 2
layers (pp=2 splits 1 + 1), vocab 1001, tied embeddings. The tokenizer is the shared test
tokenizer (960 ids) plus the four vision tokens below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from tokenizers import AddedToken

from tests.checkpoints import MAX_POSITIONS, randomize, write_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 960, 961, 962, 963
SPECIAL = {
    "<|vision_start|>": VISION_START,
    "<|vision_end|>": VISION_END,
    "<|image_pad|>": IMAGE_PAD,
    "<|video_pad|>": VIDEO_PAD,
}
PATCH, MERGE, TEMPORAL = 14, 2, 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH
TOKENS_PER_SECOND = 2
PREPROCESSOR: dict[str, Any] = {
    "min_pixels": 28 * 28,
    "max_pixels": 28 * 28 * 40,
    "image_mean": [0.5, 0.4, 0.3],
    "image_std": [0.2, 0.25, 0.3],
}


def build(path: Path) -> Path:
    """Write the checkpoint, tokenizer files and ``preprocessor_config.json`` into ``path``."""
    config = transformers.Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 1001,
            "max_position_embeddings": MAX_POSITIONS,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
            "tie_word_embeddings": True,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": None,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "num_heads": 4,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "tokens_per_second": TOKENS_PER_SECOND,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL,
        },
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    randomize(model, seed=4242)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, qwen2_style=True)
    _add_vision_tokens(path)
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_pil

    hf_pil.Qwen2VLImageProcessorPil(**PREPROCESSOR).save_pretrained(path)
    return path


def _add_vision_tokens(path: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokens = [AddedToken(t, special=True, normalized=False) for t in SPECIAL]
    tokenizer.add_special_tokens(tokens)
    assert all(tokenizer.token_to_id(t) == i for t, i in SPECIAL.items())
    tokenizer.save(str(path / "tokenizer.json"), pretty=True)


def video_patches(seed: int, frames: int, size: tuple[int, int]) -> tuple[np.ndarray, list[int]]:
    """``frames`` random normalised ``size = (H, W)`` frames cut as transformers'
    ``Qwen2VLVideoProcessor`` does: ``([t h w, C T P P] float32, [t, h, w])``."""
    rng = np.random.default_rng(seed)
    video = rng.standard_normal((frames, 3, *size)).astype(np.float32)  # [F, C, H, W]
    t, h, w = frames // TEMPORAL, size[0] // PATCH, size[1] // PATCH
    m = MERGE
    x = video.reshape(t, TEMPORAL, 3, h // m, m, PATCH, w // m, m, PATCH)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(t * h * w, PATCH_DIM)), [t, h, w]


def hf_generate(
    path: Path, prompt_ids: list[int], media: list[dict[str, Any]], new: int
) -> list[int]:
    """transformers' ``generate()``: exactly ``new`` greedy tokens after ``prompt_ids``
    (placeholders expanded). ``media``: in prompt order, each ``{"kind", "pixels"
    [N, C T P P], "grid" [t, h, w], "second_per_grid"}``."""
    model: Any = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([prompt_ids])
    types = torch.zeros_like(ids)
    types[ids == IMAGE_PAD] = 1
    types[ids == VIDEO_PAD] = 2
    kwargs: dict[str, Any] = {"mm_token_type_ids": types}
    images = [m for m in media if m["kind"] == "image"]
    videos = [m for m in media if m["kind"] == "video"]
    if images:
        kwargs["pixel_values"] = torch.cat([torch.from_numpy(m["pixels"]) for m in images])
        kwargs["image_grid_thw"] = torch.tensor([m["grid"] for m in images])
    if videos:
        kwargs["pixel_values_videos"] = torch.cat([torch.from_numpy(m["pixels"]) for m in videos])
        kwargs["video_grid_thw"] = torch.tensor([m["grid"] for m in videos])
        kwargs["second_per_grid_ts"] = torch.tensor([m["second_per_grid"] for m in videos])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()
