"""Videos in chat prompts: ``video_url`` parts decoded (PyAV) into frames.

A video part's URL is fetched as an image's is (:mod:`server.media`: ``data:video/mp4``
or ``data:video/webm``, ``file://`` under ``--allowed-local-media-path``, http(s) with the
size cap and ``--media-fetch-timeout``). :func:`decode_video` keeps ``--video-fps``
frames per second of the video's first stream, spread evenly over the whole video when
that would be more than ``--max-video-frames``; it runs in a worker thread, never on the
event loop. Every failure (empty or truncated data, no video stream, a codec or container
PyAV cannot read, frames past the pixel cap, a video past :data:`MAX_DECODED_FRAMES`
frames) is the same 400 naming the part (:class:`~server.errors.APIError`).

A model that takes videos gets each part as a :class:`VideoInput` (its frames, RGB PIL
images) from :func:`load_chat_videos`; for any other model a video part is a 400.
"""

from __future__ import annotations

import asyncio
import io
import math
from dataclasses import dataclass
from typing import Any

import av
from PIL import Image

from server.errors import APIError
from server.media import (
    DEFAULT_MAX_PIXELS,
    MediaOptions,
    bad_media,
    check_part_count,
    fetch_media,
)

DEFAULT_VIDEO_FPS = 2.0
DEFAULT_MAX_VIDEO_FRAMES = 32
#: Most frames decoded from one video (the work a request may ask of the frontend)
MAX_DECODED_FRAMES = 20_000


@dataclass(frozen=True)
class VideoInput:
    """One ``video_url`` part of a request, decoded: ``param`` names it, ``frames`` are
    its sampled frames (RGB, in time order), ``fps`` the rate they were sampled at."""

    param: str
    frames: list[Image.Image]
    fps: float


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
    if not data:
        raise bad_media(param, "the video is empty (0 bytes)")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise bad_media(param, "the file holds no video stream")
            stream = container.streams.video[0]
            if stream.codec_context.width * stream.codec_context.height > max_pixels:
                raise bad_media(param, f"the video's frames have more than {max_pixels} pixels")
            frames = _decoded(container, stream, param, max_pixels)
    except APIError:
        raise
    except (av.FFmpegError, ValueError, OSError, IndexError) as exc:
        raise bad_media(param, f"the video cannot be decoded ({type(exc).__name__})") from exc
    if not frames:
        raise bad_media(param, "the video has no frames that decode")
    return _sample(frames, fps, max_frames)


def _decoded(
    container: Any, stream: Any, param: str, max_pixels: int
) -> list[tuple[float, av.VideoFrame]]:
    """Every frame of ``stream``, with its time in seconds from the first."""
    out: list[tuple[float, av.VideoFrame]] = []
    base = float(stream.time_base) if stream.time_base else 0.0
    rate = float(stream.average_rate) if stream.average_rate else 25.0
    for frame in container.decode(stream):
        if len(out) >= MAX_DECODED_FRAMES:
            raise bad_media(param, f"the video is longer than {MAX_DECODED_FRAMES} frames")
        if frame.width * frame.height > max_pixels:
            raise bad_media(param, f"the video's frames have more than {max_pixels} pixels")
        t = frame.pts * base if frame.pts is not None and base else len(out) / rate
        out.append((t, frame))
    if out:
        t0 = out[0][0]
        out = [(t - t0, f) for t, f in out]
    return out


def _sample(
    frames: list[tuple[float, av.VideoFrame]], fps: float, max_frames: int
) -> list[Image.Image]:
    """The frame shown at each ``1/fps`` tick, or ``max_frames`` ticks over the video."""
    duration = frames[-1][0]
    count = max(1, math.floor(duration * fps + 1e-9) + 1)
    step = 1.0 / fps
    if count > max_frames:
        count = max_frames
        step = duration / max(1, count - 1) if count > 1 else 0.0
    picked: list[Image.Image] = []
    j = 0
    for k in range(count):
        tick = k * step
        while j + 1 < len(frames) and frames[j + 1][0] <= tick + 1e-9:
            j += 1
        picked.append(frames[j][1].to_image().convert("RGB"))
    return picked


async def load_video(url: str, param: str, options: MediaOptions) -> VideoInput:
    """The video at ``url`` (the part ``param``), fetched and decoded in a worker thread."""
    data, _ = await fetch_media(url, param, options, kind="video")
    frames = await asyncio.to_thread(
        decode_video,
        data,
        options.video_fps,
        options.max_video_frames,
        param=param,
        max_pixels=options.max_pixels,
    )
    return VideoInput(param, frames, options.video_fps)


async def load_chat_videos(
    parts: list[tuple[str, str]], takes_video: bool, options: MediaOptions
) -> list[VideoInput]:
    """Each ``(param, url)`` video part, decoded, in prompt order; a 400 naming the first
    part when the model takes no videos, or past ``--limit-mm-per-prompt``'s ``video``."""
    refusal = None if takes_video else "this model does not take videos"
    check_part_count(parts, "video", refusal, options.limit_videos)
    return list(await asyncio.gather(*(load_video(url, param, options) for param, url in parts)))
