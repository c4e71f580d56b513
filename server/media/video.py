"""Videos in chat prompts: ``video_url`` parts decoded (PyAV) into frames.

A video part's URL is fetched as an image's is (:mod:`server.media.fetch`: ``data:video/mp4``
or ``data:video/webm``, ``file://`` under ``--allowed-local-media-path``, http(s) with the
size cap and ``--media-fetch-timeout``). :func:`decode_video` keeps ``--video-fps``
frames per second of the video's first stream, spread evenly over the whole video when
that would be more than ``--max-video-frames``; it runs in a worker thread, never on the
event loop. Each kept frame is resized for the model as it is decoded (a
:class:`FrameResize`), so at most one frame is alive at full size; before the first is
kept, the frames' size as resized is checked against the pixel cap and the request's
:class:`~server.media.budget.MediaBudget` is charged for all of them. Every failure (empty
or truncated data, no video stream, a codec or container PyAV cannot read, frames past
the pixel cap or changing size, the budget, a video past :data:`MAX_DECODED_FRAMES`
frames, memory) is a 400 naming the part (:class:`~server.http.errors.APIError`).

A model that takes videos gets each part as a :class:`VideoInput` (its frames, RGB PIL
images) from :func:`load_chat_videos`; for any other model a video part is a 400.
"""

from __future__ import annotations

import asyncio
import io
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import av
from PIL import Image

from server.http.errors import APIError
from server.media.budget import (
    DECODED_PIXEL_BYTES,
    DEFAULT_MAX_PIXELS,
    RESIZED_PIXEL_BYTES,
    MediaBudget,
    bad_media,
    check_resized,
    out_of_memory,
)
from server.media.fetch import MediaOptions, check_part_count, fetch_media

DEFAULT_VIDEO_FPS = 2.0
DEFAULT_MAX_VIDEO_FRAMES = 32
#: Most frames decoded from one video (the work a request may ask of the frontend)
MAX_DECODED_FRAMES = 20_000


@dataclass(frozen=True)
class VideoInput:
    """One ``video_url`` part of a request, decoded: ``param`` names it, ``frames`` are
    its sampled frames (RGB, in time order), ``fps`` the rate they were sampled at
    (``--video-fps``, or lower where ``--max-video-frames`` spread them over the video)."""

    param: str
    frames: list[Image.Image]
    fps: float


class FrameResize(Protocol):
    """How a model resizes a video's frames, one frame at a time (``(width, height)``)."""

    def frame_size(self, frames: int, width: int, height: int) -> tuple[int, int]:
        """The size ``frames`` frames of ``width`` x ``height`` are resized to
        (``ValueError`` when they cannot be)."""
        ...

    def resize_frame(self, frame: Image.Image, size: tuple[int, int]) -> Image.Image:
        """One RGB frame at ``size``, exactly as the model's batch resize makes it."""
        ...


@dataclass
class _Keeper:
    """Turns each picked frame into the RGB (resized) frame kept; on the first, checks
    the size and charges the budget for all ``count`` frames."""

    param: str
    count: int
    max_pixels: int
    resize: FrameResize | None
    budget: MediaBudget | None
    size: tuple[int, int] | None = None
    target: tuple[int, int] = field(default=(0, 0))

    def keep(self, frame: av.VideoFrame) -> Image.Image:
        size = (frame.width, frame.height)
        if self.size is None:
            self._first(size)
        elif size != self.size:
            raise bad_media(self.param, "the video's frames change size")
        image = frame.to_image().convert("RGB")
        if self.resize is not None and self.target != size:
            return self.resize.resize_frame(image, self.target)
        return image

    def _first(self, size: tuple[int, int]) -> None:
        target = size
        if self.resize is not None:
            try:
                target = self.resize.frame_size(self.count, *size)
            except (ValueError, ZeroDivisionError) as exc:
                raise bad_media(self.param, f"the video cannot be preprocessed ({exc})") from exc
        check_resized(self.param, "video's frames", size, target, self.max_pixels)
        if self.budget is not None:
            kept = self.count * target[0] * target[1] * RESIZED_PIXEL_BYTES
            self.budget.charge(self.param, size[0] * size[1] * DECODED_PIXEL_BYTES + kept)
        self.size, self.target = size, target


