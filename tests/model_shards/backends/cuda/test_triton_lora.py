"""The Triton multi-LoRA shrink/expand against :meth:`ReferenceBackend.add_lora`; on CPU in
Triton's interpreter. Rows of three slots and of the base model (slot -1) interleave, so the
reference takes both its contiguous and its gathered path."""

from __future__ import annotations

import pytest
import torch

from model_shards.backends.base import LoraBatch
from model_shards.backends.cuda.triton_ops.lora import add_lora
from model_shards.backends.reference import ReferenceBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = [0, 0, -1, 2, 2, 2, 1, -1, 0]  # slot 0 in two runs: gathered; 2 and 1: slices


def _batch(slots: list[int]) -> LoraBatch:
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for s in sorted(set(slots) - {-1}):
        rows = [i for i, x in enumerate(slots) if x == s]
        contiguous = rows == list(range(rows[0], rows[-1] + 1))
        index = torch.tensor(rows, device=DEVICE)
        groups.append((s, slice(rows[0], rows[-1] + 1) if contiguous else index))
    return LoraBatch(groups, torch.tensor(slots, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_lora_matches_the_reference(one_thread: None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    t, n_in, n_out, rank = len(SLOTS), 40, 72, 12  # none a power of two

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    x, y = rand(t, n_in), rand(t, n_out)
    a, b = rand(3, rank, n_in), rand(3, n_out, rank)
    batch = _batch(SLOTS)
    want = y.clone()
    ReferenceBackend().add_lora(want, x, a, b, batch)
    got = y.clone()
    add_lora(got, x, a, b, batch.row_slots)
    base = [i for i, s in enumerate(SLOTS) if s < 0]
    assert torch.equal(got[base], y[base])  # base-model rows untouched
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)
