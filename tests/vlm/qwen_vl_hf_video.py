"""transformers' own ``Qwen2VLVideoProcessor`` (and ``Qwen2_5_VLProcessor``) run without
torchvision, the reference for server/media/qwen2_5_vl/video.py and
server/media/qwen2_5_vl/prompt.py.

transformers' Qwen2-VL video processor exists only for its torchvision backend, and
torchvision cannot be installed here. :func:`hf_video_module` imports transformers'
``video_processing_qwen2_vl`` with a stand-in ``torchvision.transforms.v2.functional``
holding the two functions it calls, transcribed from torchvision's source
(``transforms/v2/functional/_geometry.py::resize_image`` on a CPU tensor and
``_misc.py::normalize_image``); everything else that runs — ``smart_resize``, the
optional per-frame cap, grouping, transformers' fused rescale + normalise, the
last-frame padding and the patch permutation in ``patchify``, the config loading — is
transformers' code.
The stand-in modules are in ``sys.modules`` only while transformers' module is imported
(transformers' backend modules get the stand-in as their missing ``tvF`` global).
"""

from __future__ import annotations

import enum
import functools
import importlib
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image


class InterpolationMode(enum.Enum):
    """torchvision's ``InterpolationMode``."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _native_uint8(mode: InterpolationMode) -> bool:
    if mode == InterpolationMode.BILINEAR:
        return "AVX2" in torch.backends.cpu.get_cpu_capability()
    return mode == InterpolationMode.BICUBIC


def tv_resize(
    image: torch.Tensor,
    size: list[int],
    interpolation: InterpolationMode = InterpolationMode.BILINEAR,
    max_size: int | None = None,
    antialias: bool | None = True,
) -> torch.Tensor:
    """torchvision's ``resize_image`` for a CPU tensor and an explicit ``[h, w]``."""
    antialias = False if antialias is None else antialias
    align_corners: bool | None = None
    if interpolation in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
        align_corners = False
    else:
        antialias = False
    shape = image.shape
    channels, old_h, old_w = shape[-3:]
    new_h, new_w = size
    if (new_h, new_w) == (old_h, old_w):
        return image
    dtype = image.dtype
    acceptable = [torch.float32, torch.float64]
    nearest = interpolation in (InterpolationMode.NEAREST, InterpolationMode.NEAREST_EXACT)
    if nearest or _native_uint8(interpolation):
        acceptable.append(torch.uint8)
    image = image.reshape(-1, channels, old_h, old_w)
    need_cast = dtype not in acceptable
    if need_cast:
        image = image.to(dtype=torch.float32)
    image = torch.nn.functional.interpolate(
        image,
        size=[new_h, new_w],
        mode=interpolation.value,
        align_corners=align_corners,
        antialias=antialias,
    )
    if need_cast:
        if interpolation == InterpolationMode.BICUBIC and dtype == torch.uint8:
            image = image.clamp_(min=0, max=255)
        if dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
            image = image.round_()
        image = image.to(dtype=dtype)
    return image.reshape((*shape[:-3], channels, new_h, new_w))


def tv_normalize(image: torch.Tensor, mean: Any, std: Any, inplace: bool = False) -> torch.Tensor:
    """torchvision's ``normalize_image``."""
    mean = torch.as_tensor(mean, dtype=image.dtype)
    std = torch.as_tensor(std, dtype=image.dtype)
    if mean.ndim == 1:
        mean = mean.view(-1, 1, 1)
    if std.ndim == 1:
        std = std.view(-1, 1, 1)
    image = image.sub_(mean) if inplace else image.sub(mean)
    return image.div_(std)


def _grayscale_to_rgb(image: torch.Tensor) -> torch.Tensor:
    return image if image.shape[-3] == 3 else image.expand(*image.shape[:-3], 3, *image.shape[-2:])


#: transformers' ``pil_torch_interpolation_mapping`` (empty without torchvision)
_PIL_MODES = {
    Image.Resampling.NEAREST: InterpolationMode.NEAREST,
    Image.Resampling.BILINEAR: InterpolationMode.BILINEAR,
    Image.Resampling.BICUBIC: InterpolationMode.BICUBIC,
}


@functools.cache
def hf_video_module() -> types.ModuleType:
    """transformers' ``video_processing_qwen2_vl``, imported over the stand-in."""
    import transformers.utils

    transformers.utils.is_torchvision_available()  # its answer cached before the stand-in
    functional = types.ModuleType("torchvision.transforms.v2.functional")
    functional.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    functional.resize = tv_resize  # type: ignore[attr-defined]
    functional.normalize = tv_normalize  # type: ignore[attr-defined]
    functional.grayscale_to_rgb = _grayscale_to_rgb  # type: ignore[attr-defined]
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2"]
    stand_in = {name: types.ModuleType(name) for name in names}
    stand_in["torchvision.transforms.v2.functional"] = functional
    stand_in["torchvision.transforms.v2"].functional = functional  # type: ignore[attr-defined]
    stand_in["torchvision.transforms"].v2 = stand_in["torchvision.transforms.v2"]  # type: ignore[attr-defined]
    stand_in["torchvision"].transforms = stand_in["torchvision.transforms"]  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in stand_in}
    sys.modules.update(stand_in)
    try:
        module = importlib.import_module("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    for name in ("image_processing_backends", "video_processing_utils"):
        base = importlib.import_module(f"transformers.{name}")
        if not hasattr(base, "tvF"):  # imported there only when torchvision is installed
            base.tvF = functional  # type: ignore[attr-defined]
        if not getattr(base, "pil_torch_interpolation_mapping", None):
            base.pil_torch_interpolation_mapping = _PIL_MODES  # type: ignore[attr-defined]
    return module


def hf_video_processor(model_dir: Path) -> Any:
    """transformers' ``Qwen2VLVideoProcessor.from_pretrained(model_dir)`` (its
    ``video_preprocessor_config.json``, else its ``preprocessor_config.json``)."""
    return hf_video_module().Qwen2VLVideoProcessor.from_pretrained(model_dir)


def hf_video(frames: list[Image.Image], model_dir: Path) -> tuple[np.ndarray, list[int]]:
    """transformers' video processor of ``model_dir`` on ``frames`` (one video, already
    sampled): ``(pixel_values_videos, video_grid_thw[0])``."""
    video = np.stack([np.asarray(f) for f in frames])  # [F, H, W, C] uint8
    out = hf_video_processor(model_dir)(videos=[video], do_sample_frames=False, return_tensors="np")
    return out["pixel_values_videos"], [int(v) for v in out["video_grid_thw"][0]]


def hf_processor(model_dir: Path) -> Any:
    """transformers' ``Qwen2_5_VLProcessor`` of ``model_dir``: its tokenizer, its PIL image
    processor and :func:`hf_video_processor` (the processor's class check, which looks the
    video processor up among torchvision-backed classes, is skipped for it)."""
    import transformers
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.processing_utils import ProcessorMixin

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    images = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    videos = hf_video_processor(model_dir)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: type(arg)  # type: ignore[method-assign]
    try:
        return Qwen2_5_VLProcessor(
            image_processor=images,
            tokenizer=tokenizer,
            video_processor=videos,
            chat_template=tokenizer.chat_template,
        )
    finally:
        ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]
