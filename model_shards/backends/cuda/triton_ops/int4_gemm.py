# mypy: allow-untyped-defs
# (the @triton.jit kernels: their parameters are Triton values, typed by Triton)
"""W4A16 GEMM: ``y = x W^T + b`` with ``W`` held as 4-bit groups (:class:`Int4GroupWeight`),
dequantized inside the tile.

Contract (``Backend.int4_linear``)::

    x [M, K] f32/bf16/f16, W = weight.dequantize() [N, K], b [N] | None  ->  y [M, N] in x.dtype
    W[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]    g(k) = k // group_size, or g_idx[k]

Per ``BLOCK_K`` tile the kernel loads the packed bytes (byte ``k // 2``; low nibble: even
``k``), each ``k``'s group (``g_idx`` loaded per ``k``; else ``k // group_size``, one group per
tile when the group is a multiple of ``BLOCK_K``), forms ``(q - zero) * scale`` in float32,
rounds it to ``x``'s dtype for the tensor cores (float32 ``x``: kept float32, IEEE dot) and
accumulates in float32. Roundings are nearest-even (:func:`.norm.round_to` where Triton's
interpreter would truncate).

The summation order is fixed by ``K`` alone: ``K`` is cut into partitions of
:func:`partition_size` (``K``-only) columns; each partition is summed from a zero float32
accumulator over its ``BLOCK_K`` tiles in order, and the partitions' sums are added
``0, 1, 2, …`` in float32, then the bias, then one rounding. Both launch shapes compute
exactly that:

* split-K (small ``M``, decode): one program per (output tile, partition) writes its partial
  ``[P, M, N]`` float32; a second kernel sums the partials in partition order (no atomics);
* one pass (large ``M``): one program per output tile walks the partitions itself.

So a row's bits do not depend on which path ran, on the run, or on the other rows (on a GPU
the tile shape is also held fixed with ``batch_invariant=True``; tiles otherwise follow ``M``,
:func:`int4_config`). ``K`` and the group size are compile-time constants (one compile per
distinct shape of a model, as in :mod:`.gemm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model_shards.backends.cuda.triton_ops.norm import round_to
from model_shards.quant.int4 import Int4GroupWeight

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
_MAX_PARTITION = 512  # K columns per split-K partition (fewer when K is small)
_SPLIT_BELOW_TILES = 264  # split K when the output has fewer tiles than this (2x H200's SMs)
_REDUCE_BLOCK = 256


@dataclass(frozen=True)
class Int4Config:
    """One tile configuration; powers of two, every ``tl.dot`` dim >= 16."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


_BLOCK_K = 64  # fixed: part of the summation order; 32 bytes of each weight row per tile
_BY_M = (  # (largest M, config): small M is decode, split over K
    (16, Int4Config(16, 64, _BLOCK_K, 4, 4)),
    (32, Int4Config(32, 64, _BLOCK_K, 4, 4)),
    (64, Int4Config(64, 64, _BLOCK_K, 4, 4)),
)
_LARGE = Int4Config(64, 128, _BLOCK_K, 4, 4)
_INVARIANT = Int4Config(64, 64, _BLOCK_K, 4, 4)  # batch_invariant=True: every M


def int4_config(m: int, batch_invariant: bool = False) -> Int4Config:
    """The tiles for ``M`` rows (fixed when ``batch_invariant``)."""
    if batch_invariant:
        return _INVARIANT
    for top, cfg in _BY_M:
        if m <= top:
            return cfg
    return _LARGE


