"""server.media.video.decode_video on tiny videos encoded here with PyAV (MP4/mpeg4 and
WebM/VP8): frames sampled at the fps asked, the frame cap, frame sizes and colours, and
every bad input a 400 naming the part; the ``video_url`` part and the per-modality
``--limit-mm-per-prompt``; a model without video support refusing a video part."""

from __future__ import annotations

import asyncio
import base64
import io
import wave

import av
import numpy as np
import pytest

from server.api.chat_protocol import ChatCompletionRequest
from server.http.errors import APIError
from server.media.fetch import MediaOptions
from server.media.multimodal import _limit, media_parts
from server.media.video import decode_video, load_chat_videos, load_video

W, H = 32, 24


def encode(frames: int, rate: int, container: str = "mp4", codec: str = "mpeg4") -> bytes:
    """``frames`` frames at ``rate`` fps, frame ``k`` a flat grey of level ``8 * k``."""
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as box:
        stream = box.add_stream(codec, rate=rate)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for k in range(frames):
            rgb = np.full((H, W, 3), 8 * k, dtype=np.uint8)
            box.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        box.mux(stream.encode(None))
    return out.getvalue()


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return encode(20, 10)  # 2 s at 10 fps


def _level(image: object) -> float:
    return float(np.asarray(image).mean())


def test_samples_at_the_fps_asked(mp4: bytes) -> None:
    frames = decode_video(mp4, fps=2.0, max_frames=100)
    assert len(frames) == 4  # ticks 0, 0.5, 1.0, 1.5 s of a 1.9 s video
    assert all(f.size == (W, H) and f.mode == "RGB" for f in frames)
    levels = [_level(f) for f in frames]
    assert levels == pytest.approx([0, 40, 80, 120], abs=4)  # frames 0, 5, 10, 15


def test_every_frame_at_the_native_rate(mp4: bytes) -> None:
    assert len(decode_video(mp4, fps=10.0, max_frames=100)) == 20


def test_the_frame_cap_spreads_frames_over_the_video(mp4: bytes) -> None:
    frames = decode_video(mp4, fps=10.0, max_frames=3)
    assert [_level(f) for f in frames] == pytest.approx([0, 72, 152], abs=12)


def test_webm_vp8() -> None:
    webm = encode(6, 6, "webm", "libvpx")
    frames = decode_video(webm, fps=2.0, max_frames=8)
    assert len(frames) == 2 and frames[0].size == (W, H)


def _wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\0\0" * 800)
    return out.getvalue()


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("empty", "empty (0 bytes)"),
        ("truncated", "cannot be decoded"),
        ("random bytes", "cannot be decoded"),
        ("audio only (WAV)", "no video stream"),
        ("too many pixels", "more than 100 pixels"),
    ],
)
def test_bad_videos_are_a_400_naming_the_part(mp4: bytes, kind: str, says: str) -> None:
    data = {
        "empty": b"",
        "truncated": mp4[: len(mp4) // 3],
        "random bytes": np.random.default_rng(0).bytes(4000),
        "audio only (WAV)": _wav(),
        "too many pixels": mp4,
    }[kind]
    max_pixels = 100 if kind == "too many pixels" else 10**6
    with pytest.raises(APIError) as info:
        decode_video(data, 2.0, 8, param="messages[0].content[1].video_url", max_pixels=max_pixels)
    assert info.value.status_code == 400
    message = info.value.info.message
    assert "'messages[0].content[1].video_url'" in message and says in message, message
    assert info.value.info.param == "messages[0].content[1].video_url"


def _request(*parts: dict[str, object]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [*parts]}]}
    )


def test_video_parts_and_their_limits(mp4: bytes) -> None:
    url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    body = _request(
        {"type": "text", "text": "hi"}, {"type": "video_url", "video_url": {"url": url}}
    )
    assert media_parts(body, "image") == []
    parts = media_parts(body, "video")
    assert parts == [("messages[0].content[1]", url)]
    videos = asyncio.run(load_chat_videos(parts, True, MediaOptions(video_fps=1.0)))
    assert len(videos) == 1 and len(videos[0].frames) == 2
    with pytest.raises(APIError, match=r"'messages\[0\]\.content\[1\]': this model does not"):
        asyncio.run(load_chat_videos(parts, False, MediaOptions()))
    with pytest.raises(APIError, match="2 videos, at most 1"):
        asyncio.run(load_chat_videos(parts * 2, True, MediaOptions(limit_videos=1)))
    with pytest.raises(APIError, match="unsupported MIME type 'image/png'; send MP4 or WebM"):
        asyncio.run(load_video("data:image/png;base64,AAAA", "p", MediaOptions()))
    assert _limit('{"image": 2, "video": 1}') == {"image": 2, "video": 1}
    assert _limit("video=3") == {"video": 3}
