"""A live ``shardserve serve`` of the tiny Qwen2.5-VL: the official ``openai`` SDK sends a
base64 image and a ``video_url`` and gets what ``transformers`` generates (greedy) for the
same messages, the prompt and pixels made by transformers' ``Qwen2_5_VLProcessor``;
``/v1/models`` lists the video modality; every kind of bad video (empty, truncated,
random bytes, audio only, past the frame cap, past the pixel cap, a wrong MIME type, one
too many) is a 400 naming the part while the server stays healthy and keeps answering.

transformers' video processor runs over the torchvision stand-in of
:mod:`tests.vlm.qwen_vl_hf_video` (torchvision is not installable here).
"""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import openai
import pytest
import transformers

from tests.live_server import LiveServer, live_server
from tests.vlm import qwen2_5_vl_checkpoint as ckpt
from tests.vlm.qwen_vl_media import data_url, encode_video, hf_inputs, png, with_template


def _registered() -> bool:
    try:
        from model_shards.models import MODEL_REGISTRY
    except ImportError:
        return False
    return "Qwen2_5_VLForConditionalGeneration" in MODEL_REGISTRY


pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not _registered(), reason="Qwen2_5_VLForConditionalGeneration is not registered yet"
    ),
]

NEW = 8
FPS = 2.0
MAX_FRAMES = 4
QUESTION = "what happens"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(ckpt.build(tmp_path_factory.mktemp("qwen-serve") / "qwen"))


@pytest.fixture(scope="module")
def media() -> tuple[bytes, bytes]:
    """A 70 x 50 PNG and a 1.5 s 64 x 48 MP4 (15 frames at 10 fps: 2 fps gives 4)."""
    return png(7, (70, 50)), encode_video(15, (64, 48), seed=5)


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    args = [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--video-fps",
        str(FPS),
        "--max-video-frames",
        str(MAX_FRAMES),
        "--limit-mm-per-prompt",
        '{"image": 1, "video": 1}',
    ]
    with live_server(args, tmp_path_factory.mktemp("qwen-log")) as server:
        yield server


def _content(png_data: bytes, mp4: bytes) -> list[dict[str, Any]]:
    return [
        {"type": "image_url", "image_url": {"url": data_url(png_data, "image/png")}},
        {"type": "video_url", "video_url": {"url": data_url(mp4, "video/mp4")}},
        {"type": "text", "text": QUESTION},
    ]


@pytest.fixture(scope="module")
def expected(model_dir: Path, media: tuple[bytes, bytes]) -> tuple[str, int]:
    """transformers' answer to ``[image, video, QUESTION]``: its text and prompt length."""
    parts = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": QUESTION}]
    want = hf_inputs(model_dir, parts, [media[0]], [media[1]], FPS, MAX_FRAMES)
    ids = want["input_ids"][0].tolist()
    items = [
        {"kind": "image", "pixels": want["pixel_values"], "grid": want["image_grid_thw"][0]},
        {
            "kind": "video",
            "pixels": want["pixel_values_videos"],
            "grid": want["video_grid_thw"][0],
            "second_per_grid": float(want["second_per_grid_ts"][0]),
        },
    ]
    for item in items:
        item["grid"] = [int(g) for g in item["grid"]]
    tokens = ckpt.hf_generate(model_dir, ids, items, NEW)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return str(tokenizer.decode(tokens, skip_special_tokens=True)), len(ids)


def _chat(server: LiveServer, content: list[dict[str, Any]]) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def test_openai_sdk_sends_an_image_and_a_video(
    served: LiveServer, media: tuple[bytes, bytes], expected: tuple[str, int]
) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": _content(*media)}],  # type: ignore[misc,list-item]
        max_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].message.content == expected[0]
    assert reply.usage is not None and reply.usage.prompt_tokens == expected[1]


def test_models_lists_the_video_modality(served: LiveServer) -> None:
    card = httpx.get(f"{served.url}/v1/models").json()["data"][0]
    assert card["modalities"] == ["text", "image", "video"]


def _wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\0\0" * 800)
    return out.getvalue()


def _flat_video(frames: int, width: int, height: int) -> bytes:
    """``frames`` black frames (cheap to encode however many or however large)."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as box:
        stream = box.add_stream("mpeg4", rate=25)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        black = np.zeros((height, width, 3), dtype=np.uint8)
        frame = av.VideoFrame.from_ndarray(black, format="rgb24")
        for _ in range(frames):
            box.mux(stream.encode(frame))
        box.mux(stream.encode(None))
    return out.getvalue()


def _video_part(data: bytes, mime: str = "video/mp4") -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": data_url(data, mime)}}


def _bad_videos(mp4: bytes) -> dict[str, tuple[list[dict[str, Any]], str]]:
    """Bad video parts: the content of one user message (the bad part first), and a
    fragment of the error message that says what is wrong."""
    text = {"type": "text", "text": QUESTION}
    return {
        "empty": (
            [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,"}}, text],
            "empty (0 bytes)",
        ),
        "truncated": ([_video_part(mp4[: len(mp4) // 3]), text], "cannot be decoded"),
        "random bytes": (
            [_video_part(np.random.default_rng(1).bytes(5000)), text],
            "cannot be decoded",
        ),
        "audio only (WAV)": ([_video_part(_wav()), text], "no video stream"),
        "past the frame cap": (
            [_video_part(_flat_video(20_001, 16, 16)), text],
            "longer than 20000 frames",
        ),
        "past the pixel cap": (
            [_video_part(_flat_video(1, 8000, 5008)), text],
            "more than 40000000 pixels",
        ),
        "image MIME type": (
            [_video_part(mp4, "image/png"), text],
            "unsupported MIME type 'image/png'",
        ),
        "two videos, limit one": (
            [_video_part(mp4), _video_part(mp4), text],
            "at most 1 per prompt",
        ),
    }


def test_bad_videos_are_a_400_naming_the_part(
    served: LiveServer, media: tuple[bytes, bytes], expected: tuple[str, int]
) -> None:
    for kind, (content, says) in _bad_videos(media[1]).items():
        response = _chat(served, content)
        assert response.status_code == 400, f"{kind}: {response.status_code} {response.text}"
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", kind
        assert says in error["message"], f"{kind}: {error}"
        assert str(error["param"]).startswith("messages"), f"{kind}: {error}"
        if kind != "two videos, limit one":
            assert "'messages[0].content[0]" in error["message"], f"{kind}: the part: {error}"
        assert httpx.get(f"{served.url}/health").status_code == 200, kind
    good = _chat(served, _content(*media))  # and it still answers correctly
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["message"]["content"] == expected[0]
