"""The cpu backend's fused kernels (model_shards/backends/cpu/kernels) against the reference
backend.

Each kernel must give the reference's numbers (float32 to rounding error,
bfloat16 to one rounding step) and compute every row on its own: a row's result
is bitwise the same alone or in a batch.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from model_shards.backends import Backend, ReferenceBackend, select_backend
from model_shards.backends.base import DecodeMeta, KVPool
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load
from model_shards.config.rope import RopeConfig
from model_shards.layers.attention import Attention, ForwardBatch
from model_shards.layers.rotary import RotaryEmbedding
from model_shards.messages import SeqChunk
from model_shards.worker.kv_cache import PagedKVCache

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def test_kernels_build_here() -> None:
    """CI's machine has a compiler: the fast path must really be in use, not silently off."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.fail(f"no kernel expectations for {platform.system()} {platform.machine()}")
    assert build_and_load()
    cpu = torch.device("cpu")
    assert isinstance(select_backend(cpu, torch.float32, environ={}), CpuBackend)
    assert isinstance(select_backend(cpu, torch.bfloat16, environ={}), CpuBackend)
    half = select_backend(cpu, torch.float16, environ={})
    assert type(half) is ReferenceBackend  # no fp16 kernels: the reference serves
    off = select_backend(cpu, torch.float32, environ={"SHARDSERVE_BACKEND": "reference"})
    assert type(off) is ReferenceBackend
    with pytest.raises(ValueError, match="SHARDSERVE_BACKEND"):
        select_backend(cpu, torch.float32, environ={"SHARDSERVE_BACKEND": "tpu"})
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend(cpu, torch.float32, environ={"SHARDSERVE_BACKEND": "cuda"})


CPU: Backend = CpuBackend() if build_and_load() else ReferenceBackend()
REF: Backend = ReferenceBackend()


