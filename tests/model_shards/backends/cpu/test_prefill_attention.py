"""The cpu backend's fused prefill attention (``kernels/prefill_attention.cpp``) against the
reference backend's (one SDPA per chunk over its gathered context), on random paged pools:
several chunks of different lengths in one call, prefix-cached starts, grouped-query heads,
sliding windows, both kernels (vectorized and portable), and thread-count invariance; and
Gemma 3 (windows, no soft-cap) served in prefill chunks and from the prefix cache through the
kernel, greedy tokens equal to transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from model_shards.backends.base import KVPool, PrefillMeta
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load
from model_shards.backends.reference import ReferenceBackend
from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from tests.checkpoints import hf_greedy
from tests.families import gemma3

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]
REF = ReferenceBackend()
# (q_len, start position) of each chunk of one step: a fresh prompt, prefix-cache hits and
# chunked-prefill continuations, a one-token chunk, lengths across tile and block edges
CHUNKS = [(32, 0), (17, 5), (1, 40), (45, 16), (3, 0), (70, 33)]


def _ops() -> Any:
    assert build_and_load(), "the CPU kernels must build here"
    return torch.ops.shardserve_cpu


def _step(
    g: torch.Generator,
    chunks: list[tuple[int, int]],
    nh: int,
    nkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    window: int | None,
) -> tuple[torch.Tensor, KVPool, PrefillMeta]:
    """Random q ``[T + 2, nh, D]`` (a spare row either side of the chunks, which the kernel
    must leave alone), a random pool of 128 blocks, each chunk's blocks drawn at random."""
    k, v = (torch.randn(128 * bs, nkv, d, generator=g).to(dtype) for _ in range(2))
    pool = KVPool(k, v, bs)
    nblk = max(-(-(s + n) // bs) for n, s in chunks) + 1
    tables = torch.stack([torch.randperm(128, generator=g)[:nblk] for _ in chunks])
    lens = [n for n, _ in chunks]
    rows = [1 + sum(lens[:i]) for i in range(len(chunks))]
    starts = [s for _, s in chunks]
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    meta = PrefillMeta(
        as_tensor(rows), as_tensor(lens), as_tensor(starts), tables, rows, lens, starts, bs, window
    )
    qkv = 3 * torch.randn(sum(lens) + 2, nh + 2 * nkv, d, generator=g)
    return qkv.to(dtype)[:, :nh], pool, meta  # q a strided view, as the layers pass it


def _run(
    q: torch.Tensor, pool: KVPool, meta: PrefillMeta, scale: float, vectorized: bool = True
) -> torch.Tensor:
    out = torch.full(q.shape, 7.0, dtype=q.dtype)
    _ops().prefill_attention(
        q,
        pool.k,
        pool.v,
        out,
        meta.block_tables,
        meta.q_starts,
        meta.q_lens,
        meta.start_positions,
        meta.block_size,
        scale,
        meta.window or 0,
        vectorized,
    )
    return out


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    tol = TOL[dtype]
    torch.testing.assert_close(got[1:-1].float(), want[1:-1].float(), atol=tol, rtol=tol)
    assert bool((got[[0, -1]] == 7.0).all()), "rows outside the chunks were written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("nh", "nkv", "d", "bs", "window"),
    [
        (9, 3, 64, 16, None),  # the bench model's heads
        (8, 2, 128, 16, None),
        (4, 4, 64, 32, None),
        (6, 2, 64, 8, 5),
        (4, 1, 128, 16, 24),
        (9, 3, 64, 4, 40),
        (4, 2, 32, 16, 7),  # a head dim with no vectorized kernel: the portable one
    ],
)
def test_matches_reference(
    dtype: torch.dtype, nh: int, nkv: int, d: int, bs: int, window: int | None
) -> None:
    g = torch.Generator().manual_seed(nh * 1000 + d + bs)
    q, pool, meta = _step(g, CHUNKS, nh, nkv, d, bs, dtype, window)
    want = torch.full(q.shape, 7.0, dtype=dtype)
    REF.prefill_attention(q, pool, meta, d**-0.5, want)
    for vectorized in (True, False):
        _close(_run(q, pool, meta, d**-0.5, vectorized), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_wiring_and_softcap_fallback(dtype: torch.dtype) -> None:
    """CpuBackend.prefill_attention runs the kernel (window included), and soft-capped
    scores (Gemma 2) take the reference's path, so they still match it."""
    assert build_and_load()
    cpu = CpuBackend()
    g = torch.Generator().manual_seed(5)
    for window, softcap in [(None, None), (9, None), (None, 2.0), (6, 1.5)]:
        q, pool, meta = _step(g, CHUNKS[:4], 4, 2, 64, 16, dtype, window)
        want, got = (torch.full(q.shape, 7.0, dtype=dtype) for _ in range(2))
        REF.prefill_attention(q, pool, meta, 0.125, want, softcap)
        cpu.prefill_attention(q, pool, meta, 0.125, got, softcap)
        _close(got, want, dtype)
        if softcap is None:
            assert torch.equal(got, _run(q, pool, meta, 0.125))


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bits_with_one_and_two_threads(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    q, pool, meta = _step(g, CHUNKS, 9, 3, 64, 16, dtype, 20)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [_run(q, pool, meta, 0.125, v) for v in (True, False)]
        torch.set_num_threads(2)
        two = [_run(q, pool, meta, 0.125, v) for v in (True, False)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_bad_operands_are_errors() -> None:
    """Indices past the pool, the table or q are errors, never stray reads or writes."""
    g = torch.Generator().manual_seed(4)
    q, pool, meta = _step(g, CHUNKS[:2], 4, 2, 64, 16, torch.float32, None)
    bad_table = meta.block_tables.clone()
    bad_table[1, 0] = 128  # the pool holds blocks 0 .. 127
    with pytest.raises(RuntimeError, match="block id"):
        _run(q, pool, PrefillMeta(**{**meta.__dict__, "block_tables": bad_table}), 0.125)
    too_long = torch.tensor([32, 10**6])
    with pytest.raises(RuntimeError, match="rows out of range"):
        _run(q, pool, PrefillMeta(**{**meta.__dict__, "q_lens": too_long}), 0.125)
    far = torch.tensor([0, 10**6])
    with pytest.raises(RuntimeError, match="beyond its block table"):
        _run(q, pool, PrefillMeta(**{**meta.__dict__, "start_positions": far}), 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        _run(q.to(torch.bfloat16), pool, meta, 0.125)


def _greedy(coord: Coordinator, rid: str, prompt: list[int], new_tokens: int) -> list[int]:
    coord.add_request(
        GenerateRequest(rid, prompt, new_tokens, SamplingParams(0.0), ignore_eos=True)
    )
    tokens: list[int] = []
    while coord.has_work():
        for update in coord.step():
            tokens += update.output.new_token_ids
    coord.step()
    return tokens


@pytest.mark.timeout(120)
def test_gemma3_chunked_prefill_and_prefix_hit_match_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt chunks of 16 tokens (each starting mid-sequence, inside an earlier window),
    then a prompt sharing a 32-token prefix served from the cache: the kernel runs every
    prefill (sliding and global layers, starts > 0) and the tokens match transformers."""
    assert build_and_load()
    seen: list[tuple[int | None, int]] = []  # (window, largest start) of each kernel call
    fused = CpuBackend.prefill_attention

    def counted(
        self: CpuBackend,
        q: torch.Tensor,
        pool: KVPool,
        meta: PrefillMeta,
        scale: float,
        out: torch.Tensor,
        softcap: float | None = None,
    ) -> None:
        assert softcap is None
        seen.append((meta.window, max(meta.start_positions_list)))
        fused(self, q, pool, meta, scale, out, softcap)

    monkeypatch.setattr(CpuBackend, "prefill_attention", counted)
    checkpoint = gemma3.build(tmp_path / "gemma3")
    replica = ReplicaConfig(
        str(checkpoint), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=4
    )
    cfg = ModelConfig.from_dir(checkpoint)
    worker = Worker.build(replica, cfg, Comm(single_process_state()), 128)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
    prompt = [(11 * i) % 400 + 5 for i in range(37)]
    second = [*prompt[:32], 9, 8, 7]
    got = [_greedy(coord, "a", prompt, 8), _greedy(coord, "b", second, 8)]
    assert coord.stats.prefix_cache_hit_tokens >= 28
    coord.shutdown()
    assert got == [hf_greedy(checkpoint, prompt, 8), hf_greedy(checkpoint, second, 8)]
    assert {w for w, s in seen if s > 0} == {None, gemma3.WINDOW}, seen
