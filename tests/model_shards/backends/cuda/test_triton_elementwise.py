"""The Triton row kernels (RMSNorm + residual, RoPE + K/V cache write, SiLU-and-mul)
against :class:`ReferenceBackend`; on CPU they run in Triton's interpreter.

Bitwise where the rounding is fully determined (the residual sum, bf16/fp16 RoPE, v,
untouched pool rows, a row alone vs in a batch); elsewhere float32 to ~2e-6 relative
and 16-bit within one rounding step, with at most a few percent of elements off by
that step (a missed intermediate rounding puts ~25% off).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from model_shards.backends.base import KVPool, RotaryStep
from model_shards.backends.cuda.triton_ops.activation import silu_and_mul
from model_shards.backends.cuda.triton_ops.norm import rms_norm, round_to
from model_shards.backends.cuda.triton_ops.rotary import rotary_and_cache
from model_shards.backends.reference import ReferenceBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REF = ReferenceBackend()
EPS = 1e-6
HALF_DTYPES = (torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _assert_near(got: torch.Tensor, want: torch.Tensor, max_off_frac: float = 0.02) -> None:
    """float32: ~2e-6 relative; 16-bit: each element within one rounding step of the
    reference, and few elements off by it."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        return
    g, w = got.float(), want.float()
    step = torch.finfo(want.dtype).eps * torch.maximum(g.abs(), w.abs()) + 1e-30
    assert bool(((g - w).abs() <= step).all()), f"max diff {(g - w).abs().max().item()}"
    off = (got != want).float().mean().item()
    assert off <= max_off_frac, f"{off:.1%} of elements differ from the reference"


# ---- round_to -----------------------------------------------------------------------
@triton.jit
def _round_kernel(x_ptr: tl.tensor, y_ptr: tl.tensor, n: int, DTYPE: tl.constexpr) -> None:
    offs = tl.arange(0, 8192)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, round_to(x, DTYPE), mask=offs < n)  # float32 out


