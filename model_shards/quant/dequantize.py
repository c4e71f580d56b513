"""Reference dequantization of GGML blocks in torch, bit for bit ``gguf.quants.dequantize``.

Each function takes ``blocks: uint8 [n, type_size]`` and returns ``float32 [n, block_size]``,
doing the float32 operations of ``gguf.quants`` in its order (no fused multiply-add), so the
values are identical. Block layouts (``d``, ``m``, ``dmin``: float16 scales; ``qs``: packed
quants; element ``i`` of a 32-block: the low nibble of ``qs[i]`` for ``i < 16``, else the high
nibble of ``qs[i - 16]``):

- Q8_0 ``d, int8 q[32]``: ``d q``;  Q4_0 ``d, qs[16]``: ``d (q - 8)``;  Q4_1 ``d, m, qs[16]``:
  ``d q + m``;  Q5_0 ``d, qh u32, qs[16]``: ``d (q - 16)`` with bit ``i`` of ``qh`` as bit 4 of
  ``q_i``;  Q5_1 ``d, m, qh, qs``: ``d q + m``.
- Q4_K (256 values, 8 sub-blocks of 32) ``d, dmin, scales[12], qs[128]``: 6-bit scale ``sc_j``
  and min ``m_j`` per sub-block, ``(d sc_j) q - dmin m_j``; sub-blocks ``2i, 2i + 1`` are the low
  and high nibbles of ``qs[32i .. 32i + 31]``.  Q5_K adds ``qh[32]``: bit ``j`` of ``qh[l]`` is
  bit 4 of element ``l`` of sub-block ``j``.
- Q6_K ``ql[128], qh[64], int8 scales[16], d``: ``(d sc_g) (q - 32)`` per group of 16.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model_shards.quant.formats import BLOCK_SIZES, GGMLType

QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[n, 2]`` bytes → ``[n, 1]`` float32 of the little-endian float16."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[n, k, 16|32]`` bytes → ``[n, k, 2, 16|32]``: low nibbles, then high nibbles."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2)


def _bits(b: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """``[..., L]`` bytes → ``[..., count, L]``: field ``(b >> width * s) & mask`` per ``s``."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << width) - 1)


def _qh32(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 ``qh [n, 4]`` (a little-endian u32) → ``[n, 32]``: bit ``i`` for element ``i``."""
    return _bits(qh, 8).transpose(1, 2).reshape(-1, 32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).reshape(-1, 32).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:]).reshape(-1, 32).float()
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q5(b: torch.Tensor, head: int) -> torch.Tensor:
    """Q5_0/Q5_1's 5-bit quants, ``[n, 32]`` uint8; ``head``: bytes before ``qh``."""
    ql = _nibbles(b[:, head + 4 :]).reshape(-1, 32)
    return ql | (_qh32(b[:, head : head + 4]) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_q5(b, 2).to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _q5(b, 4).float() + _f16(b[:, 2:4])


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K ``scales [n, 12]`` → 6-bit ``(sc, m)``, each ``[n, 8]`` uint8."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scaled(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: ``(d sc_j) q - dmin m_j`` for ``q [n, 8, 32]`` uint8 → ``[n, 256]``."""
    sc, mn = k_scale_min(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc.float()).unsqueeze(-1)  # [n, 8, 1]
    dm = (_f16(b[:, 2:4]) * mn.float()).unsqueeze(-1)
    return (d * q.float() - dm).reshape(-1, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return _k_scaled(b, q)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    ql = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    qh = _bits(b[:, 16:48], 8)  # [n, 8, 32]
    return _k_scaled(b, ql | (qh << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = _nibbles(b[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    qh = _bits(b[:, 128:192].reshape(-1, 2, 32), 4, width=2).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = (_f16(b[:, 208:210]) * sc).unsqueeze(-1)  # [n, 16, 1]
    return (d * q).reshape(-1, QK_K)


def _float(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda b: b.contiguous().view(dtype).float()


BLOCK_DEQUANT: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _float(torch.float32),
    GGMLType.F16: _float(torch.float16),
    GGMLType.BF16: _float(torch.bfloat16),
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}


def dequantize(data: torch.Tensor, qtype: GGMLType, cols: int) -> torch.Tensor:
    """``data: uint8 [rows, row_bytes]`` of ``qtype`` → ``float32 [rows, cols]``."""
    elems, nbytes = BLOCK_SIZES[qtype]
    rows = data.shape[0]
    blocks = data.reshape(rows * (cols // elems), nbytes)
    return BLOCK_DEQUANT[qtype](blocks).reshape(rows, cols)
