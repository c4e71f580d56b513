# mypy: allow-untyped-defs
# (the @triton.jit kernels: their parameters are Triton values, typed by Triton)
"""Paged decode attention (one query token per sequence) with GQA, in Triton.

Contract: :meth:`model_shards.backends.base.Backend.decode_attention`. Row ``b`` with
query ``q[b]: [nh, D]`` attends to positions ``0 .. context_lens[b] - 1``; position ``p``
lives at slot ``block_tables[b, p // bs] * bs + p % bs`` of the pools ``[slots, nkv, D]``,
read in place (no gather). Query head ``h`` reads KV head ``h // G``, ``G = nh / nkv``:

    o[b, h] = sum_p softmax_p(scale * q[b, h] . k[p]) v[p]        (zeros when context is 0)

Online softmax in float32, in base 2: with ``s = scale * log2(e) * q . k``, a running
max ``m``, sum ``l = sum 2^(s - m)`` and ``acc = sum 2^(s - m) v`` over tiles of
``BLOCK_N`` tokens; ``o = acc / l``. Output in ``q``'s dtype. A soft-cap squashes the
scores first, ``s = c tanh(s / c)`` (``c`` in the same base-2 units); a sliding window
starts a row's range at ``context - window``.

* single pass (:func:`_decode_kernel`): one program per (row, KV head) holding the ``G``
  query heads of the group together (padded to 16 rows for ``tl.dot``), tiles in
  context order. Nothing depends on the batch: a row's bits are the same alone or in any
  batch (``batch_invariant=True`` always takes this path).
* split-K / flash-decoding (:func:`_decode_split_kernel` + :func:`_decode_reduce_kernel`):
  the context is cut into partitions of ``split`` tokens, one program per (row, KV head,
  partition) writes its partial ``(m, l, acc)``; the reduce combines them:
  ``M = max m_j``, ``o = sum 2^(m_j - M) acc_j / sum 2^(m_j - M) l_j``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from model_shards.backends.cuda.triton_ops.e4m3 import as_bytes, from_pool, is_fp8

BLOCK_N = 64  # context tile of both kernels (fixed: the reduction order of a row)
AUTO_SPLIT_MIN_CONTEXT = 1024  # split only when the longest context exceeds this
AUTO_SPLIT_MIN_PARTITION = 256  # tokens per partition of the automatic split, at least
DEFAULT_SMS = 132  # streaming multiprocessors assumed without a GPU (H100 / H200 SXM)
GRAPH_CONTEXT_STEP = 4  # successive context bounds of a batch bucket's decode graphs
_REDUCE_BLOCK_P = 16  # partitions combined per step of the reduce
_LOG2E = 1.4426950408889634


@triton.jit
def paged_slots(bt_row_ptr, pos, valid, BLOCK_SIZE: tl.constexpr):
    """Pool slots (int64) of positions ``pos [N]`` through one block table row."""
    blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return blk * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def pool_rows(
    pool_ptr, slot, valid, kv_head, stride_s, stride_h, stride_d, D, scale,
    BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr, DTYPE: tl.constexpr,
):
    """One KV head at ``slot [N]`` of a pool ``[slots, nkv, D]`` → ``[N, BLOCK_D]`` in
    ``DTYPE`` (zeros where ``valid`` or the dim is masked); an FP8 pool times ``scale``."""
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = pool_ptr + slot[:, None] * stride_s + kv_head * stride_h + offs_d[None, :] * stride_d
    x = tl.load(ptrs, mask=valid[:, None] & (offs_d < D)[None, :], other=0.0)
    return from_pool(x, scale, KV_FP8, DTYPE)


@triton.jit
def softcapped(s, cap2):
    """``cap2 * tanh(s / cap2)`` (scores and cap both in base-2 units), tanh through
    ``exp2``: ``tanh(x) = 1 - 2 / (e^(2x) + 1)``, exact at both ends."""
    e = tl.exp2((2.0 * 1.4426950408889634) * (s / cap2))
    return cap2 * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def softmax_step(
    q, k, v, keep, m_i, l_i, acc, qk_scale, cap2, F32_DOT: tl.constexpr, HAS_CAP: tl.constexpr
):
    """One key tile of the online softmax: ``q [M, BD]``, ``k, v [N, BD]``, ``keep [M, N]``
    → updated ``(m [M], l [M], acc [M, BD])``, base 2; ``HAS_CAP``: scores soft-capped
    at ``cap2`` (base-2 units) before the mask. A row with no key kept yet stays empty."""
    if F32_DOT:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [M, N]
    if HAS_CAP:
        s = softcapped(s, cap2)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a windowed row's empty tile
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # the MMA's input precision
    if F32_DOT:
        p, v = p.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attend_range(
    q, k_ptr, v_ptr, bt_row_ptr, kv_head, lo, hi, qk_scale, cap2, k_scale, v_scale,
    stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, D,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr, HAS_CAP: tl.constexpr,
    KV_FP8: tl.constexpr, DTYPE: tl.constexpr,
):
    """Online softmax of ``q [BLOCK_G, BLOCK_D]`` over positions ``lo .. hi - 1`` read
    through one block table row → ``(m [BLOCK_G], l [BLOCK_G], acc [BLOCK_G, BLOCK_D])``
    (base 2, unnormalised; ``l == 0`` when the range is empty)."""
    offs_n = tl.arange(0, BLOCK_N)
    if F32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N]
        valid = pos < hi
        slot = paged_slots(bt_row_ptr, pos, valid, BLOCK_SIZE)
        k = pool_rows(k_ptr, slot, valid, kv_head, stride_ks, stride_kh, stride_kd, D, k_scale,
                      BLOCK_D, KV_FP8, DTYPE)
        v = pool_rows(v_ptr, slot, valid, kv_head, stride_vs, stride_vh, stride_vd, D, v_scale,
                      BLOCK_D, KV_FP8, DTYPE)
        keep = tl.broadcast_to(valid[None, :], (BLOCK_G, BLOCK_N))
        m_i, l_i, acc = softmax_step(
            q, k, v, keep, m_i, l_i, acc, qk_scale, cap2, F32_DOT, HAS_CAP
        )
    return m_i, l_i, acc


@triton.jit
def _load_group_q(
    q_ptr, b, kv_head, stride_qb, stride_qh, stride_qd, GROUP, D,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The ``GROUP`` query heads of one KV head, zero-padded → ``[BLOCK_G, BLOCK_D]``."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask = (offs_g < GROUP)[:, None] & (offs_d < D)[None, :]
    ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, qk_scale, cap2, window, k_scale, v_scale,
    stride_qb, stride_qh, stride_qd, stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd, stride_btb, stride_ob, stride_oh, stride_od, GROUP, D,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr, HAS_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Grid ``(B, nkv)``: the whole context (its last ``window`` positions when
    ``window > 0``) of one row for one query-head group."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    q = _load_group_q(
        q_ptr, b, kv_head, stride_qb, stride_qh, stride_qd, GROUP, D, BLOCK_G, BLOCK_D
    )  # [BLOCK_G, BLOCK_D]
    ctx = tl.load(ctx_ptr + b)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    _, l_i, acc = _attend_range(
        q, k_ptr, v_ptr, bt_ptr + b * stride_btb, kv_head, lo, ctx, qk_scale, cap2,
        k_scale, v_scale, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, D,
        BLOCK_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, F32_DOT, HAS_CAP, KV_FP8,
        q_ptr.dtype.element_ty,
    )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows: acc == 0
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask = (offs_g < GROUP)[:, None] & (offs_d < D)[None, :]
    ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, qk_scale, cap2, k_scale, v_scale,
    stride_qb, stride_qh, stride_qd, stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd, stride_btb, nh, num_parts, split, GROUP, D,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr, HAS_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Grid ``(B, nkv, P)``: partition ``j`` (positions ``j*split ..``) of one row and
    group → partials ``m, l: [B, nh, P]``, ``acc: [B, nh, P, D]`` (float32). A partition
    past the row's context writes nothing (the reduce never reads it)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    q = _load_group_q(
        q_ptr, b, kv_head, stride_qb, stride_qh, stride_qd, GROUP, D, BLOCK_G, BLOCK_D
    )  # [BLOCK_G, BLOCK_D]
    ctx = tl.load(ctx_ptr + b)
    lo = part.to(tl.int64) * split
    hi = tl.minimum(lo + split, ctx)
    m_i, l_i, acc = _attend_range(
        q, k_ptr, v_ptr, bt_ptr + b * stride_btb, kv_head, lo, hi, qk_scale, cap2,
        k_scale, v_scale, stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, D,
        BLOCK_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, F32_DOT, HAS_CAP, KV_FP8,
        q_ptr.dtype.element_ty,
    )
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    row = (b * nh + heads).to(tl.int64) * num_parts + part  # [BLOCK_G] index into [B, nh, P]
    g_mask = (offs_g < GROUP) & (lo < ctx)
    tl.store(m_ptr + row, m_i, mask=g_mask)
    tl.store(l_ptr + row, l_i, mask=g_mask)
    acc_ptrs = acc_ptr + row[:, None] * D + offs_d[None, :]
    tl.store(acc_ptrs, acc, mask=g_mask[:, None] & (offs_d < D)[None, :])


@triton.jit
def _decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, ctx_ptr, out_ptr, stride_ob, stride_oh, stride_od,
    nh, num_parts, split, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid ``(B, nh)``: combine the partitions ``0 .. ceil(ctx / split) - 1`` of one row
    and head, ``BLOCK_P`` at a time with the same running-max rescaling."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    used = (ctx + split - 1) // split
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    base = (b * nh + h).to(tl.int64) * num_parts
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(0, used, BLOCK_P):
        parts = p0 + offs_p  # [BLOCK_P]
        p_mask = parts < used
        m_j = tl.load(m_ptr + base + parts, mask=p_mask, other=float("-inf"))
        l_j = tl.load(l_ptr + base + parts, mask=p_mask, other=0.0)
        acc_ptrs = acc_ptr + (base + parts)[:, None] * D + offs_d[None, :]
        acc_j = tl.load(acc_ptrs, mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_j, 0))  # finite: partition p0 is used
        alpha = tl.exp2(m_run - m_new)  # [1]
        w = tl.exp2(m_j - m_new)  # [BLOCK_P], 0 where unused
        l_run = l_run * alpha + tl.sum(w * l_j, 0)
        acc = acc * alpha + tl.sum(w[:, None] * acc_j, 0)
        m_run = m_new
    o = acc / tl.where(l_run > 0, l_run, 1.0)  # [BLOCK_D]; padding rows: acc == 0
    ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def f32_dots(t: torch.Tensor) -> bool:
    """Whether the kernels must feed ``tl.dot`` float32: Triton's interpreter multiplies
    bfloat16 as its uint16 bits, so there the (exact) products of 16-bit inputs are
    formed in float32, after the same rounding of ``p`` the GPU's MMA sees."""
    return t.device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_sms(device: torch.device) -> int:
    """The SM count of a CUDA ``device``; :data:`DEFAULT_SMS` for any other."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_split(
    batch: int, num_kv_heads: int, max_context_len: int, split_kv: int | None,
    batch_invariant: bool, num_sms: int = DEFAULT_SMS,
) -> int | None:
    """The partition size of the split-K path, or ``None`` for the single pass.

    Automatic: single pass at contexts up to :data:`AUTO_SPLIT_MIN_CONTEXT` and when the
    ``batch * num_kv_heads`` programs fill at least half the ``num_sms``; otherwise the
    longest context in as many partitions as fill the SMs once (each at least
    :data:`AUTO_SPLIT_MIN_PARTITION` tokens, a multiple of the tile)."""
    if split_kv is not None:
        if batch_invariant:
            raise ValueError("split_kv and batch_invariant=True exclude each other: "
                             "the batch-invariant path is the single-pass kernel")
        if split_kv <= 0:
            raise ValueError(f"split_kv must be a positive token count, got {split_kv}")
        return split_kv
    programs = batch * num_kv_heads
    if batch_invariant or 2 * programs > num_sms or max_context_len <= AUTO_SPLIT_MIN_CONTEXT:
        return None
    parts = min(num_sms // programs, triton.cdiv(max_context_len, AUTO_SPLIT_MIN_PARTITION))
    if parts < 2:
        return None
    return triton.cdiv(triton.cdiv(max_context_len, parts), BLOCK_N) * BLOCK_N


def graph_context_bounds(
    rows: int, num_kv_heads: int, max_context_len: int, batch_invariant: bool,
    num_sms: int = DEFAULT_SMS,
) -> list[int]:
    """The context bounds to capture a ``rows``-row decode graph at, ascending: only
    ``max_context_len`` where no context splits; else also :data:`AUTO_SPLIT_MIN_CONTEXT`
    (the single pass) and every :data:`GRAPH_CONTEXT_STEP`-fold bound below the longest,
    so a step's partitions span at most that factor more than its longest context."""
    split = choose_split(rows, num_kv_heads, max_context_len, None, batch_invariant, num_sms)
    if split is None:
        return [max_context_len]
    bounds, bound = [], AUTO_SPLIT_MIN_CONTEXT
    while bound < max_context_len:
        bounds.append(bound)
        bound *= GRAPH_CONTEXT_STEP
    return [*bounds, max_context_len]


