"""Media for the Qwen2.5-VL frontend and serving tests: the Qwen2-VL chat template, tiny
MP4 videos and PNG images made here, data URLs; transformers' processor inputs for the
same messages (over :mod:`tests.vlm.qwen_vl_hf_video`'s torchvision stand-in)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image

from server.media.video import decode_video_sampled
from tests.vlm.qwen_vl_hf_video import hf_processor

#: Qwen2-VL / Qwen2.5-VL's chat template (as the Qwen checkpoints ship it)
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_template(path: Path, template: str = QWEN_VL_TEMPLATE) -> Path:
    """``path``'s ``tokenizer_config.json`` given ``template``."""
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return path


def encode_video(frames: int, size: tuple[int, int], rate: int = 10, seed: int = 0) -> bytes:
    """An MP4 (mpeg4) of ``frames`` random-blocked ``size = (W, H)`` frames at ``rate`` fps."""
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as box:
        stream = box.add_stream("mpeg4", rate=rate)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            blocks = rng.integers(0, 256, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
            rgb = np.kron(blocks, np.ones((8, 8, 1), dtype=np.uint8))
            box.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        box.mux(stream.encode(None))
    return out.getvalue()


def png(seed: int, size: tuple[int, int]) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def hf_inputs(
    model_dir: Path,
    parts: list[dict[str, Any]],
    images: list[bytes],
    videos: list[bytes],
    fps: float,
    max_frames: int = 32,
) -> dict[str, Any]:
    """transformers' processor on one user message of ``parts`` (images and videos as
    ``{"type": "image"|"video"}``), the decoded images and the frames our decoder samples
    from each video (``fps``, ``max_frames``) with their sampling rate as metadata."""
    from transformers.video_utils import VideoMetadata

    processor = hf_processor(model_dir)
    messages = [{"role": "user", "content": parts}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    clips, metadata = [], []
    for data in videos:
        frames, rate = decode_video_sampled(data, fps, max_frames)
        clips.append(np.stack([np.asarray(f) for f in frames]))
        metadata.append(VideoMetadata(total_num_frames=len(frames), fps=rate))
    kwargs: dict[str, Any] = {}
    if images:
        kwargs["images"] = [Image.open(io.BytesIO(b)) for b in images]
    if videos:
        kwargs["videos"] = clips
        kwargs["videos_kwargs"] = {"video_metadata": metadata, "do_sample_frames": False}
    # add_special_tokens=False: what the processor's own apply_chat_template(tokenize=True)
    # passes (the rendered template already holds any special tokens it wants)
    return dict(processor(text=[text], return_tensors="np", add_special_tokens=False, **kwargs))
