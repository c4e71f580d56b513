"""4-bit group weights (:class:`~model_shards.quant.int4.Int4GroupWeight`) as GGML Q4_0 / Q4_1
blocks, so that the quantized-block kernels serve AWQ / GPTQ / compressed-tensors W4A16.

A GGML block is 32 consecutive input values of one row; when ``group_size`` is a multiple of 32
and the groups are ``k // group_size`` (no act-order ``g_idx``), each block lies in one group:

* symmetric (zero 8): Q4_0 with ``d = scale``: ``d (q - 8)`` is the weight, and exactly (the
  same float32 product) when ``scale`` is a float16 value, which AWQ / GPTQ scales are; bfloat16
  scales are too unless below float16's normal range (2^-14), where :func:`to_ggml` declines.
* asymmetric: Q4_1 with ``d = scale``, ``m = -zero · scale``: ``d q + m``. ``m`` is rounded to
  float16: ``|m16 - m| <= 2^-11 |zero · scale| <= 16 · 2^-11 · scale``, under 0.8% of one
  quantization step (``scale``) per weight. Beside it, the float32 ``(q - zero) · scale`` and
  ``q · d + m`` round differently, by a float32 ulp of the weight.

The blocks hold the same nibbles: GGML's element ``i < 16`` of a block is the low nibble of
byte ``i``, element ``i + 16`` its high nibble.
"""

from __future__ import annotations

import torch

from model_shards.quant.formats import GGMLType, row_bytes
from model_shards.quant.int4 import Int4GroupWeight
from model_shards.quant.weights import QuantizedTensor

_F16_NORMAL_MIN = 2.0**-14


def ggml_type_for(w: Int4GroupWeight) -> GGMLType | None:
    """The block type :func:`to_ggml` would give ``w``, or ``None`` when it cannot (a group
    size not a multiple of 32, act-order groups, scales float16 does not hold exactly)."""
    if w.group_size % 32 or w.in_features % w.group_size or w.g_idx is not None:
        return None
    s = w.scales.float()
    exact = torch.equal(s.to(torch.float16).float(), s)
    if not exact or bool(((s != 0) & (s.abs() < _F16_NORMAL_MIN)).any()):
        return None
    return GGMLType.Q4_0 if w.zeros is None else GGMLType.Q4_1


def to_ggml(w: Int4GroupWeight) -> QuantizedTensor | None:
    """``w`` as ``[N, K]`` Q4_0 / Q4_1 blocks (module docstring), or ``None``."""
    qtype = ggml_type_for(w)
    if qtype is None:
        return None
    n, k = w.out_features, w.in_features
    per_group = w.group_size // 32
    q = w.unpack().view(n, k // 32, 2, 16)  # [N, blocks, halves, 16]
    qs = q[:, :, 0] | (q[:, :, 1] << 4)  # [N, blocks, 16]
    d = w.scales.float().repeat_interleave(per_group, dim=1)  # [N, blocks]
    head = [d.to(torch.float16).unsqueeze(-1).view(torch.uint8)]  # [N, blocks, 2]
    if w.zeros is not None:
        z = w.zeros.float().repeat_interleave(per_group, dim=1)
        head.append((-z * d).to(torch.float16).unsqueeze(-1).view(torch.uint8))
    data = torch.cat([*head, qs], dim=-1).reshape(n, row_bytes(qtype, k))
    return QuantizedTensor(qtype, data.contiguous(), k)
