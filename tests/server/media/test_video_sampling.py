"""server.media.video samples while decoding: the frames it keeps are the ones a decode of every
frame followed by picking the frame shown at each tick gives (the reference below, the
behaviour before sampling moved into the decode loop), for many rates and caps, MP4 and
WebM; the sampling rate it reports; the frame cap refused from the demuxed packets."""

from __future__ import annotations

import io
import math

import av
import numpy as np
import pytest

from server.http.errors import APIError
from server.media import video
from server.media.video import decode_video_sampled


def _encode(frames: int, rate: int, container: str = "mp4", codec: str = "mpeg4") -> bytes:
    """``frames`` 32 x 24 frames, frame ``k`` a flat grey of level ``4 * k``."""
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as box:
        stream = box.add_stream(codec, rate=rate)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for k in range(frames):
            rgb = np.full((24, 32, 3), 4 * k, dtype=np.uint8)
            box.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        box.mux(stream.encode(None))
    return out.getvalue()


def _reference(data: bytes, fps: float, max_frames: int) -> list[np.ndarray]:
    """Every frame decoded with its time from the first, then the frame shown at each
    ``1/fps`` tick (or ``max_frames`` ticks spread over the video)."""
    with av.open(io.BytesIO(data), mode="r") as box:
        stream = box.streams.video[0]
        assert stream.time_base is not None
        base = float(stream.time_base)
        decoded = [(f.pts, f.to_ndarray(format="rgb24")) for f in box.decode(stream)]
    frames = [(float(pts or 0) * base, f) for pts, f in decoded]
    t0 = frames[0][0]
    frames = [(t - t0, f) for t, f in frames]
    duration = frames[-1][0]
    count = max(1, math.floor(duration * fps + 1e-9) + 1)
    step = 1.0 / fps
    if count > max_frames:
        count = max_frames
        step = duration / max(1, count - 1) if count > 1 else 0.0
    picked, j = [], 0
    for k in range(count):
        while j + 1 < len(frames) and frames[j + 1][0] <= k * step + 1e-9:
            j += 1
        picked.append(frames[j][1])
    return picked


@pytest.mark.parametrize(("container", "codec"), [("mp4", "mpeg4"), ("webm", "libvpx")])
def test_sampling_while_decoding_equals_decoding_everything(container: str, codec: str) -> None:
    data = _encode(23, 10, container, codec)  # 2.2 s
    for fps in (0.3, 1.0, 2.0, 3.3, 10.0, 40.0):
        for max_frames in (1, 2, 3, 5, 8, 100):
            frames, _ = decode_video_sampled(data, fps, max_frames)
            want = _reference(data, fps, max_frames)
            assert len(frames) == len(want), (fps, max_frames)
            for got, ref in zip(frames, want, strict=True):
                np.testing.assert_array_equal(np.asarray(got), ref)


def test_the_reported_rate_is_the_sampling_rate() -> None:
    data = _encode(21, 10)  # 2.0 s from the first frame to the last
    frames, rate = decode_video_sampled(data, 2.0, 100)
    assert (len(frames), rate) == (5, 2.0)
    frames, rate = decode_video_sampled(data, 10.0, 5)  # capped: 5 frames 0.5 s apart
    assert (len(frames), rate) == (5, pytest.approx(2.0))
    frames, rate = decode_video_sampled(_encode(1, 10), 2.0, 4)  # one frame: the asked rate
    assert (len(frames), rate) == (1, 2.0)


def test_the_frame_cap_is_checked_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _encode(12, 10)
    monkeypatch.setattr(video, "MAX_DECODED_FRAMES", 11)
    monkeypatch.setattr(video, "_decode_at", _never)
    with pytest.raises(APIError, match="'v': the video is longer than 11 frames"):
        decode_video_sampled(data, 2.0, 8, param="v")
    monkeypatch.setattr(video, "MAX_DECODED_FRAMES", 12)
    with pytest.raises(AssertionError, match="decoded"):
        decode_video_sampled(data, 2.0, 8, param="v")


def _never(*args: object) -> list[object]:
    raise AssertionError("decoded")
