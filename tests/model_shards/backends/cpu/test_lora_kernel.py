"""The cpu backend's multi-LoRA kernel (``kernels/lora.cpp``) against the reference backend's
``add_lora``: rows of three adapters and of the base model mixed, a fused layer's rank, float32
to rounding error and bfloat16 to a rounding step of the sum; base rows left bit for bit; a slot
past the adapters refused; a fused layer's adapters through :class:`LoraWeights` (``b`` stored
by rank, its zero blocks skipped); each row's result independent of the batch and threads."""

from __future__ import annotations

import pytest
import torch

from model_shards.backends import Backend, ReferenceBackend
from model_shards.backends.base import LoraBatch
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load
from model_shards.layers.lora import LoraState, LoraWeights

SLOTS, RANK, IN, OUT = 3, 48, 576, 960  # a fused q/k/v layer's three parts of rank 16
ROW_SLOTS = [2, -1, 0, 0, 1, -1, 2, 1, 0, 2, -1]
IN_TAIL, CPU = 37, torch.device("cpu")  # inputs off the 16-lane width


def _groups(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    found = [s for s in slots.unique().tolist() if s >= 0]
    return [(s, (slots == s).nonzero().flatten()) for s in found]


@pytest.fixture(scope="module")
def cpu() -> CpuBackend:
    assert build_and_load()
    return CpuBackend()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_lora_add_matches_the_reference(cpu: CpuBackend, dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(len(ROW_SLOTS), IN, generator=gen).to(dtype)
    a = (torch.randn(SLOTS, RANK, IN, generator=gen) * 0.05).to(dtype)
    b = (torch.randn(SLOTS, OUT, RANK, generator=gen) * 0.05).to(dtype)
    y0 = torch.randn(len(ROW_SLOTS), OUT, generator=gen).to(dtype)
    slots = torch.tensor(ROW_SLOTS)
    batch = LoraBatch(_groups(slots), slots)
    want, ours = y0.clone(), y0.clone()
    ReferenceBackend().add_lora(want, x, a, b, batch)
    cpu.add_lora(ours, x, a, b, batch)
    base = slots < 0
    assert torch.equal(ours[base], y0[base])
    delta = (want - y0).float()
    err = ((ours - want).float().abs().max() / delta.abs().max()).item()
    assert err < tol, f"{dtype}: relative error {err:.2e}"


def test_lora_add_refuses_a_slot_past_the_adapters(cpu: CpuBackend) -> None:
    x, y = torch.randn(1, IN), torch.zeros(1, OUT)
    a, b = torch.zeros(SLOTS, RANK, IN), torch.zeros(SLOTS, OUT, RANK)
    with pytest.raises(RuntimeError, match="names slot 3 of 3"):
        cpu.add_lora(y, x, a, b, LoraBatch(None, torch.tensor([SLOTS])))


def _fused(ops: Backend, dtype: torch.dtype, parts: list[tuple[int, int]]) -> LoraWeights:
    """A fused layer of ``IN_TAIL`` inputs with a part per ``(outputs, rank)``, rank 16 a part;
    slots 0 and 1 filled with the same random adapters whatever ``ops`` (slot 2 empty)."""
    gen = torch.Generator().manual_seed(3)
    out = sum(n for n, _ in parts)
    lora = LoraWeights(SLOTS, len(parts), 16, (IN_TAIL, out), LoraState(), ops, dtype, CPU)
    for slot in (0, 1):
        first = 0
        for part, (n, r) in enumerate(parts):
            a = torch.randn(r, IN_TAIL, generator=gen) * 0.1
            b = torch.randn(n, r, generator=gen) * 0.1
            lora.fill(slot, part, a.to(dtype), b.to(dtype), slice(first, first + n), 1.5)
            first += n
    return lora


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_fused_layer_by_rank_matches_the_reference(
    cpu: CpuBackend, dtype: torch.dtype, tol: float
) -> None:
    """Parts of unequal outputs and ranks (the zero blocks and ranks skipped through ``cols``),
    ``in`` and ``out`` off the vector widths, rows of an empty slot (2) left as they were."""
    parts = [(40, 16), (24, 5), (13, 16)]
    ours, ref = _fused(cpu, dtype, parts), _fused(ReferenceBackend(), dtype, parts)
    assert ours.b.stride(1) == 1 and torch.equal(ours.b, ref.b)  # [S, R, out] storage, viewed
    assert ours.cols[0, 16:21].tolist() == [[40, 64]] * 5 and not ours.cols[0, 21:32].any()
    slots = torch.tensor(ROW_SLOTS)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(len(ROW_SLOTS), IN_TAIL, generator=gen).to(dtype)
    y0 = torch.randn(len(ROW_SLOTS), 77, generator=gen).to(dtype)
    got, want = y0.clone(), y0.clone()
    ours.state.batch = ref.state.batch = LoraBatch(_groups(slots), slots)
    ours.add(x, got)
    ref.add(x, want)
    untouched = (slots < 0) | (slots == 2)
    assert torch.equal(got[untouched], y0[untouched])
    delta = (want - y0).float()
    err = ((got - want).float().abs().max() / delta.abs().max()).item()
    assert err < tol, f"{dtype}: relative error {err:.2e}"


def test_a_row_is_the_same_alone_and_on_more_threads(cpu: CpuBackend) -> None:
    """One adapter's rows with their outputs split between two threads, and one row alone:
    every row's result bit for bit the same (batch invariance)."""
    gen = torch.Generator().manual_seed(5)
    x, y0 = torch.randn(9, IN, generator=gen), torch.randn(9, OUT, generator=gen)
    a = torch.randn(SLOTS, RANK, IN, generator=gen) * 0.05
    b = torch.randn(SLOTS, OUT, RANK, generator=gen) * 0.05
    slots = torch.full((9,), 1)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = y0.clone()
            cpu.add_lora(y, x, a, b, LoraBatch(_groups(slots), slots))
            results.append(y)
    finally:
        torch.set_num_threads(threads)
    alone = y0[4:5].clone()
    cpu.add_lora(alone, x[4:5], a, b, LoraBatch(_groups(slots[:1]), slots[:1]))
    assert torch.equal(results[0], results[1]) and torch.equal(alone, results[0][4:5])
