"""The largest media one step may send through a vision-language model's tower (no torch):
the dummy items :func:`model_shards.worker.gpu_memory.vision_peak_bytes` encodes to measure the
tower's activations before the KV pool is sized.

* LLaVA (fixed image size): a step's prompt tokens cover at most ``ceil(tokens / P)``
  whole placeholder runs of ``P`` tokens plus one cut at each end of the chunk the
  budget cuts, so one batch of ``ceil(tokens / P) + 1`` images (every one a cache miss,
  encoded together as :class:`~model_shards.worker.media_inputs.MediaInputs` does).
* Qwen2.5-VL (dynamic resolution): an item is encoded whole whichever slice of its run
  a step holds, so the worst step encodes one item at the largest size the frontend
  makes: an image at the preprocessor's ``max_pixels`` and, in its own batch, a video of
  ``max_video_frames`` frames at the video pixel cap (``smart_resize`` may pass the cap
  for a thin image: :func:`resized_grid_bound`). Neither item exceeds ``max_model_len``
  placeholders (a longer prompt is refused), which shrinks them.

The frontend's caps do not reach the ranks: ``--limit-mm-per-prompt`` (a step's token
budget bounds the images it holds anyway) and ``--max-video-frames`` (taken as
:data:`DEFAULT_MAX_VIDEO_FRAMES`, the frontend's default) are not in the replica's
config; the pixel caps are the checkpoint's, read as transformers reads them
(:meth:`MediaCaps.from_dir`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_shards.config.qwen2_5_vl import is_qwen_vl, qwen_vl_config
from model_shards.config.vlm import is_vlm, llava_config
from model_shards.messages import MediaInput

DEFAULT_MAX_VIDEO_FRAMES = 32  # server.media.video.DEFAULT_MAX_VIDEO_FRAMES (--max-video-frames)
# transformers' Qwen2VLImageProcessor / Qwen2VLVideoProcessor longest_edge defaults
IMAGE_MAX_PIXELS = 28 * 28 * 1280
VIDEO_MAX_PIXELS = 28 * 28 * 768


@dataclass(frozen=True)
class MediaCaps:
    """Pixel caps of one image and of one video frame, and the frames of one video."""

    image_max_pixels: int = IMAGE_MAX_PIXELS
    video_max_pixels: int = VIDEO_MAX_PIXELS
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES

    @staticmethod
    def from_dir(model_dir: str | Path) -> MediaCaps:
        """``preprocessor_config.json``'s ``max_pixels`` (or ``size.longest_edge``) for
        images; ``video_preprocessor_config.json``'s for video frames, else
        ``preprocessor_config.json``'s (transformers, and ``server.media.qwen2_5_vl.video``, build
        the video processor from it when there is no video config); transformers'
        defaults for what is missing or unreadable."""
        image_config = Path(model_dir) / "preprocessor_config.json"
        video_config = Path(model_dir) / "video_preprocessor_config.json"
        video = _max_pixels(video_config if video_config.is_file() else image_config)
        return MediaCaps(
            image_max_pixels=_max_pixels(image_config) or IMAGE_MAX_PIXELS,
            video_max_pixels=video or VIDEO_MAX_PIXELS,
        )


def _max_pixels(path: Path) -> int | None:
    try:
        raw = json.loads(path.read_text())
        size = raw.get("size") or {}
        value = raw.get("max_pixels") or size.get("longest_edge")
        return int(value) if value else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def worst_case_media(
    raw: Mapping[str, Any], tokens: int, max_model_len: int, caps: MediaCaps | None = None
) -> list[list[MediaInput]]:
    """Batches of dummy items (``pixels`` empty: the caller makes arrays of ``shape``),
    each encoded in one tower call, for a model of ``config.json`` ``raw``; ``[]`` for a
    text-only model. ``tokens``: ``--max-num-batched-tokens``."""
    if not is_vlm(raw):
        return []
    if is_qwen_vl(raw):
        return _qwen_batches(raw, max_model_len, caps or MediaCaps())
    llava = llava_config(raw)
    vision, per_image = llava.vision, llava.tokens_per_image
    count = -(-tokens // per_image) + 1
    shape = [vision.num_channels, vision.image_size, vision.image_size]
    item = MediaInput(0, per_image, b"", b"", shape)
    return [[_numbered(item, i) for i in range(count)]]


def _numbered(item: MediaInput, i: int) -> MediaInput:
    return MediaInput(
        i * item.length,
        item.length,
        i.to_bytes(32, "big"),
        b"",
        item.shape,
        kind=item.kind,
        grid_thw=item.grid_thw,
        second_per_grid=item.second_per_grid,
    )


def _qwen_batches(
    raw: Mapping[str, Any], max_model_len: int, caps: MediaCaps
) -> list[list[MediaInput]]:
    vl = qwen_vl_config(raw)
    v = vl.vision
    patch, merge, temporal = int(v["patch_size"]), vl.merge, int(v["temporal_patch_size"])
    patch_dim = int(v["in_channels"]) * temporal * patch * patch
    factor = patch * merge  # pixels of one merged token's side
    image = _fit(resized_grid_bound(caps.image_max_pixels, factor), max_model_len)
    batches = [[_qwen_item("image", 1, image, merge, patch_dim)]]
    t = -(-caps.max_video_frames // temporal)  # temporal patches (frames padded up)
    if max_model_len // t >= 1:
        frame = _fit(resized_grid_bound(caps.video_max_pixels, factor), max_model_len // t)
        batches.append([_qwen_item("video", t, frame, merge, patch_dim)])
    return batches


def resized_grid_bound(max_pixels: int, factor: int) -> tuple[int, int]:
    """The ``(h, w)`` grid, in ``factor``-pixel units, of the most units ``smart_resize``
    can make under ``max_pixels``: ``max_pixels // factor²`` units, unless a thin image
    whose short side is held at one unit (``max(factor, …)``) comes out longer: its long
    side ``floor(sqrt(W / H * max_pixels) / factor)`` with ``W / H < 200``, so less than
    ``sqrt(200 * max_pixels) / factor`` units."""
    units = max(max_pixels // factor**2, 1)
    thin = math.isqrt(200 * max_pixels // factor**2)
    if thin * thin * factor**2 >= 200 * max_pixels:
        thin -= 1
    return grid_of(units) if units >= thin else (1, thin)


def _fit(grid: tuple[int, int], most: int) -> tuple[int, int]:
    """``grid``, or the grid of ``most`` units when it has more."""
    return grid if grid[0] * grid[1] <= most else grid_of(most)


def _qwen_item(kind: str, t: int, units: tuple[int, int], merge: int, patch_dim: int) -> MediaInput:
    """One item of ``t`` temporal patches of a ``units = (h, w)`` merged-token grid."""
    uh, uw = units
    grid = [t, uh * merge, uw * merge]
    patches = t * grid[1] * grid[2]
    return MediaInput(0, t * uh * uw, b"", b"", [patches, patch_dim], kind=kind, grid_thw=grid)


def grid_of(units: int) -> tuple[int, int]:
    """``(h, w)`` with ``h * w`` as close below ``units`` as a shape whose sides' ratio
    is under 200 allows (smart_resize's bound), ``h <= w`` as near square as possible."""
    for n in range(units, 0, -1):
        h = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        if n // h < 200 * h:
            return h, n // h
    return 1, 1
