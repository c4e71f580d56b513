"""Qwen2.5-VL checkpoints' ``config.json`` (no torch): the language model's fields, the
vision tower's shape, the special tokens and the M-RoPE layout.

transformers 5.x nests the language model under ``text_config`` (and its rotary under
``text_config.rope_parameters``, ``rope_type`` ``"default"`` plus ``mrope_section``);
transformers 4.x configs keep the language model's fields at the top level, with
``rope_scaling: {"type": "mrope", "mrope_section": …}``. Both read the same here:
:func:`flatten_qwen_vl` lifts the fields (transformers' ``Qwen2_5_VLTextConfig`` defaults
for any left out) to the top level so :class:`~model_shards.config.model.ModelConfig` reads the
language model as a Qwen2 one, with ``rope_parameters`` normalised to ``rope_type``
``"default"`` (M-RoPE's frequencies are the default ones, split by stream).

Placeholders: an image or video of patch grid ``(t, h, w)`` takes
``t * h * w // spatial_merge_size**2`` ``image_token_id`` / ``video_token_id`` tokens,
between ``vision_start_token_id`` and ``vision_end_token_id``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

QWEN_VL_ARCHITECTURES: tuple[str, ...] = ("Qwen2_5_VLForConditionalGeneration",)

# transformers' Qwen2_5_VLTextConfig defaults
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "use_sliding_window": False,
}
_DEFAULT_THETA = 1000000.0
_DEFAULT_MROPE_SECTION = (16, 24, 24)
# transformers' Qwen2_5_VLVisionConfig defaults
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "tokens_per_second": 4,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}


def is_qwen_vl(raw: Mapping[str, Any]) -> bool:
    return any(a in QWEN_VL_ARCHITECTURES for a in raw.get("architectures") or [])


def flatten_qwen_vl(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The whole config with the language model's fields at the top level (defaults
    filled; ``text_config`` wins over top-level copies), ``attention_bias`` on (Qwen2's
    q/k/v bias) and ``rope_parameters`` as ``{"rope_type": "default", "rope_theta",
    "mrope_section"}``. ``architectures`` and the top-level ``dtype`` stay the checkpoint's."""
    text = dict(raw.get("text_config") or {})
    out = {**_TEXT_DEFAULTS, **raw, **text, "architectures": list(raw.get("architectures") or [])}
    for key in ("dtype", "torch_dtype"):
        if key in raw:
            out[key] = raw[key]
    rope = dict(out.get("rope_parameters") or out.get("rope_scaling") or {})
    kind = str(rope.get("rope_type") or rope.get("type") or "default")
    if kind not in ("default", "mrope"):
        raise ValueError(f"config.json: rope type {kind!r} not supported for Qwen2.5-VL (default)")
    out.pop("rope_scaling", None)
    out["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": float(rope.get("rope_theta", out.get("rope_theta", _DEFAULT_THETA))),
        "mrope_section": list(rope.get("mrope_section", _DEFAULT_MROPE_SECTION)),
    }
    out["attention_bias"] = True
    return out


@dataclass(frozen=True)
class QwenVLConfig:
    """What Qwen2.5-VL adds to its Qwen2 language model. ``vision``: the
    ``vision_config`` dict with transformers' defaults filled (the tower reads it)."""

    vision: Mapping[str, Any]
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, ...]

    @property
    def merge(self) -> int:
        return int(self.vision["spatial_merge_size"])

    @property
    def tokens_per_second(self) -> float:
        return float(self.vision["tokens_per_second"])

    def num_tokens(self, grid_thw: tuple[int, int, int] | list[int]) -> int:
        """Placeholders of one image/video of patch grid ``(t, h, w)``."""
        t, h, w = grid_thw
        return t * h * w // self.merge**2


def qwen_vl_config(
    raw: Mapping[str, Any], head_dim: int | None = None, source: str = "config.json"
) -> QwenVLConfig:
    """:class:`QwenVLConfig` of a Qwen2.5-VL ``config.json`` (as written, or flattened);
    ``head_dim``: the language model's, to check ``mrope_section`` against (its sections
    cover ``head_dim / 2`` frequencies). ``ValueError`` naming the field."""
    flat = flatten_qwen_vl(raw)
    vision = {**VISION_DEFAULTS, **dict(raw.get("vision_config") or {})}
    if vision.get("hidden_act") != "silu":
        raise ValueError(f"{source}: vision_config.hidden_act {vision['hidden_act']!r} not silu")
    if vision["hidden_size"] % vision["num_heads"]:
        raise ValueError(f"{source}: vision_config.hidden_size not divisible by num_heads")
    merge = int(vision["spatial_merge_size"])
    if int(vision["window_size"]) % (merge * int(vision["patch_size"])):
        raise ValueError(f"{source}: vision_config.window_size not a multiple of merged patches")
    section = tuple(int(s) for s in flat["rope_parameters"]["mrope_section"])
    if len(section) != 3 or any(s < 0 for s in section):
        raise ValueError(f"{source}: mrope_section {list(section)} must be 3 sizes")
    if head_dim is not None and sum(section) != head_dim // 2:
        raise ValueError(
            f"{source}: mrope_section {list(section)} sums to {sum(section)}, the language "
            f"model's head_dim {head_dim} needs {head_dim // 2}"
        )
    if int(vision["out_hidden_size"]) != int(flat["hidden_size"]):
        raise ValueError(
            f"{source}: vision_config.out_hidden_size {vision['out_hidden_size']} differs from "
            f"the language model's hidden_size {flat['hidden_size']}"
        )
    return QwenVLConfig(
        vision=vision,
        image_token_id=int(raw.get("image_token_id", 151655)),
        video_token_id=int(raw.get("video_token_id", 151656)),
        vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
        vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
        mrope_section=section,
    )


def qwen_vision_tp_problem(raw: Mapping[str, Any], tp: int) -> str | None:
    """Why the tower cannot be split over ``tp`` ranks (heads, MLP and merger sharded)."""
    vision = qwen_vl_config(raw).vision
    heads, inter = int(vision["num_heads"]), int(vision["intermediate_size"])
    if heads % tp:
        return f"the vision tower's {heads} attention heads are not divisible by {tp}"
    if inter % tp:
        return f"the vision tower's intermediate_size {inter} is not divisible by {tp}"
    merged = int(vision["hidden_size"]) * int(vision["spatial_merge_size"]) ** 2
    if merged % tp:
        return f"the vision merger's width {merged} is not divisible by {tp}"
    return None
