"""FP8 W8A8 on the ``cuda`` backend (:mod:`model_shards.backends.cuda.triton_ops.fp8_gemm`), in
Triton's interpreter without a GPU: the activation rounding kernel is bitwise
:func:`model_shards.quant.fp8.quantize_activations` (dynamic per token, zero rows, static scale
with clamping), and the Triton FP8 GEMM with its operands upcast to float32 in the tile
(the interpreter's ``tl.dot`` has no FP8) matches the reference backend's ``fp8_linear``.

``fp8_gemm.scaled_mm`` is checked here through ``torch._scaled_mm``'s CPU implementation. The
GEMM's native e4m3 ``tl.dot`` and the backend's cuBLASLt path need an FP8 GPU (sm89+): their
tests below are skipped on CPU and run by ``make gpu-check``, whose parity part runs
``tests/model_shards/backends`` on the GPU (``benchmarks/gpu/parity.py``).

GEMM tolerance: e4m3 products are exact in float32, so the kernel and the reference differ
by the float32 sum's order and the scales' placement (``1e-5 |x̂| @ |W|^T``) and then by one
rounding of each to the output dtype (``u |ref|``, ``u`` its unit roundoff).
"""

from __future__ import annotations

import pytest
import torch

from model_shards.backends.cuda.backend import CudaBackend
from model_shards.backends.cuda.triton_ops.fp8_gemm import (
    fp8_matmul,
    fp8_operand,
    quantize_rows,
    scaled_mm,
)
from model_shards.backends.reference import ReferenceBackend
from model_shards.quant.fp8 import Fp8Weight, quantize_activations

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_GPU = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


pytestmark = pytest.mark.usefixtures("one_thread")


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]  # rows of all sizes
    return x.to(DEVICE, dtype)


def _weight(n: int, k: int, seed: int, static: float | None) -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = 1e-3 + 1e-2 * torch.rand(n, generator=gen)
    inp = None if static is None else torch.tensor(static, device=DEVICE)
    return Fp8Weight(w.to(DEVICE), scale.to(DEVICE), inp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("static", [None, 0.02])
def test_quantize_rows_is_the_reference_bitwise(dtype: torch.dtype, static: float | None) -> None:
    """Rows from 1e-3 to 1e2 in size, one all zero, K past one column block (1024 + 40);
    a static scale of 0.02 clamps the large rows at ±448."""
    x = _x(6, 1064, dtype, seed=1)
    x[2] = 0
    scale = None if static is None else torch.tensor(static, device=DEVICE)
    q, s = quantize_rows(x, scale)  # [M, K] e4m3, [M]
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6,)
    assert torch.equal(q.float() * s[:, None], quantize_activations(x, scale))
    if static is None:  # FBGEMM's bound of max |x|: the rows above it clamp at ±448
        q, s = quantize_rows(x, None, 50.0)
        assert torch.equal(q.float() * s[:, None], quantize_activations(x, None, 50.0))
        big = x.float().abs().amax(1) > 50
        assert bool(big.any()) and torch.all(s[big] == torch.tensor(50.0) / 448)
        assert torch.all(q[big].float().abs().amax(1) == 448)
    if static is None:
        assert s[2].item() == 1.0, "a zero row keeps scale 1"
    else:
        assert torch.all(s == torch.tensor(static).float().item())
        assert q.float().abs().max().item() == 448.0


@pytest.mark.parametrize(
    ("m", "k", "n", "dtype", "static", "bias"),
    [
        (1, 96, 80, torch.bfloat16, None, False),
        (5, 160, 48, torch.float32, None, True),
        (67, 64, 72, torch.float16, 0.05, True),  # two M tiles, a static scale
    ],
)
def test_fp8_linear_matches_reference(
    m: int, k: int, n: int, dtype: torch.dtype, static: float | None, bias: bool
) -> None:
    """``CudaBackend.fp8_linear`` (on CPU: the Triton GEMM, float32 operands)."""
    w = _weight(n, k, seed=k + n, static=static)
    x = _x(m, k, dtype, seed=m)
    b = _x(1, n, dtype, seed=3)[0] if bias else None
    backend = CudaBackend()
    y = backend.fp8_linear(x, w, b)  # [M, N]
    assert y.shape == (m, n) and y.dtype == dtype
    ref = ReferenceBackend().fp8_linear(x.float(), w, None if b is None else b.float())
    abs_dot = quantize_activations(x, w.input_scale).abs() @ w.dequantize().abs().t()
    bound = UNIT_ROUNDOFF[dtype] * ref.abs() + 1e-5 * abs_dot + 1e-6
    err = (y.float() - ref).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item()}"


