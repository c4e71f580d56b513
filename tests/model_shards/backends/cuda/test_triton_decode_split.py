"""Decode attention's split from the step's longest context and the SM count: the single
pass at short contexts and full batches, as many partitions as fill the SMs otherwise, the
context bounds decode graphs are captured at, and the automatic split against the reference
in Triton's interpreter (under a graph's larger static bound too)."""

from __future__ import annotations

import pytest
import torch

from model_shards.backends.cuda.backend import CudaBackend
from model_shards.backends.cuda.triton_ops.attention_decode import (
    choose_split,
    decode_attention,
    graph_context_bounds,
)
from tests.model_shards.backends.cuda.test_triton_attention import (
    DEVICE,
    SCALE,
    _close,
    _pools,
    _reference_decode,
    _tables,
)


def test_split_follows_the_longest_context_and_the_sms() -> None:
    assert choose_split(1, 8, 1024, None, False) is None  # short: one pass
    assert choose_split(1, 8, 4096, None, False, num_sms=132) == 256  # 16 parts x 8 heads
    assert choose_split(8, 8, 4096, None, False, num_sms=132) == 2048  # 2 parts x 64
    assert choose_split(16, 8, 4096, None, False, num_sms=132) is None  # 128 programs: full
    assert choose_split(16, 8, 4096, None, False, num_sms=264) == 2048
    assert choose_split(1, 1, 1100, None, False, num_sms=132) == 256  # 5 parts of >= 256
    assert choose_split(1, 8, 4096, None, True) is None  # batch-invariant: one pass


def test_graph_context_bounds_only_where_attention_splits() -> None:
    backend = CudaBackend()
    assert graph_context_bounds(1, 8, 8192, False) == [1024, 4096, 8192]
    assert backend.decode_context_bounds(1, 8, 8192) == [1024, 4096, 8192]
    assert graph_context_bounds(1, 8, 20000, False) == [1024, 4096, 16384, 20000]
    assert graph_context_bounds(16, 8, 8192, False) == [8192]  # no split at 16 x 8
    assert graph_context_bounds(1, 8, 1024, False) == [1024]  # never long enough
    assert graph_context_bounds(1, 8, 8192, True) == [8192]


@pytest.mark.parametrize("bound", [None, 4096])
def test_automatic_split_equals_the_reference(one_thread: None, bound: int | None) -> None:
    """Two rows x two KV heads on 8 SMs: two partitions of the longest context (or of a
    graph's bound of 4096: partitions past a row's context are empty)."""
    gen = torch.Generator().manual_seed(3)
    nh, nkv, d, bs = 4, 2, 16, 16
    lens = [1300, 700]
    nblk = -(-max(lens) // bs)
    tables, num_blocks = _tables(len(lens), nblk, 1, gen)
    k_pool, v_pool = _pools(num_blocks * bs, nkv, d, torch.float32, gen)
    q = torch.randn(len(lens), nh, d, generator=gen).to(DEVICE)  # [B, nh, D]
    ctx = torch.tensor(lens, device=DEVICE)
    longest = bound or max(lens)
    assert choose_split(len(lens), nkv, longest, None, False, num_sms=8) is not None
    got = decode_attention(
        q, k_pool, v_pool, tables, ctx, bs, SCALE, max_context_len=longest, num_sms=8
    )
    _close(got, _reference_decode(q, k_pool, v_pool, tables, ctx, bs, SCALE), torch.float32)
