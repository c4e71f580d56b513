"""The fused CUDA paths against their unfused kernels and the reference backend, in Triton's
interpreter on CPU: the final residual add inside the RMSNorm, per-head q/k RMSNorm inside
the RoPE + K/V write kernel, SiLU-and-mul inside the gate/up GEMM.

Fused against the unfused Triton kernels: bitwise (the same roundings in the same order).
Against the reference: as ``test_triton_elementwise`` (16-bit within one rounding step, few
elements off by it), since the reference's float32 reductions (torch's mean, its matmul)
sum in another order than a kernel's tile.
"""

from __future__ import annotations

import pytest
import torch

from model_shards.backends.base import HeadNorms, KVPool, RotaryStep
from model_shards.backends.cuda.backend import CudaBackend
from model_shards.backends.cuda.triton_ops import gemm
from model_shards.backends.cuda.triton_ops.activation import silu_and_mul
from model_shards.backends.cuda.triton_ops.gate_up import MAX_ROWS, gate_up_silu, takes
from model_shards.backends.cuda.triton_ops.norm import rms_norm
from model_shards.backends.cuda.triton_ops.rotary import rotary_and_cache
from tests.model_shards.backends.cuda.test_triton_elementwise import (
    DEVICE,
    EPS,
    HALF_DTYPES,
    REF,
    _assert_near,
    _randn,
    _rope_case,
)


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """The interpreter's numpy dots sum in one order."""


# ---- the final residual add fused into the norm ------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
def test_norm_with_residual_is_the_add_then_the_norm(dtype: torch.dtype) -> None:
    """``LayerStack.finish``'s one launch gives the bits of ``x + residual`` then the norm."""
    x = _randn(5, 96, dtype=dtype, seed=30, scale=3.0)
    residual = _randn(5, 96, dtype=dtype, seed=31, scale=3.0)
    weight = _randn(96, dtype=dtype, seed=32)
    y_unfused, _ = rms_norm(x + residual, None, weight, EPS)
    y, s = rms_norm(x, residual.clone(), weight, EPS)
    assert torch.equal(s, x + residual)
    assert torch.equal(y, y_unfused)
    y_ref, _ = REF.rms_norm(x, residual.clone(), weight, EPS)
    _assert_near(y, y_ref)


# ---- per-head q/k RMSNorm fused into RoPE + K/V write -------------------------------------
def _norms(dtype: torch.dtype, d: int) -> HeadNorms:
    q_w = (1 + 0.5 * _randn(d, dtype=torch.float32, seed=33)).to(dtype)
    k_w = (1 + 0.5 * _randn(d, dtype=torch.float32, seed=34)).to(dtype)
    return HeadNorms(q_w, k_w, EPS)


def _unfused(qkv: torch.Tensor, heads: tuple[int, int], norms: HeadNorms) -> None:
    """The Triton norm kernel on every q and k head of ``qkv``, in place."""
    (nh, nkv), d = heads, norms.q.shape[0]
    q, k, _v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
    for x, w in ((q, norms.q), (k, norms.k)):
        x.copy_(rms_norm(x.reshape(-1, d), None, w, norms.eps)[0].view_as(x))


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize(("nh", "nkv", "d"), [(4, 2, 16), (2, 1, 96)])  # 96: not a power of 2
def test_rotary_with_head_norms(dtype: torch.dtype, nh: int, nkv: int, d: int) -> None:
    slots = [3, 17, -1, 0, 8]
    qkv, pos, cos, sin, k_buf, v_buf, slot_mapping = _rope_case(dtype, nh, nkv, d, slots)
    norms = _norms(dtype, d)
    weights = (norms.q, norms.k, norms.eps)
    fused_k, fused_v, fused_qkv = k_buf.clone(), v_buf.clone(), qkv.clone()
    q = rotary_and_cache(
        fused_qkv, pos, cos, sin, fused_k[1:], fused_v[1:], slot_mapping, nh, nkv, norms=weights
    )
    # unfused Triton: the norm kernel per head, then the plain rotary kernel
    un_k, un_v, un_qkv = k_buf.clone(), v_buf.clone(), qkv.clone()
    _unfused(un_qkv, (nh, nkv), norms)
    q_un = rotary_and_cache(un_qkv, pos, cos, sin, un_k[1:], un_v[1:], slot_mapping, nh, nkv)
    assert torch.equal(q, q_un) and torch.equal(fused_k, un_k) and torch.equal(fused_v, un_v)
    assert torch.equal(fused_qkv, un_qkv)  # k rotated in place, v untouched, alike
    # the reference backend's contract (normalize_heads, then its RoPE)
    ref_k, ref_v = k_buf.clone(), v_buf.clone()
    step = RotaryStep(pos, cos, sin, slot_mapping)
    pool = KVPool(ref_k[1:], ref_v[1:], 1)
    q_ref = REF.rotary_and_cache(qkv.clone(), step, pool, (nh, nkv), norms)
    _assert_near(q, q_ref, max_off_frac=0.05)
    _assert_near(fused_k, ref_k, max_off_frac=0.05)
    assert torch.equal(fused_v, ref_v)


