"""Float → Q8_0 / Q4_0 blocks in torch, bit for bit ``gguf.quants.quantize`` (llama.cpp's
reference quantizers): the same float32 operations in the same order.

- Q8_0: ``d = max|x| / 127``, ``q = round_half_away(x / d)`` (as ``x * (1 / d)``)
- Q4_0: ``d = x_max / -8`` with ``x_max`` the (first) value of largest magnitude,
  ``q = min(15, trunc(x * (1 / d) + 8.5))``
"""

from __future__ import annotations

import torch

from model_shards.quant.formats import GGMLType, row_bytes


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _round_half_away(n: torch.Tensor) -> torch.Tensor:
    """``gguf.quants.np_roundf``: round half away from zero, in its float32 steps."""
    a = n.abs()
    floored = a.floor()
    return n.sign() * (floored + (2 * (a - floored)).floor())


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127  # [n, 1]
    q = _round_half_away(blocks * _inverse(d)).to(torch.int8)
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=-1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    imax = blocks.abs().argmax(dim=-1, keepdim=True)
    d = blocks.gather(-1, imax) / -8  # [n, 1]
    q = (blocks * _inverse(d) + 8.5).trunc().to(torch.uint8).clamp(0, 15)
    q = q.view(-1, 2, 16)
    return torch.cat([_f16_bytes(d), q[:, 0] | (q[:, 1] << 4)], dim=-1)


def _f16_bytes(d: torch.Tensor) -> torch.Tensor:
    """``[n, 1]`` float32 → ``[n, 2]`` bytes of float16 (round to nearest even)."""
    return d.to(torch.float16).view(torch.uint8)


QUANTIZERS = {GGMLType.Q8_0: _q8_0, GGMLType.Q4_0: _q4_0}


CHUNK_VALUES = 1 << 20  # values quantized at a time: bounds the float32 temporaries (~4 MB each)


def quantize(x: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    """``x [rows, cols]`` (any float dtype, taken as float32) → uint8 ``[rows, row_bytes]``."""
    rows, cols = x.shape
    out = torch.empty(rows, row_bytes(qtype, cols), dtype=torch.uint8, device=x.device)
    step = max(1, CHUNK_VALUES // max(cols, 1))
    for start in range(0, rows, step):
        blocks = x[start : start + step].detach().float().reshape(-1, 32)
        out[start : start + step] = QUANTIZERS[qtype](blocks).reshape(-1, out.shape[1])
    return out
