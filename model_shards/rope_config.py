"""Rotary embedding parameters from a checkpoint's ``config.json`` (``rope_theta`` and
``rope_scaling`` / ``rope_parameters``: default, linear, llama3, longrope / su)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_scaling`` / ``rope_parameters``)."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): one divisor per frequency below / from original_max_position_embeddings
    # (layers/rotary.py), and the factor cos and sin are multiplied by
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Read rotary parameters from both the transformers<5 and >=5 spellings."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type not in ("default", "linear", "llama3", "longrope"):
        raise ValueError(
            f"rope type {rope_type!r} not supported (default, linear, llama3, longrope)"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    original = params.get(
        "original_max_position_embeddings", raw.get("max_position_embeddings", 8192)
    )
    if rope_type == "longrope":  # transformers gives Phi-3's top-level field priority
        original = raw.get("original_max_position_embeddings", original)
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
        **(_longrope_fields(raw, params, int(original)) if rope_type == "longrope" else {}),
    )


def _longrope_fields(raw: dict[str, Any], params: dict[str, Any], original: int) -> dict[str, Any]:
    """LongRoPE's factor lists and attention factor, derived as transformers does: the given
    ``attention_factor``, else ``sqrt(1 + ln s / ln original)`` (1 when ``s <= 1``) with
    ``s = factor``, else ``max_position_embeddings / original``."""
    scale = params.get("factor")
    if scale is None:
        scale = int(raw.get("max_position_embeddings", 2048)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
    return {
        "short_factor": tuple(float(f) for f in params["short_factor"]),
        "long_factor": tuple(float(f) for f in params["long_factor"]),
        "attention_factor": float(attention),
    }
