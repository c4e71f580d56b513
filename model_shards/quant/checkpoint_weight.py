"""A layer's weight held as a quantized checkpoint stores it: row parts, each an
:class:`~model_shards.quant.int4.Int4GroupWeight` (AWQ, GPTQ, compressed-tensors W4A16) or an
:class:`~model_shards.quant.fp8.Fp8Weight` (compressed-tensors / FBGEMM FP8, ``--quantization
fp8``). A fused layer's parts (q/k/v, gate/up) arrive one by one; adjacent parts that agree
(same kind, group size, zero points or not, ``g_idx``, static input scale) are joined along
``out`` so that the layer is one GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_shards.quant.fp8 import Fp8Weight
from model_shards.quant.int4 import Int4GroupWeight

CheckpointPart = Int4GroupWeight | Fp8Weight


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def part_device(part: CheckpointPart) -> torch.device:
    return part.qweight.device if isinstance(part, Int4GroupWeight) else part.weight.device


def part_to(part: CheckpointPart, device: torch.device) -> CheckpointPart:
    """``part`` with every tensor on ``device``."""
    if isinstance(part, Fp8Weight):
        scale = None if part.input_scale is None else part.input_scale.to(device)
        weight, scale_n = part.weight.to(device), part.scale.to(device)
        return Fp8Weight(weight, scale_n, scale, part.input_scale_ub)
    zeros = None if part.zeros is None else part.zeros.to(device)
    g_idx = None if part.g_idx is None else part.g_idx.to(device)
    return Int4GroupWeight(
        part.qweight.to(device), part.scales.to(device), zeros, part.group_size, g_idx
    )


def join_parts(a: CheckpointPart, b: CheckpointPart) -> CheckpointPart | None:
    """``[a; b]`` (b's rows after a's) as one holder, or ``None`` when they cannot be one."""
    if isinstance(a, Int4GroupWeight) and isinstance(b, Int4GroupWeight):
        if (
            a.group_size != b.group_size
            or (a.zeros is None) != (b.zeros is None)
            or a.scales.dtype != b.scales.dtype
            or not _same(a.g_idx, b.g_idx)
        ):
            return None
        zeros = None if a.zeros is None or b.zeros is None else torch.cat([a.zeros, b.zeros])
        return Int4GroupWeight(
            torch.cat([a.qweight, b.qweight]),
            torch.cat([a.scales, b.scales]),
            zeros,
            a.group_size,
            a.g_idx,
        )
    if isinstance(a, Fp8Weight) and isinstance(b, Fp8Weight):
        if not _same(a.input_scale, b.input_scale) or a.input_scale_ub != b.input_scale_ub:
            return None
        weight, scale = torch.cat([a.weight, b.weight]), torch.cat([a.scale, b.scale])
        return Fp8Weight(weight, scale, a.input_scale, a.input_scale_ub)
    return None


@dataclass
class CheckpointWeight:
    """``W [out_features, in_features]`` as ``parts``: ``(first row, holder)``, sorted."""

    out_features: int
    in_features: int
    parts: list[tuple[int, CheckpointPart]] = field(default_factory=list)

    def add(self, start: int, part: CheckpointPart) -> None:
        """Hold ``part`` as rows ``start ..``; ``ValueError`` on a size or overlap mismatch."""
        end = start + part.out_features
        if part.in_features != self.in_features or not 0 <= start <= end <= self.out_features:
            raise ValueError(
                f"rows {start}:{end} x {part.in_features} do not fit a "
                f"[{self.out_features}, {self.in_features}] weight"
            )
        if any(s < end and start < s + p.out_features for s, p in self.parts):
            raise ValueError(f"rows {start}:{end} are loaded twice")
        self.parts.append((start, part))
        self.parts.sort(key=lambda sp: sp[0])
        merged: list[tuple[int, CheckpointPart]] = []
        for s, p in self.parts:
            if merged and merged[-1][0] + merged[-1][1].out_features == s:
                joined = join_parts(merged[-1][1], p)
                if joined is not None:
                    merged[-1] = (merged[-1][0], joined)
                    continue
            merged.append((s, p))
        self.parts = merged

    @property
    def covers_all(self) -> bool:
        return sum(p.out_features for _, p in self.parts) == self.out_features

    def dequantize(self) -> torch.Tensor:
        """``[out_features, in_features]`` float32 (rows no part covers: zero)."""
        device = part_device(self.parts[0][1]) if self.parts else torch.device("cpu")
        out = torch.zeros(self.out_features, self.in_features, device=device)
        for s, p in self.parts:
            out[s : s + p.out_features] = p.dequantize()
        return out
