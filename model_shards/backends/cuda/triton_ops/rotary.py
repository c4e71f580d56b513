"""Fused RoPE and K/V cache write: one launch over ``[T, nh + nkv]`` (token, head).

Contract of :meth:`model_shards.backends.base.Backend.rotary_and_cache`. ``qkv`` is
``[T, (nh + 2 nkv) * D]`` with unit stride along its columns; per row its heads are
``[q_0 .. q_{nh-1} | k_0 .. k_{nkv-1} | v_0 .. v_{nkv-1}]``, each ``D`` wide.

Half-split (NeoX) rotation of a head ``x = [a | b]`` at position ``p``, with
``c = cos_cached[p]`` and ``s = sin_cached[p]`` (``[D]`` float32, both halves read):

    x' = x * c + rotate_half(x) * s,    rotate_half([a | b]) = [-b | a]

rounded like the reference, which casts ``c``/``s`` to the dtype and multiplies in it:
``x'_j = round(round(x_j * c~_j) + round(±x_{j∓D/2} * s~_j))`` with ``c~ = round(c)``.
Each product of two dtype values is exact in float32, so bf16/fp16 results are bitwise
the reference's; float32 agrees to a rounding of each term.

With per-head q/k norms (``norms``: weights ``w`` ``[D]`` for q and for k, Qwen3's), each
head is first normalized as :mod:`.norm`'s kernel rounds a row, its statistic summed over
the whole head in one ``[BLOCK_D]`` vector like that kernel's row::

    x_j <- round(w_j * round(x_j / sqrt(mean(x²) + eps)))

Program ``(t, h)``: ``h < nh`` rotates q head ``h`` in place; ``h ≥ nh`` rotates k head
``h - nh`` in place, stores it at ``k_pool[slot_mapping[t], h - nh]`` and the raw v
head at ``v_pool[slot, h - nh]``, unless ``slot < 0`` (a padding row: nothing stored);
an FP8 pool gets them divided by its scale, in e4m3 (:mod:`.e4m3`).
Every row is rotated, padding included, so ``positions`` must be valid everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_shards.backends.cuda.triton_ops.e4m3 import as_bytes, is_fp8, to_pool
from model_shards.backends.cuda.triton_ops.norm import round_to


@triton.jit
def _rotate_halves(
    a: tl.tensor,
    b: tl.tensor,
    cos_row: tl.tensor,
    sin_row: tl.tensor,
    offs: tl.tensor,
    mask: tl.tensor,
    HALF: tl.constexpr,
    DTYPE: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """``[a | b]`` (float32 of dtype values) → the rotated halves, rounded to ``DTYPE``."""
    c1 = round_to(tl.load(cos_row + offs, mask=mask, other=0.0), DTYPE)  # [BLOCK_HALF]
    c2 = round_to(tl.load(cos_row + HALF + offs, mask=mask, other=0.0), DTYPE)
    s1 = round_to(tl.load(sin_row + offs, mask=mask, other=0.0), DTYPE)
    s2 = round_to(tl.load(sin_row + HALF + offs, mask=mask, other=0.0), DTYPE)
    a2 = round_to(round_to(a * c1, DTYPE) + round_to(-b * s1, DTYPE), DTYPE)
    b2 = round_to(round_to(b * c2, DTYPE) + round_to(a * s2, DTYPE), DTYPE)
    return a2, b2


@triton.jit
def _normalize_halves(
    a: tl.tensor,
    b: tl.tensor,
    head_ptr: tl.tensor,
    w_ptr: tl.tensor,
    eps: float,
    offs: tl.tensor,
    mask: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DTYPE: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """The head ``[a | b]`` RMS-normalized with weight ``w_ptr [D]``, rounded to ``DTYPE``;
    the statistic from the whole head, reloaded as one vector (the row kernel's order)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    x = tl.load(head_ptr + cols, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
    mean_sq = tl.div_rn(tl.sum(x * x, axis=0), HEAD_DIM * 1.0)  # []
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    w_a = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HALF]
    w_b = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    a = round_to(w_a * round_to(a * inv_rms, DTYPE), DTYPE)
    b = round_to(w_b * round_to(b * inv_rms, DTYPE), DTYPE)
    return a, b


@triton.jit
def _copy_v(
    src: tl.tensor,
    dst: tl.tensor,
    scale: float,
    offs: tl.tensor,
    store: tl.tensor,
    HALF: tl.constexpr,
    KV_FP8: tl.constexpr,
) -> None:
    """The raw v head at ``src`` into the pool at ``dst`` (both halves, where ``store``)."""
    v_dtype = dst.dtype.element_ty
    v_lo = tl.load(src + offs, mask=store, other=0.0).to(tl.float32)
    v_hi = tl.load(src + HALF + offs, mask=store, other=0.0).to(tl.float32)
    tl.store(dst + offs, to_pool(v_lo, scale, KV_FP8, v_dtype), mask=store)
    tl.store(dst + HALF + offs, to_pool(v_hi, scale, KV_FP8, v_dtype), mask=store)


