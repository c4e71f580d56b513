"""The Triton paged attention kernels against the reference backend, in Triton's
interpreter when no GPU is present: decode (single pass and split-K) and varlen prefill,
GQA ratios 1, 3 and 8, head dims 16/64/80/128, block sizes 4 and 16, contexts on and just
past block boundaries, padding rows, float32/bfloat16/float16, and batch invariance."""

from __future__ import annotations

import pytest
import torch

from model_shards.backends.base import DecodeMeta, KVPool, PrefillMeta
from model_shards.backends.cuda.triton_ops.attention_decode import choose_split, decode_attention
from model_shards.backends.cuda.triton_ops.attention_prefill import prefill_attention
from model_shards.backends.reference import ReferenceBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
SCALE = 0.3


pytestmark = pytest.mark.usefixtures("one_thread")


def _reference_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    bs: int,
    scale: float,
) -> torch.Tensor:
    """The reference backend's decode attention, called with the kernels' flat arguments."""
    pool, meta = KVPool(k_pool, v_pool, bs), DecodeMeta(tables, lens)
    return ReferenceBackend().decode_attention(q, pool, meta, scale)


def _reference_prefill(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: PrefillMeta,
    scale: float,
    out: torch.Tensor,
) -> None:
    pool = KVPool(k_pool, v_pool, meta.block_size)
    ReferenceBackend().prefill_attention(q, pool, meta, scale, out)


