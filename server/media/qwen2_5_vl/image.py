"""Qwen2-VL / Qwen2.5-VL image preprocessing as the checkpoint's ``preprocessor_config.json``
says, in the frontend (Pillow and numpy, no ``transformers``).

:class:`QwenVLPreprocessor` is transformers' ``Qwen2VLImageProcessor`` (its Pillow backend),
step for step: convert to RGB, :func:`smart_resize` to multiples of
``patch_size * merge_size`` within ``min_pixels``/``max_pixels`` (the config's ``resample``
filter on the uint8 image), rescale (float64 times ``rescale_factor``, then float32),
normalise (``(x - mean) / std`` in float32), then patchify: the image repeated to
``temporal_patch_size`` frames, cut into ``patch_size`` squares ordered merge window by
merge window, each flattened as ``[C, T, P, P]``. Output ``pixels [h * w, C * T * P * P]``
float32 and ``grid_thw = (1, h, w)`` in patches; the prompt holds
``t * h * w // merge_size**2`` ``<|image_pad|>`` tokens for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from server.media.image import read_preprocessor_config, to_rgb

#: ``image_processor_type`` values read as Qwen2-VL's pipeline
QWEN_VL_PROCESSORS = (
    "Qwen2VLImageProcessor",
    "Qwen2VLImageProcessorFast",
    "Qwen2VLImageProcessorPil",
)
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """``(height, width)`` both multiples of ``factor``, area within the pixel bounds, the
    aspect ratio kept as closely as possible (transformers' ``smart_resize``)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError("image aspect ratio must be smaller than 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLImage:
    """One preprocessed image: ``pixels [h * w, C * T * P * P]`` float32, grid in patches."""

    pixels: np.ndarray
    grid_thw: tuple[int, int, int]
    merge_size: int

    @property
    def num_tokens(self) -> int:
        """How many ``<|image_pad|>`` placeholders the image takes in the prompt."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2


@dataclass(frozen=True)
class QwenVLPixelConfig:
    """What Qwen2-VL's image and video preprocessing share: resize bounds, rescale and
    normalisation, patch, temporal patch and merge sizes."""

    do_convert_rgb: bool
    do_resize: bool
    min_pixels: int
    max_pixels: int
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    patch_size: int
    temporal_patch_size: int
    merge_size: int

    @staticmethod
    def fields_from(raw: dict[str, Any], min_pixels: int, max_pixels: int) -> dict[str, Any]:
        """These fields from a preprocessor config (``size``'s edges when ``min_pixels`` /
        ``max_pixels`` are absent, else the defaults given)."""
        size = raw.get("size") or {}
        return {
            "do_convert_rgb": bool(raw.get("do_convert_rgb", True)),
            "do_resize": bool(raw.get("do_resize", True)),
            "min_pixels": int(raw.get("min_pixels") or size.get("shortest_edge", min_pixels)),
            "max_pixels": int(raw.get("max_pixels") or size.get("longest_edge", max_pixels)),
            "resample": int(raw.get("resample", Image.Resampling.BICUBIC)),
            "do_rescale": bool(raw.get("do_rescale", True)),
            "rescale_factor": float(raw.get("rescale_factor", 1 / 255)),
            "do_normalize": bool(raw.get("do_normalize", True)),
            "mean": _triple(raw.get("image_mean", _OPENAI_CLIP_MEAN)),
            "std": _triple(raw.get("image_std", _OPENAI_CLIP_STD)),
            "patch_size": int(raw.get("patch_size", 14)),
            "temporal_patch_size": int(raw.get("temporal_patch_size", 2)),
            "merge_size": int(raw.get("merge_size", 2)),
        }


@dataclass(frozen=True)
class QwenVLPreprocessor(QwenVLPixelConfig):
    """Qwen2-VL's preprocessing (see the module docstring); built by :meth:`from_dict`."""

    @staticmethod
    def from_file(path: Path) -> QwenVLPreprocessor:
        """``ValueError`` naming the file when it is missing, malformed or not Qwen2-VL's."""
        return QwenVLPreprocessor.from_dict(read_preprocessor_config(path), str(path))

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str) -> QwenVLPreprocessor:
        kind = raw.get("image_processor_type", "Qwen2VLImageProcessor")
        if kind not in QWEN_VL_PROCESSORS:
            raise ValueError(f"{source}: image_processor_type {kind!r} is not supported")
        try:
            return QwenVLPreprocessor(**QwenVLPixelConfig.fields_from(raw, 56 * 56, 28 * 28 * 1280))
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed Qwen2-VL preprocessor config ({exc!r})") from exc

    def __call__(self, image: Image.Image) -> QwenVLImage:
        """A decoded image → its flattened patches and patch grid."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            factor = self.patch_size * self.merge_size
            h, w = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
            image = image.resize((w, h), self.resample)
        pixels = np.moveaxis(np.asarray(image), -1, 0)  # [C, H, W] uint8
        out = pixels.astype(np.float32)
        if self.do_rescale:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.mean, dtype=np.float32)[:, None, None]
            std = np.array(self.std, dtype=np.float32)[:, None, None]
            out = (out - mean) / std
        patches, grid_h, grid_w = self.patchify(out.astype(np.float32))
        return QwenVLImage(patches, (1, grid_h, grid_w), self.merge_size)

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` of an image of that size after :func:`smart_resize`
        (``ValueError`` past its aspect ratio): what the pixel cap is checked on."""
        if not self.do_resize:
            return width, height
        factor = self.patch_size * self.merge_size
        new_h, new_w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return new_w, new_h

    def patchify(self, image: np.ndarray) -> tuple[np.ndarray, int, int]:
        """``[C, H, W]`` → ``[gh * gw, C * T * P * P]`` in merge-window order, ``gh``, ``gw``."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        channels, height, width = image.shape
        grid_h, grid_w = height // p, width // p
        patches = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        patches = np.transpose(patches, (1, 4, 2, 5, 0, 3, 6))  # [gh/m, gw/m, m, m, C, P, P]
        patches = np.broadcast_to(
            patches[:, :, :, :, :, None], (*patches.shape[:5], t, *patches.shape[5:])
        )  # [gh/m, gw/m, m, m, C, T, P, P]
        flat = patches.reshape(grid_h * grid_w, channels * t * p * p)
        return np.ascontiguousarray(flat, dtype=np.float32), grid_h, grid_w


def _triple(value: Any) -> tuple[float, float, float]:
    values = [float(v) for v in (value if isinstance(value, (list, tuple)) else [value] * 3)]
    if len(values) != 3:
        raise ValueError(f"expected 3 channel values, got {value!r}")
    return values[0], values[1], values[2]
