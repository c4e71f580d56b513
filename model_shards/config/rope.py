"""Rotary embedding parameters from a checkpoint's ``config.json`` (``rope_theta`` and
``rope_scaling`` / ``rope_parameters``: default, linear, llama3, longrope / su, yarn)."""

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
    # yarn (DeepSeek-V2): the ramp between extrapolated and interpolated frequencies, and
    # the mscales (cos and sin scaled by attention_factor; DeepSeek's scores by
    # yarn_mscale(factor, mscale_all_dim) ** 2)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale_all_dim: float = 0.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 · mscale · ln(scale) + 1`` (1 when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Read rotary parameters from both the transformers<5 and >=5 spellings."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type not in ("default", "linear", "llama3", "longrope", "yarn"):
        raise ValueError(
            f"rope type {rope_type!r} not supported (default, linear, llama3, longrope, yarn)"
        )
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    original = params.get(
        "original_max_position_embeddings", raw.get("max_position_embeddings", 8192)
    )
    if rope_type == "longrope":  # transformers gives Phi-3's top-level field priority
        original = raw.get("original_max_position_embeddings", original)
    fields: dict[str, Any] = {
        "theta": float(theta),
        "rope_type": rope_type,
        "factor": float(params.get("factor", 1.0) or 1.0),
        "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
        "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
        "original_max_position_embeddings": int(original),
    }
    if rope_type == "longrope":
        fields |= _longrope_fields(raw, params, int(original))
    if rope_type == "yarn":
        fields |= _yarn_fields(raw, params, int(original))
    return RopeConfig(**fields)


def _yarn_fields(raw: dict[str, Any], params: dict[str, Any], original: int) -> dict[str, Any]:
    """YaRN's parameters as transformers derives them: ``factor`` (else
    ``max_position_embeddings / original``), ``attention_factor`` (else
    ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` when both are
    given, else ``yarn_mscale(factor)``), ``beta_fast`` 32 / ``beta_slow`` 1 by default."""
    factor = params.get("factor")
    if factor is None:
        factor = int(raw.get("max_position_embeddings", 2048)) / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention = params.get("attention_factor")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    return {
        "factor": float(factor),
        "attention_factor": float(attention),
        "beta_fast": float(params.get("beta_fast") or 32.0),
        "beta_slow": float(params.get("beta_slow") or 1.0),
        "truncate": bool(params.get("truncate", True)),
        "mscale_all_dim": float(mscale_all_dim or 0.0),
    }


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
