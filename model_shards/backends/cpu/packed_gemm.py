"""What ``CpuBackend.pack_linear`` gives a dense weight: its layout for one of two GEMMs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedGemm:
    """A weight reordered for one of the two packed GEMMs."""

    data: torch.Tensor
    out_features: int  # > 0: our own GEMM's panels (kernels/gemm.cpp); 0: oneDNN's blocked layout
