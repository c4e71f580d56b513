"""The Qwen2.5-VL rows of :mod:`benchmarks.suites.vlm_bench`: the model, its images, and
``transformers`` ``generate()`` on them.

The model is a small random ``Qwen2_5_VLForConditionalGeneration``, float32, built once
under ``benchmarks/.cache``: vision tower depth 6 (blocks 2 and 5 full attention, the rest
windowed over 4 x 4 merged tokens), hidden 256, 8 heads, intermediate 1024, 14-pixel
patches merged 2 x 2, 2-frame temporal patches; Qwen2 language model as the LLaVA
bench's Llama (6 layers, hidden 512, 8 heads over 4 KV heads, intermediate 1408) with
M-RoPE ``[8, 12, 12]``. Its ``preprocessor_config.json`` is transformers'
``Qwen2VLImageProcessorPil``'s (dynamic resolution: ``min_pixels`` 4, ``max_pixels`` 256
merged tokens of 28 x 28 pixels); each bench image is 300 x 260 random pixels, resized to
308 x 252: 11 x 9 = 99 image tokens. The tokenizer is the built-in BPE one plus
``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``, with a
chat template that writes ``<|vision_start|><|image_pad|><|vision_end|>`` for an image
part (the frontend expands the pad to the image's tokens).

``generate()`` takes the same images through transformers' own Pillow image processor
(``Qwen2VLImageProcessorPil``: no torchvision needed), the prompt rendered by the same
template and its pad expanded as transformers' ``Qwen2_5_VLProcessor`` does.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from benchmarks.harness.paths import CACHE

MODEL_DIR = CACHE / "qwen2_5_vl-bench-v1"
QUESTION = "Describe the picture in detail."
OUTPUT_LEN = 32
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PAD = "<|image_pad|>"
IMAGE_SIZE = (300, 260)  # (width, height): 308 x 252 after smart_resize, 99 tokens
UNIT = 28 * 28  # pixels of one merged token
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def ensure_model(path: Path = MODEL_DIR) -> Path:
    """The random bench Qwen2.5-VL (see the module docstring), built once."""
    if (path / "preprocessor_config.json").is_file():
        return path
    import torch
    import transformers
    from tokenizers import AddedToken
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from model_shards.launch.default_model import build_tokenizer, tokenizer_config

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS]
    )
    vocab = tokenizer.get_vocab()
    ids = {t: vocab[t] for t in VISION_TOKENS}
    config = transformers.Qwen2_5_VLConfig(
        text_config=_text_config(tokenizer.get_vocab_size()),
        vision_config={
            "depth": 6,
            "hidden_size": 256,
            "num_heads": 8,
            "intermediate_size": 1024,
            "out_hidden_size": 512,
            "window_size": 112,
            "fullatt_block_indexes": [2, 5],
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    tok_config = {**tokenizer_config(1024), "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    Qwen2VLImageProcessorPil(min_pixels=4 * UNIT, max_pixels=256 * UNIT).save_pretrained(path)
    return path


def _text_config(vocab_size: int) -> dict[str, Any]:
    return {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": vocab_size,
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [8, 12, 12],
        },
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": None,
    }


def images(n: int) -> list[Image.Image]:
    """``n`` distinct random images of :data:`IMAGE_SIZE`."""
    rng = np.random.default_rng(1)
    w, h = IMAGE_SIZE
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(n)]


def hf_point(model_dir: Path, imgs: list[Image.Image], c: int) -> dict[str, float]:
    """``generate()`` over batches of ``c`` requests (all one prompt length: no padding);
    images/s from the ``OUTPUT_LEN``-token calls, TTFT from ``max_new_tokens=1`` calls."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    torch.set_num_threads(2)
    model: Any = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    content: Any = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = str(
        tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
    )
    image_id = model.config.image_token_id
    batches = [imgs[i : i + c] for i in range(0, len(imgs), c)]
    walls: list[float] = []
    ttfts: list[float] = []
    with torch.no_grad():
        for batch in [batches[0], *batches]:  # the first batch twice: a warm-up
            features = processor(images=batch, return_tensors="pt")
            grid = features["image_grid_thw"]  # [N, 3], all one size
            tokens = int(grid[0].prod()) // processor.merge_size**2
            ids = tok(text.replace(IMAGE_PAD, IMAGE_PAD * tokens), add_special_tokens=False)
            input_ids = torch.tensor([ids["input_ids"]] * len(batch))
            kwargs = {
                "input_ids": input_ids,
                "attention_mask": torch.ones_like(input_ids),
                "mm_token_type_ids": (input_ids == image_id).long(),
                "pixel_values": features["pixel_values"],
                "image_grid_thw": grid,
                "do_sample": False,
            }
            for new, out in ((1, ttfts), (OUTPUT_LEN, walls)):
                start = time.perf_counter()
                model.generate(**kwargs, max_new_tokens=new, min_new_tokens=new)
                out.append(time.perf_counter() - start)
    walls, ttfts = walls[1:], ttfts[1:]
    return {"images_per_s": len(imgs) / sum(walls), "ttft_ms": 1000 * statistics.median(ttfts)}