@triton.jit
def _rotary_cache_kernel(
    qkv_ptr: tl.tensor,
    pos_ptr: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    k_pool_ptr: tl.tensor,
    v_pool_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    qw_ptr: tl.tensor,
    kw_ptr: tl.tensor,
    eps: float,
    k_scale: float,
    v_scale: float,
    stride_qkv: int,
    stride_cos: int,
    stride_sin: int,
    stride_k_slot: int,
    stride_k_head: int,
    stride_v_slot: int,
    stride_v_head: int,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    HAS_NORM: tl.constexpr,
) -> None:
    """One program: head ``program_id(1)`` of token ``program_id(0)``."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = qkv_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    mask = offs < HALF
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    head_ptr = qkv_ptr + tok * stride_qkv + head * HEAD_DIM
    a = tl.load(head_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(head_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        w_ptr = tl.where(head >= NUM_HEADS, kw_ptr, qw_ptr)
        a, b = _normalize_halves(a, b, head_ptr, w_ptr, eps, offs, mask, HEAD_DIM, BLOCK_D, dtype)
    a, b = _rotate_halves(
        a, b, cos_ptr + pos * stride_cos, sin_ptr + pos * stride_sin, offs, mask, HALF, dtype
    )
    tl.store(head_ptr + offs, a.to(dtype), mask=mask)
    tl.store(head_ptr + HALF + offs, b.to(dtype), mask=mask)

    # k heads also go to the pools, with their v head, unless the row is padding
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    kv_head = head - NUM_HEADS
    store = mask & (kv_head >= 0) & (slot >= 0)
    k_dst = k_pool_ptr + slot * stride_k_slot + kv_head * stride_k_head
    k_dtype = k_pool_ptr.dtype.element_ty
    tl.store(k_dst + offs, to_pool(a, k_scale, KV_FP8, k_dtype), mask=store)
    tl.store(k_dst + HALF + offs, to_pool(b, k_scale, KV_FP8, k_dtype), mask=store)
    v_dst = v_pool_ptr + slot * stride_v_slot + kv_head * stride_v_head
    _copy_v(head_ptr + NUM_KV_HEADS * HEAD_DIM, v_dst, v_scale, offs, store, HALF, KV_FP8)


def _check(
    qkv: torch.Tensor,
    cos_cached: torch.Tensor,
    sin_cached: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Raise ``ValueError`` naming the argument whose layout the kernel cannot take."""
    d = k_pool.shape[-1]
    if d % 2 or qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(
            f"rotary_and_cache: qkv {tuple(qkv.shape)} must be [T, (nh + 2 nkv) * D] with "
            f"nh={num_heads}, nkv={num_kv_heads}, even D={d}"
        )
    if qkv.stride(1) != 1:
        raise ValueError("rotary_and_cache: qkv needs unit stride along its columns")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dtype != qkv.dtype and not is_fp8(pool):
            raise ValueError(f"rotary_and_cache: {name} is {pool.dtype}; want {qkv.dtype} or FP8")
        if pool.dim() != 3 or pool.shape[1:] != (num_kv_heads, d) or pool.stride(2) != 1:
            raise ValueError(
                f"rotary_and_cache: {name} {tuple(pool.shape)} must be [slots, {num_kv_heads}, "
                f"{d}] with unit stride along D"
            )
    for name, table in (("cos_cached", cos_cached), ("sin_cached", sin_cached)):
        if table.dim() != 2 or table.shape[1] != d or table.stride(1) != 1:
            raise ValueError(f"rotary_and_cache: {name} {tuple(table.shape)} must be [P, {d}]")


def rotary_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_cached: torch.Tensor,
    sin_cached: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rotate q and k of ``qkv`` in place, store k and v at ``slot_mapping`` (negative:
    skipped) and return ``q: [T, nh, D]``, a view of ``qkv``. FP8 pools store
    ``e4m3(k / k_scale)``, ``e4m3(v / v_scale)`` (:mod:`.e4m3`), ``kv_scales = (k, v)``.
    ``norms = (q_weight [D], k_weight [D], eps)``: each q and k head normalized first."""
    _check(qkv, cos_cached, sin_cached, k_pool, v_pool, num_heads, num_kv_heads)
    t, d = qkv.shape[0], k_pool.shape[-1]
    q_w, k_w, eps = (qkv, qkv, 0.0) if norms is None else norms  # unread without norms
    for name, w in (("q", q_w), ("k", k_w)):
        if norms is not None and (w.shape != (d,) or w.dtype != qkv.dtype):
            raise ValueError(f"rotary_and_cache: {name} norm {tuple(w.shape)} {w.dtype}: [{d}]")
    if t > 0:
        _rotary_cache_kernel[(t, num_heads + num_kv_heads)](
            qkv,
            positions.contiguous(),
            cos_cached,
            sin_cached,
            as_bytes(k_pool),  # FP8 pools: their bytes (e4m3.py)
            as_bytes(v_pool),
            slot_mapping.contiguous(),
            q_w.contiguous(),
            k_w.contiguous(),
            eps,
            *kv_scales,
            qkv.stride(0),
            cos_cached.stride(0),
            sin_cached.stride(0),
            k_pool.stride(0),
            k_pool.stride(1),
            v_pool.stride(0),
            v_pool.stride(1),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=d,
            BLOCK_HALF=triton.next_power_of_2(d // 2),
            BLOCK_D=triton.next_power_of_2(d),
            KV_FP8=is_fp8(k_pool),
            HAS_NORM=norms is not None,
            num_warps=1,
        )
    return qkv.view(t, -1, d)[:, :num_heads]
