"""Image preprocessing as the checkpoint's ``preprocessor_config.json`` says, in the frontend
(Pillow and numpy, no ``transformers``).

:class:`ClipPreprocessor` is transformers' ``CLIPImageProcessor`` (its Pillow backend, the
one transformers uses without torchvision), step for step: convert to RGB (an alpha
channel composited over white), resize (``size.shortest_edge``: the short side to that
many pixels, the long one ``int(s * long / short)``; or ``size.height``/``width``) with
the config's ``resample`` filter on the uint8 image, center crop (``(H - h) // 2``;
zero-padded where the image is smaller), rescale (float64 times ``rescale_factor``, then
float32), normalise (``(x - mean) / std`` in float32). Output ``[3, H, W]`` float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from math import ceil
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

#: ``image_processor_type`` values read as CLIP's pipeline
CLIP_PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def read_preprocessor_config(path: Path) -> dict[str, Any]:
    """``preprocessor_config.json`` as a dict; ``ValueError`` naming the file when it is
    missing or not JSON."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the image preprocessor config ({exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the image preprocessor config is not a JSON object")
    return raw


@dataclass(frozen=True)
class ClipPreprocessor:
    """CLIP's preprocessing (see the module docstring); built by :meth:`from_dict`."""

    do_convert_rgb: bool
    do_resize: bool
    shortest_edge: int | None
    resize_hw: tuple[int, int] | None
    resample: int
    do_center_crop: bool
    crop_hw: tuple[int, int]
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @staticmethod
    def from_file(path: Path) -> ClipPreprocessor:
        """``ValueError`` naming the file when it is missing, malformed or not CLIP's."""
        return ClipPreprocessor.from_dict(read_preprocessor_config(path), str(path))

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str) -> ClipPreprocessor:
        kind = raw.get("image_processor_type", "CLIPImageProcessor")
        if kind not in CLIP_PROCESSORS:
            raise ValueError(f"{source}: image_processor_type {kind!r} is not supported")
        size = raw.get("size", {"shortest_edge": 224})
        crop = raw.get("crop_size", {"height": 224, "width": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        try:
            resize_hw = (int(size["height"]), int(size["width"])) if "height" in size else None
            return ClipPreprocessor(
                do_convert_rgb=bool(raw.get("do_convert_rgb", True)),
                do_resize=bool(raw.get("do_resize", True)),
                shortest_edge=None if resize_hw else int(size["shortest_edge"]),
                resize_hw=resize_hw,
                resample=int(raw.get("resample", Image.Resampling.BICUBIC)),
                do_center_crop=bool(raw.get("do_center_crop", True)),
                crop_hw=(int(crop["height"]), int(crop["width"])),
                do_rescale=bool(raw.get("do_rescale", True)),
                rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
                do_normalize=bool(raw.get("do_normalize", True)),
                mean=_triple(raw.get("image_mean", _OPENAI_CLIP_MEAN)),
                std=_triple(raw.get("image_std", _OPENAI_CLIP_STD)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed size or crop_size ({exc!r})") from exc

    def __call__(self, image: Image.Image) -> np.ndarray:
        """A decoded image → pixel values ``[3, H, W]`` float32."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            image = image.resize(self._resized(image.width, image.height), self.resample)
        pixels = np.moveaxis(np.asarray(image), -1, 0)  # [C, H, W] uint8
        if self.do_center_crop:
            pixels = center_crop(pixels, *self.crop_hw)
        out = pixels.astype(np.float32)
        if self.do_rescale:
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.mean, dtype=np.float32)[:, None, None]
            std = np.array(self.std, dtype=np.float32)[:, None, None]
            out = (out - mean) / std
        return np.ascontiguousarray(out, dtype=np.float32)

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` of an image of that size after the resize step (before the
        crop): what the pixel cap is checked on before decoding."""
        return self._resized(width, height) if self.do_resize else (width, height)

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        """PIL's ``(width, height)`` after the resize step."""
        if self.resize_hw is not None:
            return self.resize_hw[1], self.resize_hw[0]
        assert self.shortest_edge is not None
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)


def _triple(value: Any) -> tuple[float, float, float]:
    values = [float(v) for v in (value if isinstance(value, (list, tuple)) else [value] * 3)]
    if len(values) != 3:
        raise ValueError(f"expected 3 channel values, got {value!r}")
    return values[0], values[1], values[2]


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; an image with alpha (or a transparency key) composited over white first."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[C, H, W]`` → ``[C, height, width]`` around the centre, zero-padded if smaller."""
    _, h, w = pixels.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + height, left : left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
    top_pad, left_pad = ceil((new_h - h) / 2), ceil((new_w - w) / 2)
    padded[:, top_pad : top_pad + h, left_pad : left_pad + w] = pixels
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return padded[:, top : top + height, left : left + width]
