"""A tiny random LLaVA (``LlavaForConditionalGeneration``) checkpoint, its
``preprocessor_config.json`` and test images; transformers' reference outputs.

CLIP tower: hidden 32, 4 heads (head_dim 8), intermediate 96, 3 layers of which
``vision_feature_layer -2`` uses the first 2, 30-pixel images in 6-pixel patches (25
patches, CLS dropped: 25 placeholder tokens per image), quick-GELU. Language model: the
tiny Llama shape (hidden 64, 4 heads over 2 KV heads, intermediate 128), 2 layers (pp=2
splits 1 + 1), vocab 1001, untied head. The projector is biased, GELU. The preprocessor
resizes the short side to 34 pixels and center-crops 30 x 30 (both steps matter), CLIP's
mean and std. The tokenizer is the shared test tokenizer (960 ids) plus ``<image>`` =
:data:`IMAGE_TOKEN_ID`, with a ``USER: … ASSISTANT:`` chat template.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import AddedToken

from tests.checkpoints import MAX_POSITIONS, WEIGHT_STD, randomize, write_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 960
TOKENS_PER_IMAGE = 25
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "USER: {{ message['content'] }}\n{% elif message['role'] == 'assistant' %}"
    "ASSISTANT: {{ message['content'] }}{{ eos_token }}\n{% else %}{{ message['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build(path: Path) -> Path:
    """Write the checkpoint, tokenizer files and ``preprocessor_config.json`` into ``path``."""
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=30,
        patch_size=6,
        projection_dim=32,
        hidden_act="quick_gelu",
    )
    text = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=1001,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN_ID,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        image_seq_length=TOKENS_PER_IMAGE,
        initializer_range=WEIGHT_STD,
    )
    config.text_config.dtype = "float32"
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    randomize(model, seed=777)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, qwen2_style=False, chat_template=CHAT_TEMPLATE)
    _add_image_token(path)
    processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": 34}, crop_size={"height": 30, "width": 30}
    )
    processor.save_pretrained(path)
    return path


def _add_image_token(path: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    assert tokenizer.token_to_id(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    tokenizer.save(str(path / "tokenizer.json"), pretty=True)


def image(seed: int, size: tuple[int, int] = (41, 37), mode: str = "RGB") -> Image.Image:
    """A random image (``size`` is PIL's ``(width, height)``), a function of ``seed``."""
    rng = np.random.default_rng(seed)
    channels = len(mode)
    data = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(data if channels > 1 else data[..., 0], mode)


def encoded(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def hf_pixels(path: Path, img: Image.Image) -> torch.Tensor:
    """transformers' preprocessing of ``img`` with the checkpoint's processor: ``[3, 30, 30]``."""
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    return processor(images=[img], return_tensors="pt")["pixel_values"][0]


def hf_generate(path: Path, prompt_ids: list[int], pixels: torch.Tensor, new: int) -> list[int]:
    """transformers' ``generate()``: exactly ``new`` greedy tokens after ``prompt_ids`` (whose
    image placeholders are already expanded), ``pixels [N, 3, 30, 30]``."""
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=pixels,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()