def _pools(
    slots: int, nkv: int, d: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(slots, nkv, d, generator=gen).to(DEVICE, dtype)  # [slots, nkv, D]
    v = torch.randn(slots, nkv, d, generator=gen).to(DEVICE, dtype)
    return k, v


def _tables(rows: int, nblk: int, spare: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Random distinct block ids ``[rows, nblk]`` out of ``rows * nblk + spare`` blocks."""
    num_blocks = rows * nblk + spare
    ids = torch.randperm(num_blocks, generator=gen)[: rows * nblk]
    return ids.view(rows, nblk).to(DEVICE), num_blocks


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


DECODE_CASES = [
    # nh, nkv, D, block_size, dtype, split_kv, table dtype
    (3, 3, 16, 4, torch.float32, None, torch.int64),
    (9, 3, 64, 16, torch.float32, None, torch.int32),
    (8, 1, 64, 4, torch.float32, 8, torch.int64),
    (9, 3, 128, 16, torch.bfloat16, None, torch.int64),
    (8, 1, 16, 16, torch.bfloat16, 8, torch.int32),
    (3, 3, 80, 4, torch.float32, 8, torch.int64),
    (9, 3, 64, 4, torch.float16, 8, torch.int64),
]


@pytest.mark.parametrize(("nh", "nkv", "d", "bs", "dtype", "split", "table_dtype"), DECODE_CASES)
def test_decode_matches_reference(
    nh: int,
    nkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    split: int | None,
    table_dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(nh * 1000 + d * 10 + bs)
    # on a block boundary, just past one, padding, one token, several tiles/partitions
    lens = [2 * bs, 2 * bs + 1, 0, 1, 140]
    nblk = -(-max(lens) // bs)
    tables, num_blocks = _tables(len(lens), nblk, 3, gen)
    k_pool, v_pool = _pools(num_blocks * bs, nkv, d, dtype, gen)
    qkv = torch.randn(len(lens), nh + 2 * nkv, d, generator=gen).to(DEVICE, dtype)
    q = qkv[:, :nh]  # [B, nh, D], a strided view as rotary_and_cache returns it
    context_lens = torch.tensor(lens, device=DEVICE)
    got = decode_attention(
        q, k_pool, v_pool, tables.to(table_dtype), context_lens, bs, SCALE, split_kv=split
    )
    want = _reference_decode(q, k_pool, v_pool, tables, context_lens, bs, SCALE)
    _close(got, want, dtype)
    assert torch.all(got[2] == 0), "a padding row answers zeros"


def test_decode_split_is_batch_independent_and_invariant_mode_never_splits() -> None:
    """Alone, a 1100-token row takes the automatic split; in a batch of 16 rows x 8 KV
    heads it does not. With ``batch_invariant=True`` its bits are the same both ways."""
    gen = torch.Generator().manual_seed(7)
    nh, nkv, d, bs = 16, 8, 16, 16
    lens = [1100] + [1 + 3 * i for i in range(15)]
    nblk = -(-max(lens) // bs)
    tables, num_blocks = _tables(len(lens), nblk, 0, gen)
    k_pool, v_pool = _pools(num_blocks * bs, nkv, d, torch.float32, gen)
    q = torch.randn(len(lens), nh, d, generator=gen).to(DEVICE)  # [B, nh, D]
    ctx = torch.tensor(lens, device=DEVICE)
    bound = nblk * bs
    assert choose_split(1, nkv, bound, None, batch_invariant=False) is not None
    assert choose_split(len(lens), nkv, bound, None, batch_invariant=False) is None
    assert choose_split(1, nkv, bound, None, batch_invariant=True) is None

    alone = decode_attention(q[:1], k_pool, v_pool, tables[:1], ctx[:1], bs, SCALE)  # split
    want = _reference_decode(q, k_pool, v_pool, tables, ctx, bs, SCALE)
    _close(alone, want[:1], torch.float32)
    alone_inv = decode_attention(
        q[:1], k_pool, v_pool, tables[:1], ctx[:1], bs, SCALE, batch_invariant=True
    )
    batch_inv = decode_attention(
        q, k_pool, v_pool, tables, ctx, bs, SCALE, batch_invariant=True, max_context_len=1100
    )
    _close(batch_inv, want, torch.float32)
    assert torch.equal(alone_inv[0], batch_inv[0])


def test_decode_rejects_bad_arguments() -> None:
    q = torch.zeros(1, 4, 16, device=DEVICE)
    pool = torch.zeros(8, 3, 16, device=DEVICE)
    one = torch.ones(1, dtype=torch.int64, device=DEVICE)
    tables = torch.zeros(1, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of"):
        decode_attention(q, pool, pool, tables, one, 4, SCALE)
    with pytest.raises(ValueError, match="exclude each other"):
        choose_split(1, 1, 4096, 8, batch_invariant=True)
    with pytest.raises(ValueError, match="positive"):
        choose_split(1, 1, 4096, 0, batch_invariant=False)


def _prefill_meta(
    lens: list[int], starts: list[int], bs: int, gap: int, gen: torch.Generator
) -> tuple[PrefillMeta, int, int]:
    """Chunks packed with ``gap`` untouched rows before each → (meta, rows T, blocks)."""
    q_starts, row = [], 0
    for length in lens:
        row += gap
        q_starts.append(row)
        row += length
    nblk = -(-max(s + n for s, n in zip(starts, lens, strict=True)) // bs)
    tables, num_blocks = _tables(len(lens), nblk, 2, gen)
    meta = PrefillMeta(
        q_starts=torch.tensor(q_starts, device=DEVICE),
        q_lens=torch.tensor(lens, device=DEVICE),
        start_positions=torch.tensor(starts, device=DEVICE),
        block_tables=tables,
        q_starts_list=q_starts,
        q_lens_list=list(lens),
        start_positions_list=list(starts),
        block_size=bs,
    )
    return meta, row + gap, num_blocks


PREFILL_CASES = [
    # nh, nkv, D, block_size, dtype, chunk lengths, start positions (0: fresh, > 0: cached)
    (3, 3, 16, 4, torch.float32, [1, 7, 20, 3, 12], [0, 5, 0, 13, 16]),
    (9, 3, 64, 16, torch.float32, [1, 7, 20, 3, 12], [0, 5, 0, 13, 16]),
    (8, 1, 128, 4, torch.bfloat16, [4, 17, 1], [8, 0, 33]),
    (9, 3, 80, 16, torch.float32, [70, 2], [9, 0]),  # two query tiles; an empty one
    (8, 1, 64, 16, torch.float16, [5, 16], [11, 0]),
]


@pytest.mark.parametrize(("nh", "nkv", "d", "bs", "dtype", "lens", "starts"), PREFILL_CASES)
def test_prefill_matches_reference(
    nh: int, nkv: int, d: int, bs: int, dtype: torch.dtype, lens: list[int], starts: list[int]
) -> None:
    gen = torch.Generator().manual_seed(nh * 1000 + d * 10 + bs + len(lens))
    meta, rows, num_blocks = _prefill_meta(lens, starts, bs, 2, gen)
    k_pool, v_pool = _pools(num_blocks * bs, nkv, d, dtype, gen)
    q = torch.randn(rows, nh, d, generator=gen).to(DEVICE, dtype)  # [T, nh, D]
    before = torch.randn(rows, nh, d, generator=gen).to(DEVICE, dtype)
    got, want = before.clone(), before.clone()
    prefill_attention(q, k_pool, v_pool, meta, SCALE, got)
    _reference_prefill(q, k_pool, v_pool, meta, SCALE, want)
    _close(got, want, dtype)
    chunk_rows = torch.zeros(rows, dtype=torch.bool)
    for row, length in zip(meta.q_starts_list, meta.q_lens_list, strict=True):
        chunk_rows[row : row + length] = True
    untouched = (~chunk_rows).nonzero().squeeze(1).to(DEVICE)
    assert untouched.numel() > 0
    assert torch.equal(got[untouched], before[untouched]), "rows outside the chunks changed"


def test_prefill_without_chunks_is_a_no_op() -> None:
    gen = torch.Generator().manual_seed(3)
    meta, _, num_blocks = _prefill_meta([1], [0], 4, 0, gen)
    meta.q_lens_list, meta.q_starts_list, meta.start_positions_list = [], [], []
    k_pool, v_pool = _pools(num_blocks * 4, 1, 16, torch.float32, gen)
    out = torch.randn(3, 2, 16, generator=gen).to(DEVICE)
    before = out.clone()
    prefill_attention(out.clone(), k_pool, v_pool, meta, SCALE, out)
    assert torch.equal(out, before)


@pytest.mark.parametrize(("window", "softcap"), [(6, None), (None, 2.0), (5, 1.5)])
def test_decode_window_and_softcap_match_reference(
    window: int | None, softcap: float | None
) -> None:
    """Gemma's attention: a sliding window (only the last ``window`` positions, the table's
    earlier entries garbage) and soft-capped scores, against the reference backend."""
    gen = torch.Generator().manual_seed(11)
    nh, nkv, d, bs = 4, 2, 32, 4
    lens = [3, 9, 17, 0, 70]
    nblk = -(-max(lens) // bs)
    tables, num_blocks = _tables(len(lens), nblk, 2, gen)
    k_pool, v_pool = _pools(num_blocks * bs, nkv, d, torch.float32, gen)
    q = torch.randn(len(lens), nh, d, generator=gen).to(DEVICE)  # [B, nh, D]
    ctx = torch.tensor(lens, device=DEVICE)
    got = decode_attention(
        q, k_pool, v_pool, tables, ctx, bs, SCALE * 4, window=window, softcap=softcap
    )
    pool, meta = KVPool(k_pool, v_pool, bs), DecodeMeta(tables, ctx, window=window)
    want = ReferenceBackend().decode_attention(q, pool, meta, SCALE * 4, softcap)
    _close(got, want, torch.float32)
    plain = ReferenceBackend().decode_attention(q, pool, DecodeMeta(tables, ctx), SCALE * 4)
    assert not torch.allclose(got, plain, atol=1e-3), "the window/cap was meant to matter"


@pytest.mark.parametrize(("window", "softcap"), [(6, None), (None, 2.0), (5, 1.5)])
def test_prefill_window_and_softcap_match_reference(
    window: int | None, softcap: float | None
) -> None:
    gen = torch.Generator().manual_seed(12)
    nh, nkv, d, bs = 4, 2, 32, 4
    meta, rows, num_blocks = _prefill_meta([1, 9, 70, 3], [0, 5, 0, 13], bs, 1, gen)
    meta.window = window
    k_pool, v_pool = _pools(num_blocks * bs, nkv, d, torch.float32, gen)
    q = torch.randn(rows, nh, d, generator=gen).to(DEVICE)  # [T, nh, D]
    got, want = torch.zeros_like(q), torch.zeros_like(q)
    prefill_attention(q, k_pool, v_pool, meta, SCALE * 4, got, softcap)
    pool = KVPool(k_pool, v_pool, bs)
    ReferenceBackend().prefill_attention(q, pool, meta, SCALE * 4, want, softcap)
    _close(got, want, torch.float32)
