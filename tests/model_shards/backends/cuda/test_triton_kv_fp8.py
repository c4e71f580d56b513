"""FP8 K/V pools (``--kv-cache-dtype fp8``, :mod:`model_shards.backends.cuda.triton_ops.e4m3`)
in Triton's interpreter without a GPU: the rotary kernel stores ``e4m3(k / k_scale)`` and
``e4m3(v / v_scale)`` bitwise as torch rounds them, and the decode (single pass and split-K)
and prefill kernels reading an FP8 pool match the reference backend on float pools holding
the same rounded values (``e4m3 · scale`` in the model dtype), to the float pools' tolerance.
And the refusal where K/V stay float: a CPU replica plan, the ``cpu`` backend (the reference
backend holds FP8 pools: the spec of these kernels).
"""

from __future__ import annotations

import pytest
import torch

from model_shards.backends.base import DecodeMeta, KVPool, PrefillMeta
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cuda.backend import CudaBackend
from model_shards.backends.cuda.triton_ops.rotary import rotary_and_cache
from model_shards.backends.reference import ReferenceBackend
from model_shards.config.replica import ReplicaConfig
from model_shards.launch.replicas import plan_data_parallel
from model_shards.worker.kv_scales import kv_pool_dtype

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.05, 0.02
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


pytestmark = pytest.mark.usefixtures("one_thread")


def _fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(FP8)


def _pools(
    slots: int, nkv: int, d: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[KVPool, KVPool, int]:
    """An FP8 pool (scales ``K_SCALE``, ``V_SCALE``) and the float pool of its values."""
    k = _fp8(torch.randn(slots, nkv, d, generator=gen) * 3, K_SCALE).to(DEVICE)
    v = _fp8(torch.randn(slots, nkv, d, generator=gen) * 3, V_SCALE).to(DEVICE)
    fp8 = KVPool(k, v, 4, K_SCALE, V_SCALE)
    dense = KVPool((k.float() * K_SCALE).to(dtype), (v.float() * V_SCALE).to(dtype), 4)
    return fp8, dense, slots


def test_rotary_writes_scaled_e4m3() -> None:
    nh, nkv, d, t = 4, 2, 16, 5
    gen = torch.Generator().manual_seed(1)
    qkv = (torch.randn(t, (nh + 2 * nkv) * d, generator=gen) * 4).to(DEVICE, torch.bfloat16)
    v_in = qkv.view(t, -1, d)[:, nh + nkv :].clone()  # [T, nkv, D]
    theta = torch.randn(32, d, generator=gen)
    pos = torch.tensor([3, 0, 31, 7, 9], device=DEVICE)
    slots = torch.tensor([5, -1, 0, 11, 2], device=DEVICE)
    k_pool = torch.zeros(12, nkv, d, dtype=FP8, device=DEVICE)
    v_pool = torch.zeros(12, nkv, d, dtype=FP8, device=DEVICE)
    rotary_and_cache(
        qkv, pos, theta.cos().to(DEVICE), theta.sin().to(DEVICE), k_pool, v_pool, slots,
        nh, nkv, kv_scales=(K_SCALE, V_SCALE),
    )  # fmt: skip
    k_rot = qkv.view(t, -1, d)[:, nh : nh + nkv]  # rotated in place, bfloat16
    real = slots >= 0
    bits = torch.uint8
    assert torch.equal(k_pool[slots[real]].view(bits), _fp8(k_rot[real], K_SCALE).view(bits))
    assert torch.equal(v_pool[slots[real]].view(bits), _fp8(v_in[real], V_SCALE).view(bits))
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots[real].cpu()] = False
    assert torch.all(k_pool[untouched.to(DEVICE)].float() == 0)


@pytest.mark.parametrize(("dtype", "split"), [(torch.bfloat16, None), (torch.float32, 8)])
def test_decode_reads_fp8_pools(dtype: torch.dtype, split: int | None) -> None:
    gen = torch.Generator().manual_seed(2)
    nh, nkv, d, bs = 6, 2, 32, 4
    lens = [9, 0, 1, 40]
    nblk = -(-max(lens) // bs)
    tables = torch.randperm(len(lens) * nblk + 2, generator=gen)[: len(lens) * nblk]
    tables = tables.view(len(lens), nblk).to(DEVICE)
    fp8, dense, _ = _pools((len(lens) * nblk + 2) * bs, nkv, d, dtype, gen)
    q = torch.randn(len(lens), nh, d, generator=gen).to(DEVICE, dtype)  # [B, nh, D]
    meta = DecodeMeta(tables, torch.tensor(lens, device=DEVICE))
    backend = CudaBackend()
    if split is not None:
        from model_shards.backends.cuda.triton_ops.attention_decode import decode_attention

        got = decode_attention(
            q, fp8.k, fp8.v, tables, meta.context_lens, bs, 0.2, split_kv=split,
            kv_scales=(K_SCALE, V_SCALE),
        )  # fmt: skip
    else:
        got = backend.decode_attention(q, fp8, meta, 0.2)
    want = ReferenceBackend().decode_attention(q, dense, meta, 0.2)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_prefill_reads_fp8_pools() -> None:
    gen = torch.Generator().manual_seed(3)
    nh, nkv, d, bs, dtype = 4, 1, 16, 4, torch.bfloat16
    lens, starts = [5, 17], [3, 0]
    nblk = 5
    tables = torch.randperm(2 * nblk + 1, generator=gen)[: 2 * nblk].view(2, nblk).to(DEVICE)
    fp8, dense, _ = _pools((2 * nblk + 1) * bs, nkv, d, dtype, gen)
    meta = PrefillMeta(
        q_starts=torch.tensor([0, 5], device=DEVICE),
        q_lens=torch.tensor(lens, device=DEVICE),
        start_positions=torch.tensor(starts, device=DEVICE),
        block_tables=tables,
        q_starts_list=[0, 5],
        q_lens_list=lens,
        start_positions_list=starts,
        block_size=bs,
    )
    q = torch.randn(22, nh, d, generator=gen).to(DEVICE, dtype)  # [T, nh, D]
    got, want = torch.zeros_like(q), torch.zeros_like(q)
    CudaBackend().prefill_attention(q, fp8, meta, 0.25, got)
    ReferenceBackend().prefill_attention(q, dense, meta, 0.25, want)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_fp8_kv_refused_where_kv_stays_float() -> None:
    """A replica planned on CPU (``--device auto``, no GPU) and the ``cpu`` backend."""
    config = ReplicaConfig("unused", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: the CPU backend keeps float"):
        plan_data_parallel(config, 1, cpu_count=2, gpu_count=0)
    cpu = object.__new__(CpuBackend)  # its class attributes only: no C++ build needed
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: the cpu backend keeps float"):
        kv_pool_dtype(config, torch.bfloat16, cpu)
    assert kv_pool_dtype(config, torch.bfloat16, ReferenceBackend()) == FP8
    assert kv_pool_dtype(config, torch.bfloat16, CudaBackend()) == FP8
    assert kv_pool_dtype(ReplicaConfig("unused"), torch.bfloat16, CudaBackend()) == torch.bfloat16