def test_fp8_rows_ignore_their_batch_and_bad_arguments() -> None:
    """Per-token scales and fixed tiles: a row's bits are the same alone and in a batch."""
    w = _weight(40, 64, seed=4, static=None)
    x = _x(9, 64, torch.bfloat16, seed=5)
    full = CudaBackend().fp8_linear(x, w, None)
    assert torch.equal(CudaBackend().fp8_linear(x[:1], w, None), full[:1])
    q, s = quantize_rows(x, None)
    with pytest.raises(ValueError, match="K=32"):
        fp8_matmul(q[:, :32], s, w, None, torch.bfloat16, "f32")
    with pytest.raises(ValueError, match="bias"):
        fp8_matmul(q, s, w, torch.zeros(3, device=DEVICE), torch.bfloat16, "f32")


def _check_against_reference(
    y: torch.Tensor, x: torch.Tensor, w: Fp8Weight, b: torch.Tensor | None, roundings: int
) -> None:
    """``y`` within ``roundings`` output roundings plus the float32 sum's order of the
    reference (module doc)."""
    ref = ReferenceBackend().fp8_linear(x.float(), w, None if b is None else b.float())
    abs_dot = quantize_activations(x, w.input_scale).abs() @ w.dequantize().abs().t()
    bias = 0 if b is None else b.float().abs()
    bound = roundings * UNIT_ROUNDOFF[y.dtype] * (ref.abs() + bias) + 1e-5 * abs_dot + 1e-6
    err = (y.float() - ref).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("static", [None, 0.05])
def test_scaled_mm_wrapper(static: float | None) -> None:
    """``fp8_gemm.scaled_mm``'s operands and scales as ``torch._scaled_mm`` takes them (it
    runs on CPU too; on an FP8 GPU it is cuBLASLt): the reference's numbers within two
    bfloat16 roundings (the product, then the bias added)."""
    w = _weight(48, 96, seed=12, static=static)
    x = _x(5, 96, torch.bfloat16, seed=13)
    b = _x(1, 48, torch.bfloat16, seed=14)[0]
    q, s = quantize_rows(x, w.input_scale)
    y = scaled_mm(q, s, w, b)
    assert y.shape == (5, 48) and y.dtype == torch.bfloat16
    _check_against_reference(y, x, w, b, 2)


@pytest.mark.skipif(not FP8_GPU, reason="native e4m3 operands need an sm89+ GPU (gpu-check)")
@pytest.mark.parametrize("operand", ["fp8", "bf16"])
def test_gpu_fp8_gemm_operands(operand: str) -> None:
    """The Triton FP8 GEMM with e4m3 fed to the tensor cores, and upcast to bfloat16."""
    assert fp8_operand(torch.device(DEVICE)) == "fp8"
    w = _weight(272, 320, seed=6, static=None)
    x = _x(33, 320, torch.bfloat16, seed=7)
    b = _x(1, 272, torch.bfloat16, seed=8)[0]
    q, s = quantize_rows(x, None)
    _check_against_reference(fp8_matmul(q, s, w, b, torch.bfloat16, operand), x, w, b, 1)


@pytest.mark.skipif(not FP8_GPU, reason="torch._scaled_mm needs an sm89+ GPU (gpu-check)")
@pytest.mark.parametrize("static", [None, 0.05])
def test_gpu_scaled_mm_path(static: float | None) -> None:
    """``CudaBackend.fp8_linear`` on an FP8 GPU takes cuBLASLt (bias added after one
    bfloat16 rounding: two roundings), the same numbers as the reference."""
    backend = CudaBackend()
    assert backend.fp8_scaled_mm
    w = _weight(256, 512, seed=9, static=static)
    x = _x(7, 512, torch.bfloat16, seed=10)
    b = _x(1, 256, torch.bfloat16, seed=11)[0]
    _check_against_reference(backend.fp8_linear(x, w, b), x, w, b, 2)
    q, s = quantize_rows(x, w.input_scale)
    assert torch.equal(scaled_mm(q, s, w, b), backend.fp8_linear(x, w, b))