def decode_video(
    data: bytes,
    fps: float,
    max_frames: int,
    *,
    param: str = "video",
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> list[Image.Image]:
    """``data`` (an MP4 or WebM file) as RGB frames sampled ``fps`` per second, at most
    ``max_frames`` (spread evenly over the video past that); a 400 naming ``param``."""
    return decode_video_sampled(data, fps, max_frames, param=param, max_pixels=max_pixels)[0]


def decode_video_sampled(
    data: bytes,
    fps: float,
    max_frames: int,
    *,
    param: str = "video",
    max_pixels: int = DEFAULT_MAX_PIXELS,
    resize: FrameResize | None = None,
    budget: MediaBudget | None = None,
) -> tuple[list[Image.Image], float]:
    """:func:`decode_video`'s frames and the rate they were sampled at (``fps``, or the
    lower rate of ``max_frames`` spread over the video); each resized by ``resize`` as it
    is kept, all of them charged to ``budget`` before the first is.

    Two passes over the container: the first only demuxes (no decoding) to learn the
    frames' times from their packets' ``pts`` and the stream's ``time_base`` (so the
    frame cap is known before any frame is decoded), the second decodes and keeps only
    the frame shown at each sampling tick (at most one other frame alive at a time)."""
    if not data:
        raise bad_media(param, "the video is empty (0 bytes)")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise bad_media(param, "the file holds no video stream")
            stream = container.streams.video[0]
            if stream.codec_context.width * stream.codec_context.height > max_pixels:
                raise bad_media(param, f"the video's frames have more than {max_pixels} pixels")
            duration = _duration(container, stream, param)
        ticks, rate = _ticks(duration, fps, max_frames)
        keeper = _Keeper(param, len(ticks), max_pixels, resize, budget)
        with av.open(io.BytesIO(data), mode="r") as container:
            frames = _decode_at(container, container.streams.video[0], ticks, keeper)
    except APIError:
        raise
    except MemoryError as exc:
        raise out_of_memory(param) from exc
    except (av.FFmpegError, ValueError, OSError, IndexError) as exc:
        raise bad_media(param, f"the video cannot be decoded ({type(exc).__name__})") from exc
    if not frames:
        raise bad_media(param, "the video has no frames that decode")
    return frames, rate


def _rate(stream: Any) -> float:
    return float(stream.average_rate) if stream.average_rate else 25.0


def _duration(container: Any, stream: Any, param: str) -> float:
    """Seconds from the first frame to the last, from the packets' ``pts`` (demuxed, not
    decoded); frames without one are ``1 / average_rate`` apart."""
    base = float(stream.time_base) if stream.time_base else 0.0
    stamps: list[int] = []
    count = 0
    for packet in container.demux(stream):
        if packet.size == 0:
            continue  # the demuxer's end-of-stream packet
        count += 1
        if count > MAX_DECODED_FRAMES:
            raise bad_media(param, f"the video is longer than {MAX_DECODED_FRAMES} frames")
        if packet.pts is not None:
            stamps.append(packet.pts)
    if base and stamps and len(stamps) == count:
        return (max(stamps) - min(stamps)) * base
    return max(0, count - 1) / _rate(stream)


def _ticks(duration: float, fps: float, max_frames: int) -> tuple[list[float], float]:
    """The sampling times (seconds from the first frame) and their rate: every
    ``1 / fps`` over ``duration``, or ``max_frames`` spread evenly over it past that."""
    count = max(1, math.floor(duration * fps + 1e-9) + 1)
    step = 1.0 / fps
    if count > max_frames:
        count = max_frames
        step = duration / max(1, count - 1) if count > 1 else 0.0
    return [k * step for k in range(count)], (1.0 / step if step > 0 else fps)


def _decode_at(
    container: Any, stream: Any, ticks: list[float], keeper: _Keeper
) -> list[Image.Image]:
    """The frame shown at each tick (the last with time <= tick; times from the first
    decoded frame), each made RGB and resized (``keeper``) as it is picked."""
    param, max_pixels = keeper.param, keeper.max_pixels
    base = float(stream.time_base) if stream.time_base else 0.0
    rate = _rate(stream)
    picked: list[Image.Image] = []
    shown: av.VideoFrame | None = None
    t0: float | None = None
    for n, frame in enumerate(container.decode(stream)):
        if n >= MAX_DECODED_FRAMES:
            raise bad_media(param, f"the video is longer than {MAX_DECODED_FRAMES} frames")
        if frame.width * frame.height > max_pixels:
            raise bad_media(param, f"the video's frames have more than {max_pixels} pixels")
        t = frame.pts * base if frame.pts is not None and base else n / rate
        t0 = t if t0 is None else t0
        while shown is not None and len(picked) < len(ticks) and t - t0 > ticks[len(picked)] + 1e-9:
            picked.append(keeper.keep(shown))
        if len(picked) == len(ticks):
            break
        shown = frame
    while shown is not None and len(picked) < len(ticks):
        picked.append(keeper.keep(shown))
    return picked


async def load_video(
    url: str,
    param: str,
    options: MediaOptions,
    resize: FrameResize | None = None,
    budget: MediaBudget | None = None,
) -> VideoInput:
    """The video at ``url`` (the part ``param``), fetched and decoded in a worker thread,
    its frames resized by ``resize`` as they are decoded, charged to ``budget``."""
    data, _ = await fetch_media(url, param, options, kind="video")
    frames, fps = await asyncio.to_thread(
        decode_video_sampled,
        data,
        options.video_fps,
        options.max_video_frames,
        param=param,
        max_pixels=options.max_pixels,
        resize=resize,
        budget=budget or options.budget(),
    )
    return VideoInput(param, frames, fps)


async def load_chat_videos(
    parts: list[tuple[str, str]],
    takes_video: bool,
    options: MediaOptions,
    resize: FrameResize | None = None,
    budget: MediaBudget | None = None,
) -> list[VideoInput]:
    """Each ``(param, url)`` video part, decoded, in prompt order; a 400 naming the first
    part when the model takes no videos, or past ``--limit-mm-per-prompt``'s ``video``."""
    refusal = None if takes_video else "this model does not take videos"
    check_part_count(parts, "video", refusal, options.limit_videos)
    budget = budget or options.budget()
    loads = (load_video(url, param, options, resize, budget) for param, url in parts)
    return list(await asyncio.gather(*loads))