def test_cuda_backend_passes_head_norms_to_the_kernel() -> None:
    """The backend method, norms or none, against the kernel called directly."""
    qkv, pos, cos, sin, k_buf, v_buf, slot_mapping = _rope_case(torch.bfloat16, 2, 1, 16, [1, 5])
    norms = _norms(torch.bfloat16, 16)
    direct_k, direct_v = k_buf.clone(), v_buf.clone()
    want = rotary_and_cache(
        qkv.clone(), pos, cos, sin, direct_k[1:], direct_v[1:], slot_mapping, 2, 1,
        norms=(norms.q, norms.k, norms.eps),
    )  # fmt: skip
    step, pool = RotaryStep(pos, cos, sin, slot_mapping), KVPool(k_buf[1:], v_buf[1:], 1)
    got = CudaBackend().rotary_and_cache(qkv.clone(), step, pool, (2, 1), norms)
    assert torch.equal(got, want) and torch.equal(k_buf, direct_k)


def test_rotary_rejects_a_head_norm_of_the_wrong_size() -> None:
    qkv, pos, cos, sin, k_buf, v_buf, slot_mapping = _rope_case(torch.bfloat16, 2, 1, 16, [0])
    w = torch.ones(8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="norm"):
        rotary_and_cache(
            qkv, pos, cos, sin, k_buf[1:], v_buf[1:], slot_mapping, 2, 1, norms=(w, w, EPS)
        )


# ---- SiLU-and-mul in the gate/up GEMM's epilogue ------------------------------------------
def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units of the dtype's rounding step at the larger magnitude."""
    g, w = got.float(), want.float()
    step = torch.finfo(want.dtype).eps * torch.maximum(g.abs(), w.abs()) + 1e-30
    return (g - w).abs() / step


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("rows", [1, 5, MAX_ROWS])
def test_gate_up_silu_matches_linear_then_silu_and_mul(dtype: torch.dtype, rows: int) -> None:
    """K = 200 (a partial K tile), I = 72 (a partial N tile). The epilogue rounds as
    ``silu_and_mul`` does: given the GEMM's own gate/up (float32 products of 16-bit values,
    exact, summed in float32 then rounded), the output is bitwise the unfused one's. Against
    ``F.linear`` + the reference ``silu_and_mul`` the sums' order differs, so an element may be
    off by a rounding of gate or up carried through silu and the product: within 3 steps,
    and at most 5% of elements off at all."""
    x = _randn(rows, 200, dtype=dtype, seed=40)
    weight = _randn(144, 200, dtype=dtype, seed=41, scale=0.1)
    y = gate_up_silu(x, weight)
    assert y.shape == (rows, 72) and y.dtype == dtype
    gate_up = (x.float() @ weight.float().T).to(dtype)  # the sums in float32, rounded once
    want = silu_and_mul(gate_up)
    assert float(_ulps(y, want).max()) <= 3.0
    assert (y != want).float().mean().item() <= 0.05
    _assert_near(want, REF.silu_and_mul(gate_up))  # the epilogue's rounding, unfused
    for i in (0, rows - 1):  # a row alone: the same bits as in the batch
        assert torch.equal(gate_up_silu(x[i : i + 1], weight)[0], y[i])


def test_gated_linear_takes_decode_rows_only_when_asked() -> None:
    x = _randn(3, 64, dtype=torch.bfloat16, seed=42)
    weight = _randn(64, 64, dtype=torch.bfloat16, seed=43, scale=0.1)
    unfused = REF.silu_and_mul(REF.linear(x, weight, None, None))
    assert torch.equal(CudaBackend(fused_gate_up=False).gated_linear(x, weight, None), unfused)
    fused = CudaBackend(fused_gate_up=True)
    assert torch.equal(fused.gated_linear(x, weight, None), gate_up_silu(x, weight))
    inv = CudaBackend(batch_invariant=True, fused_gate_up=True)  # its fixed-tile GEMM
    want = silu_and_mul(gemm.linear(x, weight, None))
    assert torch.equal(inv.gated_linear(x, weight, None), want)
    assert not takes(_randn(MAX_ROWS + 1, 64, dtype=torch.bfloat16, seed=44), weight)
    assert not takes(x.float(), weight.float())
    with pytest.raises(ValueError, match="gate_up_silu"):
        gate_up_silu(x.float(), weight.float())