def _check(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    if k_pool.dtype != v_pool.dtype or not (k_pool.dtype == q.dtype or is_fp8(k_pool)):
        raise ValueError(f"pools must both be in q's dtype ({q.dtype}) or both FP8, got "
                         f"{k_pool.dtype} and {v_pool.dtype}")
    if q.dim() != 3 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        shapes = f"{tuple(q.shape)}, {tuple(k_pool.shape)}, {tuple(v_pool.shape)}"
        raise ValueError(f"want q [B, nh, D] and equal pools [slots, nkv, D], got {shapes}")
    if q.shape[2] != k_pool.shape[2] or q.shape[1] % k_pool.shape[1] != 0:
        raise ValueError(f"head dims must match and nh ({q.shape[1]}) be a multiple of "
                         f"nkv ({k_pool.shape[1]})")


def decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, block_size: int, scale: float, *, split_kv: int | None = None,
    batch_invariant: bool = False, max_context_len: int | None = None,
    window: int | None = None, softcap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0), num_sms: int = DEFAULT_SMS,
) -> torch.Tensor:
    """``q: [B, nh, D]`` → ``[B, nh, D]`` in q's dtype (contract of
    ``Backend.decode_attention``); ``block_tables [B, nblk]`` int32/int64.

    ``split_kv`` forces the split-K path with partitions of that many tokens; ``None``
    chooses (:func:`choose_split`, ``num_sms``). ``batch_invariant`` forces the single pass.
    ``max_context_len`` is an upper bound of ``context_lens`` from host metadata; without
    it the table width ``nblk * block_size`` is used (no device sync either way).
    ``window``/``softcap``: the contract's; a windowed row reads only its window, always
    in the single pass (the window bounds its context). FP8 pools (:mod:`.e4m3`) are read
    as ``e4m3 · scale``, ``kv_scales = (k_scale, v_scale)``, rounded to q's dtype."""
    _check(q, k_pool, v_pool)
    b, nh, d = q.shape
    nkv = k_pool.shape[1]
    out = torch.empty((b, nh, d), dtype=q.dtype, device=q.device)  # [B, nh, D]
    if b == 0:
        return out
    bound = block_tables.shape[1] * block_size if max_context_len is None else max_context_len
    if window is not None:  # a windowed row reads only its window, in one pass
        bound, split_kv, batch_invariant = min(bound, window), None, True
    split = choose_split(b, nkv, bound, split_kv, batch_invariant, num_sms)
    group = nh // nkv
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(d))
    pools = (*k_pool.stride(), *v_pool.stride())
    common = dict(
        BLOCK_SIZE=block_size, BLOCK_G=block_g, BLOCK_D=block_d, F32_DOT=f32_dots(q),
        HAS_CAP=softcap is not None, KV_FP8=is_fp8(k_pool), num_warps=4,
    )
    k_pool, v_pool = as_bytes(k_pool), as_bytes(v_pool)  # FP8: their bytes (e4m3.py)
    qk_scale = scale * _LOG2E
    cap2 = (softcap or 1.0) * _LOG2E
    if split is None:
        _decode_kernel[(b, nkv)](
            q, k_pool, v_pool, block_tables, context_lens, out, qk_scale, cap2, window or 0,
            *kv_scales, *q.stride(), *pools,
            block_tables.stride(0), *out.stride(), group, d, BLOCK_N=BLOCK_N, **common,
        )
        return out
    parts = max(1, triton.cdiv(bound, split))
    m_part = torch.empty((b, nh, parts), dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty((b, nh, parts, d), dtype=torch.float32, device=q.device)
    block_n = max(16, min(BLOCK_N, triton.next_power_of_2(split)))
    _decode_split_kernel[(b, nkv, parts)](
        q, k_pool, v_pool, block_tables, context_lens, m_part, l_part, acc_part, qk_scale,
        cap2, *kv_scales, *q.stride(), *pools, block_tables.stride(0), nh, parts, split, group, d,
        BLOCK_N=block_n, **common,
    )
    _decode_reduce_kernel[(b, nh)](
        m_part, l_part, acc_part, context_lens, out, *out.stride(), nh, parts, split, d,
        BLOCK_P=_REDUCE_BLOCK_P, BLOCK_D=block_d, num_warps=4,
    )
    return out
