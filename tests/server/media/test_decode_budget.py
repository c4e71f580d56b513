"""Decompression and resize bombs (issue #41): the pixel cap is checked on the size the
model's resize makes, from the header, before decoding; one request's media share a
decoded-bytes budget; video frames are resized as they are decoded; running out of memory
is a 400 for the part (and a 503 anywhere else), never a 500."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import av
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from server.http.errors import APIError, install_error_handlers
from server.media.budget import DEFAULT_MAX_PIXELS, RESIZED_PIXEL_BYTES, MediaBudget
from server.media.fetch import MediaOptions, decode_image, load_image
from server.media.image import ClipPreprocessor
from server.media.qwen2_5_vl.image import QwenVLPreprocessor
from server.media.qwen2_5_vl.video import QwenVLVideoPreprocessor
from server.media.video import decode_video_sampled

pytestmark = pytest.mark.timeout(60)

CLIP = ClipPreprocessor.from_dict({"size": {"shortest_edge": 336}, "crop_size": 336}, "clip")
QWEN = QwenVLPreprocessor.from_dict({}, "qwen")


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


def png(width: int, height: int, *, pixels: bool = True) -> bytes:
    """A 1-bit grey PNG of zeros (``pixels=False``: its header only, no image data)."""
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    data = b""
    if pixels:
        squeeze = zlib.compressobj(9)
        row = bytes(1 + (width + 7) // 8)
        rows = [squeeze.compress(row) for _ in range(height)]
        data = _chunk(b"IDAT", b"".join(rows) + squeeze.flush())
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + data + _chunk(b"IEND", b"")


def _refused(data: bytes, resize: object = CLIP.output_size) -> str:
    with pytest.raises(APIError) as caught:
        decode_image(data, "image/png", "p", DEFAULT_MAX_PIXELS, resize)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    return caught.value.info.message


def test_a_1x100000_png_is_refused_for_what_the_resize_would_make() -> None:
    small = png(1, 100_000)
    assert len(small) < 1000
    assert "resizes it to 336x33600000, more than" in _refused(small)


def test_a_small_wide_png_is_refused_for_what_the_resize_would_make() -> None:
    wide = png(30_000_000, 1)  # 30 M pixels: under the decoded cap, past it resized
    assert len(wide) < 10_000
    assert "resizes it to 10080000000x336, more than" in _refused(wide)


def test_the_refusal_comes_before_decoding() -> None:
    """Headers alone (no pixel data at all) get the size refusal; a header within the
    caps gets the decoder's error, so that one decoded."""
    assert "resizes it to" in _refused(png(1, 100_000, pixels=False))
    assert "aspect ratio" in _refused(png(1, 100_000, pixels=False), QWEN.output_size)
    assert "more than 40000000 pixels" in _refused(png(10_000, 9_000, pixels=False))
    assert "cannot be decoded" in _refused(png(40, 30, pixels=False))
    assert Image.MAX_IMAGE_PIXELS == DEFAULT_MAX_PIXELS


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def test_the_images_of_a_request_share_its_budget() -> None:
    """Each 100x100 image costs 100*100*4 + 336*336*27 bytes for CLIP: two fit 7 MB,
    three do not."""
    image = io.BytesIO()
    Image.new("RGB", (100, 100), (9, 9, 9)).save(image, format="PNG")
    url = _data_url(image.getvalue())
    budget = MediaBudget(7_000_000)
    for _ in range(2):
        pixels = await load_image(url, "p", MediaOptions(), CLIP, CLIP.output_size, budget)
        assert pixels.shape == (3, 336, 336)
    with pytest.raises(APIError) as caught:
        await load_image(url, "q", MediaOptions(), CLIP, CLIP.output_size, budget)
    assert "--media-memory-budget-mib" in caught.value.info.message
    assert caught.value.info.param == "q"


async def test_memory_error_while_decoding_is_a_400() -> None:
    def exhausted(image: Image.Image) -> None:
        raise MemoryError

    with pytest.raises(APIError) as caught:
        await load_image(_data_url(png(4, 4)), "p", MediaOptions(), exhausted)
    assert caught.value.status_code == 400 and "memory" in caught.value.info.message


def test_memory_error_elsewhere_is_a_503() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise MemoryError

    response = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"


def _mp4(frames: int, width: int, height: int) -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as box:
        stream = box.add_stream("mpeg4", rate=4)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        ramp = np.linspace(0, 255, width, dtype=np.uint8)[None, :, None]
        for k in range(frames):
            rgb = np.broadcast_to((ramp + 16 * k).astype(np.uint8), (height, width, 3))
            box.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb))))
        box.mux(stream.encode(None))
    return out.getvalue()


VIDEO = QwenVLVideoPreprocessor.from_dict(
    {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 30}}, "video"
)


def test_video_frames_are_resized_as_decoded_within_the_budget() -> None:
    """Large frames (1280x720) are kept at the model's size, the budget is charged for
    what is kept, and the patches equal those of full-size frames resized together."""
    data = _mp4(6, 1280, 720)
    budget = MediaBudget(64 * 2**20)
    frames, fps = decode_video_sampled(data, 2.0, 8, resize=VIDEO, budget=budget)
    width, height = VIDEO.frame_size(len(frames), 1280, 720)
    assert {f.size for f in frames} == {(width, height)} and width * height < 28 * 28 * 31
    assert budget.used_bytes == 1280 * 720 * 4 + len(frames) * width * height * RESIZED_PIXEL_BYTES
    full, _ = decode_video_sampled(data, 2.0, 8)
    assert {f.size for f in full} == {(1280, 720)}
    ours, theirs = VIDEO(frames, fps), VIDEO(full, fps)
    assert ours.grid_thw == theirs.grid_thw
    np.testing.assert_array_equal(ours.pixels, theirs.pixels)


def test_a_video_past_the_budget_is_refused_before_its_frames_are_kept() -> None:
    with pytest.raises(APIError) as caught:
        decode_video_sampled(_mp4(6, 1280, 720), 2.0, 8, param="v", budget=MediaBudget(2**20))
    assert caught.value.info.param == "v"
    assert "--media-memory-budget-mib" in caught.value.info.message


def test_load_image_runs_off_the_loop() -> None:
    """(The budget and resize checks live in the worker thread with the decoding.)"""
    result = asyncio.run(
        load_image(_data_url(png(8, 8)), "p", MediaOptions(), lambda i: i.size, None, None)
    )
    assert result == (8, 8)
