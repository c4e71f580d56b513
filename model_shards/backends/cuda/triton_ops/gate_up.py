"""The gated MLP's gate/up projection with SiLU-and-mul in its epilogue, for decode-sized
steps: ``x [M, K]``, ``W = [W_gate; W_up] [2I, K]`` → ``silu(x W_gate^T) * (x W_up^T): [M, I]``
in one launch, ``M ≤`` :data:`MAX_ROWS` (the ``[M, 2I]`` intermediate never reaches memory).

Contract of :meth:`model_shards.backends.base.Backend.gated_linear`. Rounding::

    g = round(sum_k x[m, k] W[i, k])          the dtype's GEMM output (float32 sum)
    u = round(sum_k x[m, k] W[I + i, k])
    y = round(round(silu(g)) * u)             :mod:`.activation`'s rounding, bit for bit

The epilogue is the unfused ``silu_and_mul`` exactly; the sums are Triton ``tl.dot`` tiles
walked over ``K`` from 0 upwards in ``BLOCK_K`` steps, whose order differs from cuBLAS, so
``g`` and ``u`` may differ from ``F.linear``'s by a rounding. Program ``n`` owns columns
``[n BLOCK_N, (n + 1) BLOCK_N)`` of both gate and up for every row; the tile shape depends on
nothing but the dtype, so a row's answer does not depend on the others (any ``M ≤ 16``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_shards.backends.cuda.triton_ops.norm import round_to

MAX_ROWS = 16  # one BLOCK_M tile of rows: decode steps (more rows: cuBLAS, then silu_and_mul)
_BLOCK_N, _BLOCK_K = 32, 128  # 448 programs at the 8B shape: ~3 resident per SM, 4 stages


@triton.jit(do_not_specialize=["M"])
def _gate_up_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    y_ptr: tl.tensor,
    M: int,
    stride_xm: int,
    stride_wn: int,
    stride_ym: int,
    K: tl.constexpr,
    INTER: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    """One program: columns ``program_id(0) * BLOCK_N ..`` of ``y`` for rows ``0 .. M - 1``."""
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    mask_m = offs_m < M
    mask_n = offs_n < INTER
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    g_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN] gate rows
    u_ptrs = g_ptrs + INTER * stride_wn  # [BK, BN] up rows
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # fixed order: k0 = 0, BK, 2 BK, ...
        mask_k = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        g = tl.load(g_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        u = tl.load(u_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # interpreter only: its tl.dot multiplies bfloat16 bit patterns (#11584)
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)  # [BM, BN] float32
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = y_ptr.dtype.element_ty
    gate = round_to(acc_g, dtype)  # the projection's output, as a GEMM would store it
    up = round_to(acc_u, dtype)
    act = round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype)  # silu_and_mul's rounding
    y = round_to(act * up, dtype)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]  # [BM, BN]
    tl.store(y_ptrs, y.to(dtype), mask=mask_m[:, None] & mask_n[None, :])


# what ``triton.jit`` chose when the kernel was defined (``TRITON_INTERPRET=1``: CPU)
_INTERPRETED = not isinstance(_gate_up_kernel, triton.runtime.JITFunction)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gate_up_silu` serves this call: at most :data:`MAX_ROWS` rows of a
    16-bit ``x`` and a weight of its dtype, unit stride along ``in``."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[0] % 2 == 0
        and weight.shape[1] == x.shape[1]
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (``M ≤ 16``), ``weight [2I, K]`` (gate rows, then up rows) →
    ``silu(gate) * up: [M, I]`` in ``x``'s dtype (module doc). ``ValueError`` unless
    :func:`takes` holds."""
    if not takes(x, weight):
        raise ValueError(
            f"gate_up_silu: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}: want M <= {MAX_ROWS} rows of bf16/fp16, weight [2I, K] alike"
        )
    m, k = x.shape
    inter = weight.shape[0] // 2
    y = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    upcast = _INTERPRETED  # 16-bit products are exact in float32: the tensor cores' sums
    _gate_up_kernel[(triton.cdiv(inter, _BLOCK_N),)](
        x,
        weight,
        y,
        m,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        K=k,
        INTER=inter,
        PRECISION="ieee" if upcast else "tf32",
        UPCAST=upcast,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
        num_warps=4,
        num_stages=4,
    )
    return y
