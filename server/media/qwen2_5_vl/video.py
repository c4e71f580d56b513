"""Qwen2-VL / Qwen2.5-VL video preprocessing as the checkpoint says, in the frontend (no
``transformers``): the sampled frames of a ``video_url`` part (:mod:`server.media.video`) →
flattened patches and their grid.

:class:`QwenVLVideoPreprocessor` is transformers' ``Qwen2VLVideoProcessor`` step for step
(transformers has only a torchvision backend for it; this module does what that backend
does with torch alone, imported on the first video): the frames stacked ``[F, C, H, W]``
uint8, one :func:`~server.media.qwen2_5_vl.image.smart_resize` for all of them (the video
pixel bounds ``size.shortest_edge`` / ``longest_edge``, or ``min_pixels`` / ``max_pixels``;
optionally ``cap_pixels_per_frame``), torchvision's resize (``interpolate`` with
antialias on the uint8 frames for bicubic, as torchvision does on CPU), rescale and
normalise fused (``(x - mean / r) / (std / r)`` in float32), then patchify: the frames
padded to a multiple of ``temporal_patch_size`` by repeating the last one, cut into
``temporal_patch_size x patch_size x patch_size`` tubes in merge-window order, each
flattened as ``[C, T, P, P]``. Output ``pixels [t * h * w, C * T * P * P]`` float32 and
``grid_thw = (t, h, w)``; ``second_per_grid = temporal_patch_size / fps`` (transformers'
``second_per_grid_ts``), the prompt holds ``t * h * w // merge_size**2``
``<|video_pad|>`` tokens for it.

The config is ``video_preprocessor_config.json`` when the checkpoint has one (what
transformers writes for a video processor), else ``preprocessor_config.json`` (older
checkpoints: transformers builds the video processor from it), with
``Qwen2VLVideoProcessor``'s defaults for anything left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from server.media.image import read_preprocessor_config, to_rgb
from server.media.qwen2_5_vl.image import QwenVLImage, QwenVLPixelConfig, smart_resize

if TYPE_CHECKING:
    import torch

VIDEO_CONFIG = "video_preprocessor_config.json"
#: Pillow's resample codes → torch's ``interpolate`` mode (transformers' mapping to
#: torchvision's; LANCZOS, BOX and HAMMING have no torch kernel and are refused)
_MODES = {
    Image.Resampling.NEAREST: "nearest",
    Image.Resampling.BILINEAR: "bilinear",
    Image.Resampling.BICUBIC: "bicubic",
}


@dataclass(frozen=True)
class QwenVLVideo(QwenVLImage):
    """One preprocessed video: ``pixels [t * h * w, C * T * P * P]`` float32, its grid in
    patches (``num_tokens``: its ``<|video_pad|>`` placeholders) and its seconds per
    temporal patch."""

    second_per_grid: float


@dataclass(frozen=True)
class QwenVLVideoPreprocessor(QwenVLPixelConfig):
    """Qwen2-VL's video preprocessing (see the module docstring)."""

    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000

    @staticmethod
    def from_dir(model_dir: str | Path) -> QwenVLVideoPreprocessor:
        """From ``video_preprocessor_config.json``, else ``preprocessor_config.json``;
        ``ValueError`` naming the file when it is missing or malformed."""
        path = Path(model_dir) / VIDEO_CONFIG
        if not path.is_file():
            path = Path(model_dir) / "preprocessor_config.json"
        return QwenVLVideoPreprocessor.from_dict(read_preprocessor_config(path), str(path))

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str) -> QwenVLVideoPreprocessor:
        try:
            out = QwenVLVideoPreprocessor(
                **QwenVLPixelConfig.fields_from(raw, 128 * 28 * 28, 28 * 28 * 768),
                cap_pixels_per_frame=bool(raw.get("cap_pixels_per_frame") or False),
                max_video_tokens=int(raw.get("max_video_tokens", 128000)),
            )
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed Qwen2-VL video config ({exc!r})") from exc
        if out.do_resize and out.resample not in _MODES:
            raise ValueError(f"{source}: video resample {out.resample} is not supported")
        return out

    def __call__(self, frames: list[Image.Image], fps: float) -> QwenVLVideo:
        """Frames sampled ``fps`` per second (time order) → patches, grid, time step."""
        import torch

        if not frames:
            raise ValueError("a video needs at least one frame")
        rgb = [to_rgb(f) if self.do_convert_rgb else f for f in frames]
        stacked = np.stack([np.asarray(f) for f in rgb])  # [F, H, W, C] uint8
        video = torch.from_numpy(stacked).permute(0, 3, 1, 2).contiguous()  # [F, C, H, W]
        if self.do_resize:
            video = self._resize(video)
        out = self._normalized(video)
        patches, grid = self.patchify(out)
        return QwenVLVideo(patches, grid, self.merge_size, self.temporal_patch_size / fps)

    def resized_hw(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The frames' size after :func:`smart_resize` (with the optional per-frame cap)."""
        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            total = int(self.max_video_tokens * factor * factor * 0.9)
            share = total * self.temporal_patch_size // frames
            max_pixels = max(min(max_pixels, share), int(self.min_pixels * 1.05))
        return smart_resize(height, width, factor, self.min_pixels, max_pixels)

    def frame_size(self, frames: int, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` of ``frames`` frames after the resize (for
        :class:`server.media.video.FrameResize`: the frames resized as they are decoded)."""
        if not self.do_resize:
            return width, height
        new_h, new_w = self.resized_hw(frames, height, width)
        return new_w, new_h

    def resize_frame(self, frame: Image.Image, size: tuple[int, int]) -> Image.Image:
        """One frame resized to ``size`` (width, height) as :meth:`__call__` resizes the
        stacked frames (the kernel works frame by frame: the same pixels)."""
        import torch

        rgb = to_rgb(frame) if self.do_convert_rgb else frame
        video = torch.from_numpy(np.array(rgb)[None]).permute(0, 3, 1, 2).contiguous()
        out = self._resize_to(video, size[1], size[0])  # [1, C, h, w] uint8
        return Image.fromarray(np.ascontiguousarray(out[0].permute(1, 2, 0).numpy()))

    def _resize(self, video: torch.Tensor) -> torch.Tensor:
        """``[F, C, H, W]`` uint8 at :meth:`resized_hw` (unchanged when already there, as
        frames resized while decoding are)."""
        return self._resize_to(video, *self.resized_hw(video.shape[0], *video.shape[-2:]))

    def _resize_to(self, video: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """torchvision's ``resize_image`` on ``[F, C, H, W]`` uint8 (CPU): uint8 kernels
        where torchvision uses them, else float32, interpolate, round back."""
        import torch

        if (height, width) == tuple(video.shape[-2:]):
            return video
        mode = _MODES[Image.Resampling(self.resample)]
        native = mode in ("nearest", "bicubic") or (
            mode == "bilinear" and "AVX2" in torch.backends.cpu.get_cpu_capability()
        )
        smooth = mode != "nearest"
        x = video if native else video.to(torch.float32)
        x = torch.nn.functional.interpolate(
            x,
            size=[height, width],
            mode=mode,
            align_corners=False if smooth else None,
            antialias=smooth,
        )
        if not native:
            x = x.clamp_(0, 255) if mode == "bicubic" else x
            x = x.round_().to(torch.uint8)
        return x

    def _normalized(self, video: torch.Tensor) -> torch.Tensor:
        """transformers' fused rescale + normalise (float32)."""
        import torch

        if self.do_normalize:
            mean = torch.tensor(self.mean)
            std = torch.tensor(self.std)
            if self.do_rescale:
                mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            x = video.to(torch.float32)
            return x.sub(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        if self.do_rescale:
            return video * self.rescale_factor
        return video.to(torch.float32)

    def patchify(self, video: torch.Tensor) -> tuple[np.ndarray, tuple[int, int, int]]:
        """``[F, C, H, W]`` → ``[t * gh * gw, C * T * P * P]`` in merge-window order, and
        ``(t, gh, gw)``; ``F`` padded to a multiple of ``T`` with copies of the last frame."""
        import torch

        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if pad := -video.shape[0] % tp:
            video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)), dim=0)
        frames, channels, height, width = video.shape
        grid_t, grid_h, grid_w = frames // tp, height // p, width // p
        patches = video.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, gh/m, gw/m, m, m, C, T, P, P]
        flat = patches.reshape(grid_t * grid_h * grid_w, channels * tp * p * p)
        return np.ascontiguousarray(flat.numpy(), dtype=np.float32), (grid_t, grid_h, grid_w)
