"""The cpu backend's multi-LoRA kernel (``kernels/lora.cpp``) against the reference backend's
``add_lora``: rows of three adapters and of the base model mixed, a fused layer's rank, float32
to rounding error and bfloat16 to a rounding step of the sum; base rows left bit for bit; a slot
past the adapters refused."""

from __future__ import annotations

import pytest
import torch

from model_shards.backends import ReferenceBackend
from model_shards.backends.base import LoraBatch
from model_shards.backends.cpu.backend import CpuBackend
from model_shards.backends.cpu.build import build_and_load

SLOTS, RANK, IN, OUT = 3, 48, 576, 960  # a fused q/k/v layer's three parts of rank 16
ROW_SLOTS = [2, -1, 0, 0, 1, -1, 2, 1, 0, 2, -1]


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
