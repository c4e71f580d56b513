# mypy: allow-untyped-defs
# (the @triton.jit kernels: their parameters are Triton values, typed by Triton)
"""Varlen causal prefill attention over the paged pool, in Triton: one launch per step.

Contract: :meth:`model_shards.backends.base.Backend.prefill_attention` with
:class:`model_shards.backends.base.PrefillMeta`. Chunk ``n`` owns the packed rows
``r = q_starts[n] + i``, ``i < q_lens[n]``; its query ``i`` sits at position
``t = start_positions[n] + i`` and attends to positions ``0 .. t`` of its sequence
(the cached prefix and the chunk's own tokens, all already in the pool), position ``p``
at slot ``block_tables[n, p // bs] * bs + p % bs``. Query head ``h`` reads KV head
``h // (nh / nkv)``:

    out[r, h] = sum_{p <= t} softmax_p(scale * q[r, h] . k[p]) v[p]

Grid ``(N * ceil(max_q_len / BLOCK_M), nh)``: program ``(n * tiles + j, h)`` takes query
rows ``j*BLOCK_M ..`` of chunk ``n`` (a tile past the chunk's length does nothing) and
walks the keys ``0 .. start + min(q_len, (j+1)*BLOCK_M) - 1`` in tiles of ``BLOCK_N``
with the causal mask, online softmax in base 2 and float32 accumulators. Rows of
``out`` outside the chunks are not written. Grid sizes come from the host-side ints of
the metadata: no device sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_shards.backends.base import PrefillMeta
from model_shards.backends.cuda.triton_ops.attention_decode import (
    f32_dots,
    paged_slots,
    pool_rows,
    softmax_step,
)
from model_shards.backends.cuda.triton_ops.e4m3 import as_bytes, is_fp8

BLOCK_N = 64  # key tile
MAX_BLOCK_M = 64  # query tile for long chunks (short chunks take down to 16)
_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, q_starts_ptr, q_lens_ptr, starts_ptr, bt_ptr, qk_scale,
    cap2, window, k_scale, v_scale, stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od, stride_btn,
    tiles, group, D, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr,
    HAS_CAP: tl.constexpr, KV_FP8: tl.constexpr,
):
    """One query tile of one chunk for one query head (see the module docstring);
    ``window > 0``: each query sees only positions ``> t - window``, and the key loop
    starts at the tile's first row's window."""
    n = tl.program_id(0) // tiles
    first = (tl.program_id(0) % tiles) * BLOCK_M
    h = tl.program_id(1)
    kv_head = h // group
    q_len = tl.load(q_lens_ptr + n)
    row0 = tl.load(q_starts_ptr + n)
    start = tl.load(starts_ptr + n)
    offs_m = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the chunk
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q_mask = (offs_m < q_len)[:, None] & d_mask[None, :]
    rows = row0 + offs_m  # [BLOCK_M] packed rows
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=q_mask, other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    dtype = q_ptr.dtype.element_ty
    if F32_DOT:  # see attention_decode.f32_dots
        q = q.to(tl.float32)
    q_pos = start + offs_m  # [BLOCK_M]
    kv_end = start + tl.minimum(q_len, first + BLOCK_M)  # keys the tile's last row sees
    kv_end = tl.where(first < q_len, kv_end, 0)  # a tile past the chunk: no keys
    bt_row = bt_ptr + n * stride_btn
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_start = tl.where(window > 0, tl.maximum(start + first - window + 1, 0), 0)
    for k0 in range(kv_start, kv_end, BLOCK_N):
        pos = k0 + offs_n  # [BLOCK_N] key positions
        valid = pos < kv_end
        slot = paged_slots(bt_row, pos, valid, BLOCK_SIZE)
        k = pool_rows(k_ptr, slot, valid, kv_head, stride_ks, stride_kh, stride_kd, D, k_scale,
                      BLOCK_D, KV_FP8, dtype)
        v = pool_rows(v_ptr, slot, valid, kv_head, stride_vs, stride_vh, stride_vd, D, v_scale,
                      BLOCK_D, KV_FP8, dtype)
        keep = valid[None, :] & (pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
        keep &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = softmax_step(
            q, k, v, keep, m_i, l_i, acc, qk_scale, cap2, F32_DOT, HAS_CAP
        )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: PrefillMeta,
    scale: float, out: torch.Tensor, softcap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Write the chunks' rows of ``out: [T, nh, D]`` from ``q: [T, nh, D]`` (contract of
    ``Backend.prefill_attention``, ``meta.window`` and ``softcap`` included); ``meta``'s
    tensors on q's device, int32 or int64. FP8 pools: as in ``decode_attention``."""
    if q.dim() != 3 or out.shape != q.shape or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(f"want q, out [T, nh, D] and equal pools [slots, nkv, D], got "
                         f"{tuple(q.shape)}, {tuple(out.shape)}, {tuple(k_pool.shape)}, "
                         f"{tuple(v_pool.shape)}")
    _, nh, d = q.shape
    nkv = k_pool.shape[1]
    if k_pool.dtype != v_pool.dtype or not (k_pool.dtype == q.dtype or is_fp8(k_pool)):
        raise ValueError(f"pools must both be in q's dtype ({q.dtype}) or both FP8, got "
                         f"{k_pool.dtype} and {v_pool.dtype}")
    if k_pool.shape[2] != d or nh % nkv != 0:
        raise ValueError(f"head dims must match and nh ({nh}) be a multiple of nkv ({nkv})")
    if meta.num_chunks == 0 or meta.max_q_len == 0:
        return
    block_m = max(16, min(MAX_BLOCK_M, triton.next_power_of_2(meta.max_q_len)))
    tiles = triton.cdiv(meta.max_q_len, block_m)
    fp8 = is_fp8(k_pool)
    _prefill_kernel[(meta.num_chunks * tiles, nh)](
        q, as_bytes(k_pool), as_bytes(v_pool), out, meta.q_starts, meta.q_lens,
        meta.start_positions, meta.block_tables, scale * _LOG2E, (softcap or 1.0) * _LOG2E,
        meta.window or 0, *kv_scales, *q.stride(), *k_pool.stride(), *v_pool.stride(),
        *out.stride(), meta.block_tables.stride(0), tiles, nh // nkv, d,
        BLOCK_SIZE=meta.block_size, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(d)), F32_DOT=f32_dots(q),
        HAS_CAP=softcap is not None, KV_FP8=fp8, num_warps=4,
    )