def _rounding_cases(dtype: torch.dtype) -> torch.Tensor:
    """Random magnitudes over the whole range, exact ties, ties' neighbours, the
    subnormal and overflow boundaries, ±0, ±inf, NaN."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.exp2(torch.randint(-40, 40, (2048,), generator=gen).float())
    wide = torch.randn(2048, generator=gen) * scales
    grid = torch.randn(1024, generator=gen).to(dtype).float()
    above = torch.nextafter(grid, grid * 2)
    step = (torch.nextafter(grid.to(dtype), grid.to(dtype) * 2).float() - grid) / 2
    ties = grid + step  # exactly halfway in the dtype (a float32 value)
    tiny = torch.randn(1024, generator=gen) * torch.finfo(dtype).tiny
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            -float("inf"),
            float("nan"),
            65504.0,
            65519.0,
            65520.0,
            -65520.0,
            1e30,
            -3e38,
            6.1e-5,
            5.96e-8,
            2.9e-8,
        ]
    )
    return torch.cat([wide, grid, above, ties, ties.nextafter(ties * 2), tiny, specials])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_round_to_matches_torch_cast(dtype: torch.dtype) -> None:
    """Compared as float32 bits: the interpreter's own float32 → bf16 store cast
    mangles subnormals, which is not what is under test here."""
    x = _rounding_cases(dtype).to(DEVICE)
    assert x.numel() <= 8192
    y = torch.empty_like(x)
    tl_dtype = tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
    _round_kernel[(1,)](x, y, x.numel(), DTYPE=tl_dtype)
    want = x.to(dtype).float()
    nan = want.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int32), want[~nan].view(torch.int32))  # -0 too


# ---- rms_norm ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("hidden", [96, 100])
def test_rms_norm_residual_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    x = _randn(6, hidden, dtype=dtype, seed=1)
    residual = _randn(6, hidden, dtype=dtype, seed=2, scale=4.0)
    weight = _randn(hidden, dtype=dtype, seed=3)
    y_ref, s_ref = REF.rms_norm(x, residual.clone(), weight, EPS)
    res = residual.clone()
    y, s = rms_norm(x, res, weight, EPS)
    assert s is res  # written in place
    assert torch.equal(s, s_ref)
    _assert_near(y, y_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_without_residual(dtype: torch.dtype) -> None:
    x = _randn(5, 100, dtype=dtype, seed=4, scale=3.0)
    weight = _randn(100, dtype=dtype, seed=5)
    y_ref, _ = REF.rms_norm(x, None, weight, EPS)
    x_before = x.clone()
    y, s = rms_norm(x, None, weight, EPS)
    assert s is x and torch.equal(x, x_before)
    _assert_near(y, y_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_row_invariant(dtype: torch.dtype) -> None:
    x = _randn(9, 100, dtype=dtype, seed=6)
    residual = _randn(9, 100, dtype=dtype, seed=7)
    weight = _randn(100, dtype=dtype, seed=8)
    y_all, s_all = rms_norm(x, residual.clone(), weight, EPS)
    for i in (0, 4, 8):
        y_one, s_one = rms_norm(x[i : i + 1], residual[i : i + 1].clone(), weight, EPS)
        assert torch.equal(y_one[0], y_all[i]) and torch.equal(s_one[0], s_all[i])


def test_rms_norm_rejects_mismatched_residual() -> None:
    x = _randn(2, 16, dtype=torch.float32, seed=9)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.zeros(2, 16, dtype=torch.bfloat16), torch.ones(16), EPS)


# ---- rotary_and_cache ----------------------------------------------------------------
def _rope_case(
    dtype: torch.dtype, nh: int, nkv: int, d: int, slots: list[int]
) -> tuple[torch.Tensor, ...]:
    """qkv, positions (past the first few), cos/sin [P, D] with unequal halves, slots,
    and pools that are views one slot into a larger buffer (row 0 guards slot -1)."""
    t, p, n_slots = len(slots), 64, 24
    qkv = _randn(t, (nh + 2 * nkv) * d, dtype=dtype, seed=10, scale=2.0)
    positions = torch.tensor([5, 63, 17, 40, 0, 33, 62, 9][:t], device=DEVICE)
    theta = _randn(p, d, dtype=torch.float32, seed=11, scale=3.0)
    k_buf = _randn(n_slots + 1, nkv, d, dtype=dtype, seed=12)
    v_buf = _randn(n_slots + 1, nkv, d, dtype=dtype, seed=13)
    slot_mapping = torch.tensor(slots, device=DEVICE)
    return qkv, positions, theta.cos(), theta.sin(), k_buf, v_buf, slot_mapping


def _reference_rotary(
    qkv: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    nh: int,
    nkv: int,
) -> torch.Tensor:
    """The reference backend's RoPE + K/V write, called with the kernel's flat arguments."""
    step = RotaryStep(pos, cos, sin, slots)
    return REF.rotary_and_cache(qkv, step, KVPool(k_pool, v_pool, 1), (nh, nkv))


@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize(("nh", "nkv", "d"), [(6, 2, 16), (3, 1, 64)])
def test_rotary_and_cache_matches_reference(dtype: torch.dtype, nh: int, nkv: int, d: int) -> None:
    slots = [3, 17, -1, 0, 23, 8, -1]
    qkv, pos, cos, sin, k_buf, v_buf, slot_mapping = _rope_case(dtype, nh, nkv, d, slots)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    q_ref = _reference_rotary(
        qkv.clone(), pos, cos, sin, k_ref[1:], v_ref[1:], slot_mapping, nh, nkv
    )
    k_buf0, v_buf0 = k_buf.clone(), v_buf.clone()
    q = rotary_and_cache(qkv, pos, cos, sin, k_buf[1:], v_buf[1:], slot_mapping, nh, nkv)
    assert q.shape == (len(slots), nh, d) and q.data_ptr() == qkv.data_ptr()  # a view
    assert torch.equal(v_buf, v_ref)  # raw v copied, padding rows skipped
    written = torch.tensor([s + 1 for s in slots if s >= 0], device=DEVICE)
    kept = torch.ones(k_buf.shape[0], dtype=torch.bool, device=DEVICE)
    kept[written] = False
    assert torch.equal(k_buf[kept], k_buf0[kept]) and torch.equal(v_buf[kept], v_buf0[kept])
    real = slot_mapping >= 0
    k_rot = qkv.view(len(slots), -1, d)[:, nh : nh + nkv]  # k rotated in place too
    assert torch.equal(k_rot[real], k_buf[1:][slot_mapping[real]])
    if dtype == torch.float32:
        _assert_near(q, q_ref)
        _assert_near(k_buf, k_ref)
    else:  # products of two 16-bit values are exact in float32: every rounding matches
        assert torch.equal(q, q_ref)
        assert torch.equal(k_buf, k_ref)


def test_rotary_all_padding_leaves_pools_untouched() -> None:
    qkv, pos, cos, sin, k_buf, v_buf, slot_mapping = _rope_case(
        torch.bfloat16, 3, 1, 16, [-1, -1, -1]
    )
    k_buf0, v_buf0 = k_buf.clone(), v_buf.clone()
    q_ref = _reference_rotary(
        qkv.clone(), pos, cos, sin, k_buf0[1:].clone(), v_buf0[1:].clone(), slot_mapping, 3, 1
    )
    q = rotary_and_cache(qkv, pos, cos, sin, k_buf[1:], v_buf[1:], slot_mapping, 3, 1)
    assert torch.equal(q, q_ref)
    assert torch.equal(k_buf, k_buf0) and torch.equal(v_buf, v_buf0)


def test_rotary_rejects_wrong_width() -> None:
    qkv, pos, cos, sin, k_buf, v_buf, slot_mapping = _rope_case(torch.float32, 6, 2, 16, [0])
    with pytest.raises(ValueError, match="qkv"):
        rotary_and_cache(qkv, pos, cos, sin, k_buf[1:], v_buf[1:], slot_mapping, 5, 2)


# ---- silu_and_mul --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, *HALF_DTYPES])
@pytest.mark.parametrize("inter", [96, 100, 1100])  # 1100: two column blocks
def test_silu_and_mul_matches_reference(dtype: torch.dtype, inter: int) -> None:
    x = _randn(4, 2 * inter, dtype=dtype, seed=14, scale=3.0)
    y = silu_and_mul(x)
    _assert_near(y, REF.silu_and_mul(x))


def test_silu_and_mul_row_invariant_and_strided() -> None:
    wide = _randn(5, 300, dtype=torch.bfloat16, seed=15, scale=3.0)
    x = wide[:, 50:250]  # [5, 200], row stride 300
    y_all = silu_and_mul(x)
    assert torch.equal(y_all, silu_and_mul(x.contiguous()))
    for i in (0, 4):
        assert torch.equal(silu_and_mul(x[i : i + 1])[0], y_all[i])
