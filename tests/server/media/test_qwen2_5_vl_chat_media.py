"""Qwen2.5-VL chat prompts in the frontend (fake engine): what the engine receives for a
chat request with image and video parts is what transformers' ``Qwen2_5_VLProcessor``
makes of the same messages and the same decoded frames — prompt ids with each
``<|image_pad|>`` / ``<|video_pad|>`` expanded, each item's pixel rows, grid and
``second_per_grid_ts`` — and ``/v1/models`` lists the video modality.

The checkpoint is the tiny random Qwen2.5-VL of :mod:`tests.vlm.qwen2_5_vl_checkpoint`
with the Qwen2-VL chat template; transformers' video processor runs over the torchvision
stand-in of :mod:`tests.vlm.qwen_vl_hf_video` (torchvision is not installable here).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from server.media.multimodal import ImageModel
from server.text.tokenizer import Tokenizer
from tests.server.conftest import ServeFactory
from tests.vlm import qwen2_5_vl_checkpoint as ckpt
from tests.vlm.qwen_vl_hf_video import hf_processor
from tests.vlm.qwen_vl_media import data_url, encode_video, hf_inputs, png, with_template

pytestmark = pytest.mark.timeout(120)

FPS = 2.0


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(ckpt.build(tmp_path_factory.mktemp("qwen-vl-chat") / "qwen"))


def test_the_model_takes_videos_and_qwen_preprocessing(qwen_dir: Path) -> None:
    model = ImageModel.from_dir(qwen_dir)
    assert model is not None and model.qwen is not None
    assert model.modalities == ["text", "image", "video"]
    assert model.image_token_id == ckpt.IMAGE_PAD and model.qwen.video_token_id == ckpt.VIDEO_PAD


async def test_engine_gets_what_transformers_makes(serve: ServeFactory, qwen_dir: Path) -> None:
    images = [png(1, (70, 50)), png(2, (40, 90))]
    videos = [encode_video(9, (64, 48))]  # 0.8 s at 10 fps: 2 fps gives 2 frames
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": data_url(images[0], "image/png")}},
        {"type": "video_url", "video_url": {"url": data_url(videos[0], "video/mp4")}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(images[1], "image/png")}},
    ]
    options = {"image_model": ImageModel.from_dir(qwen_dir)}
    served = await serve(
        served_tokenizer=Tokenizer.from_dir(qwen_dir), app_options=options, vocab_size=1001
    )
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = await served.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (rid,) = served.engine.batches[0]
    request = served.engine.requests[rid]
    parts = [
        {"type": "text", "text": "look"},
        {"type": "image"},
        {"type": "video"},
        {"type": "text", "text": "and"},
        {"type": "image"},
    ]
    want = hf_inputs(qwen_dir, parts, images, videos, FPS)
    assert request.prompt_token_ids == want["input_ids"][0].tolist()
    kinds = [m.kind for m in request.media]
    assert kinds == ["image", "video", "image"]  # prompt order
    image_rows = np.split(want["pixel_values"], np.cumsum(want["image_grid_thw"].prod(-1))[:-1])
    hf_items = [
        ("image", image_rows[0], want["image_grid_thw"][0], 0.0),
        ("video", want["pixel_values_videos"], want["video_grid_thw"][0], None),
        ("image", image_rows[1], want["image_grid_thw"][1], 0.0),
    ]
    ids = request.prompt_token_ids
    for media, (kind, rows, grid, seconds) in zip(request.media, hf_items, strict=True):
        assert media.grid_thw == grid.tolist()
        assert media.shape == list(rows.shape) and media.dtype == "float32"
        assert media.pixels == np.ascontiguousarray(rows, dtype=np.float32).tobytes(), kind
        pad = ckpt.IMAGE_PAD if kind == "image" else ckpt.VIDEO_PAD
        assert media.length == int(grid.prod()) // ckpt.MERGE**2
        assert ids[media.offset : media.offset + media.length] == [pad] * media.length
        assert ids[media.offset - 1] == ckpt.VISION_START
        assert ids[media.offset + media.length] == ckpt.VISION_END
        if seconds is not None:
            assert media.second_per_grid == seconds
    video = request.media[1]
    assert video.second_per_grid == pytest.approx(float(want["second_per_grid_ts"][0]))
    assert video.second_per_grid == ckpt.TEMPORAL / FPS
    assert len({m.content_hash for m in request.media}) == 3
    card = (await served.http.get("/v1/models")).json()["data"][0]
    assert card["modalities"] == ["text", "image", "video"]


async def test_a_string_content_template_gets_vision_tokens(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """A template that joins content to text: each image's marker becomes
    ``<|vision_start|><|image_pad|><|vision_end|>``, as the Qwen template would write."""
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    model_dir = with_template(ckpt.build(tmp_path / "qwen"), plain)
    options = {"image_model": ImageModel.from_dir(model_dir)}
    served = await serve(
        served_tokenizer=Tokenizer.from_dir(model_dir), app_options=options, vocab_size=1001
    )
    image = png(3, (56, 56))
    content = [
        {"type": "image_url", "image_url": {"url": data_url(image, "image/png")}},
        {"type": "text", "text": "hi"},
    ]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = await served.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (rid,) = served.engine.batches[0]
    request = served.engine.requests[rid]
    processor = hf_processor(model_dir)
    text = "user: <|vision_start|><|image_pad|><|vision_end|>\nhi\n"  # parts joined by newlines
    want = processor(
        text=[text],
        images=[Image.open(io.BytesIO(image))],
        return_tensors="np",
        add_special_tokens=False,
    )
    assert request.prompt_token_ids == want["input_ids"][0].tolist()
    (media,) = request.media
    assert media.pixels == want["pixel_values"].tobytes()
    bad = [{"type": "text", "text": "<|image_pad|> sneaks in"}, *content]
    response = await served.http.post(
        "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": bad}]}
    )
    assert response.status_code == 400
    assert "holds the vision token" in response.json()["error"]["message"]


def test_preprocessing_must_fit_the_model(tmp_path: Path) -> None:
    """The preprocessor is chosen by ``image_processor_type`` and checked against the
    architecture and ``vision_config``: a start-up ``ValueError`` naming the file."""
    model_dir = ckpt.build(tmp_path / "qwen")
    config_path = model_dir / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "image_processor_type": "CLIPImageProcessor"}))
    with pytest.raises(ValueError, match="image_processor_type 'CLIPImageProcessor' is not Qwen"):
        ImageModel.from_dir(model_dir)
    config_path.write_text(json.dumps({**config, "patch_size": 7}))
    with pytest.raises(ValueError, match=r"image preprocessor's patch.*\(7, 2, 2\).*\(14, 2, 2\)"):
        ImageModel.from_dir(model_dir)
    (model_dir / "video_preprocessor_config.json").write_text(json.dumps({"merge_size": 4}))
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"video preprocessor's patch.*\(14, 4, 2\)"):
        ImageModel.from_dir(model_dir)


async def test_an_image_past_the_aspect_ratio_is_a_400(serve: ServeFactory, qwen_dir: Path) -> None:
    options = {"image_model": ImageModel.from_dir(qwen_dir)}
    served = await serve(
        served_tokenizer=Tokenizer.from_dir(qwen_dir), app_options=options, vocab_size=1001
    )
    content = [
        {"type": "text", "text": "thin"},
        {"type": "image_url", "image_url": {"url": data_url(png(4, (402, 2)), "image/png")}},
    ]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = await served.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        "'messages[0].content[1].image_url': the image cannot be preprocessed" in error["message"]
    )
    assert "aspect ratio" in error["message"]
    assert not served.engine.batches