def partition_size(k: int) -> int:
    """Columns per partition of the K sum: a function of ``K`` only (the summation order),
    a multiple of ``BLOCK_K``; ``next_pow2(K) / 4`` capped at 512 (K = 4096: 8 partitions)."""
    return max(_BLOCK_K, min(_MAX_PARTITION, triton.next_power_of_2(k) // 4))


@triton.jit
def _dequant_tile(
    qw_ptr,
    s_ptr,
    z_ptr,
    gidx_ptr,
    k0,
    offs_k,
    offs_n,
    mask_k,
    mask_n,
    stride_qn,
    stride_sn,
    stride_zn,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``W^T`` rows ``offs_k = k0 + arange(BK)``, columns ``offs_n [BN]`` → ``[BK, BN]``
    float32 (0 where masked)."""
    mask = mask_k[:, None] & mask_n[None, :]
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK/2] bytes: k = 2b (low), 2b + 1 (high)
    byte_mask = (offs_b < K // 2)[:, None] & mask_n[None, :]
    byte = tl.load(qw_ptr + offs_n[None, :] * stride_qn + offs_b[:, None], mask=byte_mask, other=0)
    q = tl.join(byte & 0xF, byte >> 4)  # [BK/2, BN, 2]
    q = tl.reshape(tl.permute(q, (0, 2, 1)), (BLOCK_K, offs_n.shape[0])).to(tl.float32)  # [BK, BN]
    if GROUP_ALIGNED:  # one group per tile: one scale (and zero) per column
        g = k0 // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n * stride_zn + g, mask=mask_n, other=0).to(tl.float32)
            return (q - z[None, :]) * s[None, :]
        return (q - 8.0) * s[None, :]
    if HAS_GIDX:  # noqa: SIM108 (a constexpr branch: one side is not compiled)
        g = tl.load(gidx_ptr + offs_k, mask=mask_k, other=0)  # [BK]
    else:
        g = offs_k // GROUP
    s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g[:, None], mask=mask, other=0.0)
    if HAS_ZEROS:
        z = tl.load(z_ptr + offs_n[None, :] * stride_zn + g[:, None], mask=mask, other=0)
        return (q - z.to(tl.float32)) * s.to(tl.float32)
    return (q - 8.0) * s.to(tl.float32)


@triton.jit
def _partition_sum(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    gidx_ptr,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    k_lo,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    K: tl.constexpr,
    PARTITION: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``sum_{k in [k_lo, k_lo + PARTITION)} x[m, k] W[n, k]`` → ``[BM, BN]`` float32, from a
    zero accumulator, ``BLOCK_K`` columns at a time in order."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, PARTITION, BLOCK_K):
        k0 = k_lo + t
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        mask_k = offs_k < K
        a = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BM, BK]
        w = _dequant_tile(
            qw_ptr, s_ptr, z_ptr, gidx_ptr, k0, offs_k, offs_n, mask_k, mask_n, stride_qn,
            stride_sn, stride_zn, K, GROUP, HAS_ZEROS, HAS_GIDX, GROUP_ALIGNED, BLOCK_K,
        )  # fmt: skip
        if UPCAST:  # interpreter: its tl.dot multiplies 16-bit bit patterns (see gemm.py)
            a = a.to(tl.float32)
            w = round_to(w, x_ptr.dtype.element_ty)  # its casts truncate
        else:
            w = w.to(x_ptr.dtype.element_ty)  # the tensor cores' operand, nearest-even
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _int4_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    gidx_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    M,
    N,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_ym,
    K: tl.constexpr,
    PARTITION: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid ``(tiles_m * tiles_n, P if SPLIT else 1)``. ``SPLIT``: partition ``program_id(1)``
    of one tile → ``part [P, M, N]``; else every partition in order, bias, one rounding."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // num_n).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = (pid % num_n).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_m = offs_m < M
    mask_n = offs_n < N
    out_mask = mask_m[:, None] & mask_n[None, :]
    first = tl.program_id(1) * PARTITION if SPLIT else 0  # this program's partitions
    last = first + PARTITION if SPLIT else K
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_lo in range(first, last, PARTITION):  # in order, each summed from zero
        total += _partition_sum(
            x_ptr, qw_ptr, s_ptr, z_ptr, gidx_ptr, offs_m, offs_n, mask_m, mask_n, k_lo,
            stride_xm, stride_qn, stride_sn, stride_zn, K, PARTITION, GROUP, HAS_ZEROS,
            HAS_GIDX, GROUP_ALIGNED, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    if SPLIT:  # the partial, exactly: 0 + sum
        ptrs = part_ptr + (tl.program_id(1) * M + offs_m)[:, None] * N + offs_n[None, :]
        tl.store(ptrs, total, mask=out_mask)
    else:
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        out = round_to(total, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
        tl.store(ptrs, out, mask=out_mask)


@triton.jit(do_not_specialize=["M", "N"])
def _reduce_kernel(
    part_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    stride_ym,
    PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``y[m, n] = round(sum_p part[p, m, n] (p = 0, 1, …) + b[n])``, ``BLOCK`` elements
    of the flattened ``[M, N]`` per program."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    size = M.to(tl.int64) * N  # elements of one partial
    mask = offs < size
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in range(0, PARTS):
        total += tl.load(part_ptr + p * size + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        total += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    out = round_to(total, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + (offs // N) * stride_ym + n, out, mask=mask)


_INTERPRETED = not isinstance(_reduce_kernel, triton.runtime.JITFunction)


def _check(x: torch.Tensor, w: Int4GroupWeight, bias: torch.Tensor | None) -> None:
    """``ValueError`` naming what disagrees."""
    n, k = w.out_features, w.in_features
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"int4_linear: x must be [T, {k}], got {tuple(x.shape)}")
    if x.dtype not in _SUPPORTED:
        raise ValueError(f"int4_linear: x must be one of {_SUPPORTED}, got {x.dtype}")
    if w.qweight.dtype != torch.uint8 or w.scales.dim() != 2 or w.scales.shape[0] != n:
        raise ValueError(
            f"int4_linear: qweight must be uint8 [N, K/2] and scales [N, groups], got "
            f"{w.qweight.dtype} {tuple(w.qweight.shape)}, scales {tuple(w.scales.shape)}"
        )
    if w.zeros is not None and (w.zeros.shape != w.scales.shape or w.zeros.dtype != torch.uint8):
        raise ValueError(f"int4_linear: zeros must be uint8 {tuple(w.scales.shape)}")
    if w.g_idx is None and w.scales.shape[1] * w.group_size < k:
        raise ValueError(
            f"int4_linear: {w.scales.shape[1]} groups of {w.group_size} do not cover K={k}"
        )
    if w.g_idx is not None and w.g_idx.shape != (k,):
        raise ValueError(f"int4_linear: g_idx must be [{k}], got {tuple(w.g_idx.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"int4_linear: bias must be [{n}], got {tuple(bias.shape)}")


def int4_linear(
    x: torch.Tensor,
    weight: Int4GroupWeight,
    bias: torch.Tensor | None,
    *,
    batch_invariant: bool = False,
    split: bool | None = None,
) -> torch.Tensor:
    """``x [M, K]`` → ``x W^T + b: [M, N]`` in ``x.dtype`` (module doc). ``split`` forces
    (``True``) or forbids (``False``) split-K; ``None``: split when the output has few tiles.
    Both give the same bits; ``bias`` is read as float32."""
    _check(x, weight, bias)
    x = x if x.stride(1) == 1 else x.contiguous()
    qw, scales = weight.qweight.contiguous(), weight.scales.contiguous()
    zeros = scales if weight.zeros is None else weight.zeros.contiguous()  # unread if None
    m, k = x.shape
    n = weight.out_features
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return y
    cfg = int4_config(m, batch_invariant)
    part = partition_size(k)
    parts = triton.cdiv(k, part)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if split is None:
        split = tiles < _SPLIT_BELOW_TILES and parts > 1
    upcast = _INTERPRETED and x.dtype != torch.float32
    partials = torch.empty((parts, m, n) if split else (1,), dtype=torch.float32, device=x.device)
    g_idx = weight.g_idx
    _int4_kernel[(tiles, parts if split else 1)](
        x, qw, scales, zeros, g_idx if g_idx is not None else qw,
        bias if bias is not None else y, y, partials, m, n,
        x.stride(0), qw.stride(0), scales.stride(0), zeros.stride(0), y.stride(0),
        K=k, PARTITION=part, GROUP=weight.group_size, HAS_ZEROS=weight.zeros is not None,
        HAS_GIDX=g_idx is not None,
        GROUP_ALIGNED=g_idx is None and weight.group_size % cfg.block_k == 0,
        HAS_BIAS=bias is not None, SPLIT=split, UPCAST=upcast,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split:
        _reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            partials, bias if bias is not None else y, y, m, n, y.stride(0),
            PARTS=parts, HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK,
        )  # fmt: skip
    return y
