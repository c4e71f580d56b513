"""Vision-language checkpoints' ``config.json`` (no torch): the vision tower's shape, the
image token, how many placeholders one image takes.

LLaVA (``LlavaForConditionalGeneration``) nests its language model under ``text_config``
and its CLIP vision tower under ``vision_config``; fields a checkpoint leaves out take
transformers' ``LlamaConfig`` / ``CLIPVisionConfig`` defaults, as transformers does.
:func:`flatten_text_config` lifts the language model's fields to the top level so
:class:`~model_shards.config.model.ModelConfig` reads a LLaVA config as it reads a Llama one;
the frontend (placeholder expansion) and the model file read :func:`llava_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from model_shards.config.qwen2_5_vl import (
    QWEN_VL_ARCHITECTURES,
    flatten_qwen_vl,
    is_qwen_vl,
    qwen_vision_tp_problem,
)

VLM_ARCHITECTURES: tuple[str, ...] = ("LlavaForConditionalGeneration", *QWEN_VL_ARCHITECTURES)
"""Architectures that take images (``/v1/models`` lists ``image`` for them); Qwen2.5-VL's
config is :mod:`model_shards.config.qwen2_5_vl`'s, LLaVA's :func:`llava_config`."""

# transformers' LlamaConfig defaults (a LLaVA text_config may rely on them)
_LLAMA_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}
# transformers' CLIPVisionConfig defaults
_CLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
ACTIVATIONS = ("gelu", "quick_gelu", "gelu_pytorch_tanh")


def is_vlm(raw: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` names a vision-language architecture served here."""
    return any(a in VLM_ARCHITECTURES for a in raw.get("architectures") or [])


def flatten_text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The whole config with the language model's fields (``text_config``, defaults
    filled) at the top level; everything else (``vision_config``, ``image_token_index``,
    …) kept. ``architectures`` and the top-level ``dtype`` stay the checkpoint's.
    Qwen2.5-VL: :func:`~model_shards.config.qwen2_5_vl.flatten_qwen_vl`."""
    if is_qwen_vl(raw):
        return flatten_qwen_vl(raw)
    text = {**_LLAMA_TEXT_DEFAULTS, **dict(raw.get("text_config") or {})}
    text.pop("architectures", None)
    out = {**raw, **text, "architectures": list(raw.get("architectures") or [])}
    for key in ("dtype", "torch_dtype"):
        if key in raw:
            out[key] = raw[key]
    return out


@dataclass(frozen=True)
class VisionConfig:
    """A CLIP vision tower (``CLIPVisionModel``)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class LlavaConfig:
    """What LLaVA adds to its language model.

    ``feature_layers``: which ``hidden_states`` of the tower feed the projector (HF's
    ``vision_feature_layer``, normalised to ``0..num_layers``: entry ``k`` is the output
    of the first ``k`` encoder layers); several are concatenated along features.
    ``select_strategy``: ``default`` drops the CLS position, ``full`` keeps it."""

    vision: VisionConfig
    image_token_id: int
    feature_layers: tuple[int, ...]
    select_strategy: Literal["default", "full"]
    projector_act: str
    projector_bias: bool

    @property
    def tokens_per_image(self) -> int:
        """Placeholders one image expands to: one per embedding the projector emits."""
        return self.vision.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def layers_run(self) -> int:
        """Encoder layers the tower must run (the deepest selected output)."""
        return max(self.feature_layers)


def llava_config(raw: Mapping[str, Any], source: str = "config.json") -> LlavaConfig:
    """:class:`LlavaConfig` of a LLaVA ``config.json``; ``ValueError`` naming the field."""
    v = {**_CLIP_DEFAULTS, **dict(raw.get("vision_config") or {})}
    vision = VisionConfig(
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_layers=int(v["num_hidden_layers"]),
        num_heads=int(v["num_attention_heads"]),
        num_channels=int(v["num_channels"]),
        image_size=int(v["image_size"]),
        patch_size=int(v["patch_size"]),
        hidden_act=str(v["hidden_act"]),
        layer_norm_eps=float(v["layer_norm_eps"]),
    )
    if v.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"{source}: vision_config.model_type {v['model_type']!r} not supported")
    layer = raw.get("vision_feature_layer", -2)
    layers = [layer] if isinstance(layer, int) else list(layer)
    n = vision.num_layers
    if not layers or any(not -n - 1 <= int(i) <= n for i in layers):
        raise ValueError(f"{source}: vision_feature_layer {layer!r} outside the tower's layers")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"{source}: vision_feature_select_strategy {strategy!r} not supported")
    for name, act in (
        ("vision_config.hidden_act", vision.hidden_act),
        ("projector_hidden_act", raw.get("projector_hidden_act", "gelu")),
    ):
        if act not in ACTIVATIONS:
            raise ValueError(f"{source}: {name} {act!r} not supported ({', '.join(ACTIVATIONS)})")
    return LlavaConfig(
        vision=vision,
        image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 32000))),
        feature_layers=tuple(int(i) % (n + 1) for i in layers),
        select_strategy=strategy,
        projector_act=str(raw.get("projector_hidden_act", "gelu")),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
    )


def vision_tp_problem(raw: Mapping[str, Any], tp: int) -> str | None:
    """Why a vision-language model's tower cannot be split over ``tp`` ranks (its heads
    and MLP are sharded like the language model's), or ``None`` (also for a text model)."""
    if not is_vlm(raw):
        return None
    if is_qwen_vl(raw):
        return qwen_vision_tp_problem(raw, tp)
    vision = llava_config(raw).vision
    if vision.num_heads % tp:
        return f"the vision tower's {vision.num_heads} attention heads are not divisible by {tp}"
    if vision.intermediate_size % tp:
        size = vision.intermediate_size
        return f"the vision tower's intermediate_size {size} is not divisible by {tp}"
    return None