def test_vectorized_decode_attention_runs_here() -> None:
    """Where the CPU has AVX-512 (BF16), the common head dims take the vectorized kernel,
    so the tests here check it and not only the portable one."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    supports = torch.ops.shardserve_cpu.decode_attention_vectorized
    for d in (48, 64, 80, 96, 128, 256):
        assert supports(torch.float32, d) == ("avx512f" in flags)
        assert supports(torch.bfloat16, d) == ("avx512_bf16" in flags and "avx512bw" in flags)
    assert not supports(torch.float32, 16) and not supports(torch.float32, 72)
    assert not supports(torch.float16, 64)


def test_vectorized_decode_attention_matches_portable() -> None:
    """Many lengths and block sizes, straight on the op: vectorized vs portable kernel."""
    g = torch.Generator().manual_seed(11)
    for dtype in DTYPES:
        for d, nh, nkv, bs in [
            (64, 9, 3, 16),
            (128, 8, 2, 16),
            (64, 4, 4, 32),
            (64, 6, 2, 8),
            (48, 6, 2, 16),
            (80, 4, 1, 16),
            (96, 4, 2, 8),
            (256, 2, 1, 16),
        ]:
            pool = [torch.randn(200 * bs, nkv, d, generator=g).to(dtype) for _ in range(2)]
            tables = torch.randperm(200, generator=g)[:42].view(7, 6)
            lens = torch.tensor([1, 5, bs, bs + 1, 3 * bs - 1, 40, 6 * bs])
            q = (3 * torch.randn(7, nh, d, generator=g)).to(dtype)
            args = (q, *pool, tables, lens, bs, d**-0.5)
            fast = torch.ops.shardserve_cpu.decode_attention(*args, True)
            portable = torch.ops.shardserve_cpu.decode_attention(*args, False)
            _close(fast, portable, dtype)


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (0, 2.0), (7, 1.5)])
def test_decode_attention_window_and_softcap_match_reference(window: int, softcap: float) -> None:
    """Gemma's decode attention on the C++ kernels (vectorized and portable): only the last
    ``window`` positions (the table's earlier entries garbage), soft-capped scores."""
    g = torch.Generator().manual_seed(13)
    for dtype in DTYPES:
        for d, nh, nkv, bs in [(64, 4, 2, 16), (256, 2, 1, 4), (32, 4, 1, 4)]:
            pool = [torch.randn(100 * bs, nkv, d, generator=g).to(dtype) for _ in range(2)]
            tables = torch.randperm(100, generator=g)[:48].view(6, 8)
            lens = torch.tensor([1, 4, bs + 3, 2 * bs, 29, 8 * bs])
            q = (3 * torch.randn(6, nh, d, generator=g)).to(dtype)
            meta = DecodeMeta(tables, lens, window=window or None)
            want = REF.decode_attention(q, KVPool(*pool, bs), meta, d**-0.5, softcap or None)
            args = (q, *pool, tables, lens, bs, d**-0.5)
            for vectorized in (True, False):
                got = torch.ops.shardserve_cpu.decode_attention(*args, vectorized, window, softcap)
                _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax(dtype: torch.dtype) -> None:
    """torch.argmax's answer: the first maximum on ties, a NaN wins, any row length."""
    g = torch.Generator().manual_seed(2)
    for vocab in (1, 15, 16, 17, 100, 4099):
        x = torch.randint(-3, 3, (6, vocab), generator=g).to(dtype)  # many ties
        x[0] = float("-inf")
        x[1, vocab // 2] = float("nan")
        x[2, -1] = float("inf")
        assert torch.equal(CPU.argmax(x), x.argmax(-1)), vocab
    rows = torch.randn(3, 2 * 4099, generator=g).to(dtype)[:, :4099]  # rows apart in memory
    assert torch.equal(CPU.argmax(rows), rows.argmax(-1))


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g).to(dtype)
    res = torch.randn(37, 96, generator=g).to(dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    ref_y, ref_s = REF.rms_norm(x, res, w, 1e-5)
    res_k = res.clone() if res is not None else None
    y, s = CPU.rms_norm(x, res_k, w, 1e-5)
    _close(y, ref_y, dtype)
    assert torch.equal(s, ref_s), "x + residual must round exactly like the reference"
    alone, _ = CPU.rms_norm(x[5:6], res.clone()[5:6] if res is not None else None, w, 1e-5)
    assert torch.equal(alone, y[5:6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = (4 * torch.randn(33, 2 * 80, generator=torch.Generator().manual_seed(1))).to(dtype)
    ref = REF.silu_and_mul(x)
    y = CPU.silu_and_mul(x)
    _close(y, ref, dtype)
    assert torch.equal(CPU.silu_and_mul(x[7:8]), y[7:8])


def _attention_step(
    dtype: torch.dtype,
    chunks: list[SeqChunk],
    lengths: dict[int, int],
    seed: int,
    d: int = 16,
    bs: int = 4,
    ops: Backend = CPU,
) -> tuple[Attention, ForwardBatch, torch.Tensor]:
    """A GQA layer (6 query heads, 2 KV heads, head dim ``d``, blocks of ``bs``) over a pool
    whose earlier positions hold random K/V; returns the layer, the step's batch and its qkv."""
    nh, nkv = 6, 2
    g = torch.Generator().manual_seed(seed)
    kv = PagedKVCache(range(1), 40, bs, nkv, d, dtype, torch.device("cpu"))
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    perm = torch.randperm(40, generator=g).tolist()
    for seq_id, length in lengths.items():
        blocks = -(-length // bs)
        kv.tables[seq_id] = [perm.pop() for _ in range(blocks)]
    batch = ForwardBatch.build(chunks, kv)
    batch.rotary = RotaryEmbedding(d, 64, RopeConfig())
    qkv = torch.randn(batch.num_tokens, (nh + 2 * nkv) * d, generator=g).to(dtype)
    return Attention(0, nh, nkv, d, ops), batch, qkv


def _chunk(seq_id: int, start: int, n: int) -> SeqChunk:
    return SeqChunk(seq_id=seq_id, token_ids=[1] * n, start_pos=start, new_block_ids=[])


def test_batch_positions_and_slots_follow_the_block_tables() -> None:
    lengths = {0: 9, 1: 1, 2: 17, 5: 7}
    chunks = [_chunk(0, 8, 1), _chunk(5, 2, 5), _chunk(1, 0, 1), _chunk(2, 16, 1)]
    _, batch, _ = _attention_step(torch.float32, chunks, lengths, seed=3)
    kv, bs = batch.kv, batch.kv.block_size
    positions = [p for c in chunks for p in range(c.start_pos, c.start_pos + len(c.token_ids))]
    seqs = [c.seq_id for c in chunks for _ in c.token_ids]
    slots = [kv.tables[s][p // bs] * bs + p % bs for s, p in zip(seqs, positions, strict=True)]
    assert batch.positions.tolist() == positions
    assert batch.slot_mapping.tolist() == slots
    assert batch.decode_rows.tolist() == [0, 6, 7]
    assert batch.decode.context_lens.tolist() == [9, 1, 17]
    with pytest.raises(RuntimeError, match="too short"):  # 9 tokens hold 3 blocks of 4
        ForwardBatch.build([_chunk(0, 12, 1)], kv)


# (head dim, block size): 16 runs the portable decode-attention kernel; the others the
# vectorized one where the CPU has AVX-512, with chunks cut at block edges (4) and blocks
# longer than one 16-token chunk (32); 48 leaves half a bf16 dot step.
SHAPES = [(16, 4), (48, 4), (64, 4), (128, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mixed", [False, True], ids=["decodes", "decodes+prefill"])
@pytest.mark.parametrize(("d", "bs"), SHAPES, ids=[f"d{d}-bs{bs}" for d, bs in SHAPES])
def test_attention_step(dtype: torch.dtype, mixed: bool, d: int, bs: int) -> None:
    """RoPE + K/V write + decode attention: output and the pool match the reference."""
    lengths = {0: 9, 1: 1, 2: 17, 3: 4, 4: 12, 6: 36}
    chunks = [_chunk(s, n - 1, 1) for s, n in lengths.items()]
    if mixed:
        lengths[5] = 7
        chunks.insert(2, _chunk(5, 2, 5))  # a prefill chunk continuing a cached prefix

    def run(ops: Backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer, batch, qkv = _attention_step(dtype, chunks, lengths, seed=3, d=d, bs=bs, ops=ops)
        return layer(qkv, batch), batch.kv.k[0], batch.kv.v[0]

    out_ref, k_ref, v_ref = run(REF)
    out, k, v = run(CPU)
    _close(out, out_ref, dtype)
    torch.testing.assert_close(k.float(), k_ref.float(), atol=TOL[dtype], rtol=0)
    assert torch.equal(v, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 64])
def test_decode_attention_row_is_batch_invariant(dtype: torch.dtype, d: int) -> None:
    lengths = {0: 9, 1: 30, 2: 3}
    layer, batch, qkv = _attention_step(
        dtype, [_chunk(s, n - 1, 1) for s, n in lengths.items()], lengths, seed=5, d=d
    )
    row = qkv[1:2].clone()  # the layer rotates qkv in place
    together = layer(qkv, batch)
    alone_batch = ForwardBatch.build([_chunk(1, 29, 1)], batch.kv)
    alone_batch.rotary = batch.rotary
    alone = layer(row, alone_batch)
    assert torch.equal(alone, together[1:2])


def test_bad_indices_are_errors_not_stray_memory_access() -> None:
    lengths = {0: 9}
    _, batch, qkv = _attention_step(torch.float32, [_chunk(0, 8, 1)], lengths, seed=7)
    assert batch.rotary is not None
    ops = torch.ops.shardserve_cpu
    pool_k, pool_v = batch.kv.k[0], batch.kv.v[0]
    too_far = torch.tensor([batch.rotary.cos_cached.shape[0]])
    with pytest.raises(RuntimeError, match="position"):
        ops.rotary_and_cache(
            qkv,
            too_far,
            batch.rotary.cos_cached,
            batch.rotary.sin_cached,
            pool_k,
            pool_v,
            batch.slot_mapping,
            6,
            2,
        )
    with pytest.raises(RuntimeError, match="slot"):
        ops.rotary_and_cache(
            qkv,
            batch.positions,
            batch.rotary.cos_cached,
            batch.rotary.sin_cached,
            pool_k,
            pool_v,
            torch.tensor([pool_k.shape[0]]),
            6,
            2,
        )
    q = qkv.view(1, -1, 16)[:, :6]
    bad_table = torch.tensor([[batch.kv.num_blocks, 0, 0]])
    with pytest.raises(RuntimeError, match="block id"):
        ops.decode_attention(q, pool_k, pool_v, bad_table, batch.decode.context_lens, 4, 0.25)
    with pytest.raises(RuntimeError, match="context length"):
        ops.decode_attention(
            q, pool_k, pool_v, batch.decode.block_tables, torch.tensor([13]), 4, 0.25
        )
