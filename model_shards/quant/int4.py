"""4-bit weight-only (W4A16) weights in groups along the input: AWQ, GPTQ and compressed-tensors
``pack-quantized`` checkpoints all unpack to one holder, :class:`Int4GroupWeight`, that layers
keep and backends multiply (``Backend.int4_linear``).

    W[n, k] = (q[n, k] - zero[n, g(k)]) · scale[n, g(k)],   g(k) = k // group_size, or g_idx[k]

``q`` is stored two values per byte along ``k`` (low nibble: even ``k``, high nibble: odd
``k``), whatever the checkpoint's own packing (AWQ's int32 words in its interleaved order,
GPTQ's int32 words along ``k``, compressed-tensors' int32 words along ``k``): the loaders
convert once at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int4GroupWeight:
    """``W [out_features, in_features]`` as 4-bit groups.

    ``qweight``: uint8 ``[N, K // 2]`` (nibbles as above); ``scales``: ``[N, K // group_size]``
    float (the checkpoint's dtype); ``zeros``: uint8 ``[N, K // group_size]`` in 0..15 (16 where
    a GPTQ v1 file stores 15 for ``zero - 1``, read as exllama and vLLM do), or ``None`` for
    symmetric weights (zero 8); ``g_idx``: int64 ``[K]`` each input column's
    group (GPTQ ``desc_act``), ``None`` for ``k // group_size``.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    g_idx: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * 2

    def unpack(self) -> torch.Tensor:
        """``q [N, K]`` uint8 in 0..15."""
        low, high = self.qweight & 0x0F, self.qweight >> 4
        return torch.stack([low, high], dim=-1).reshape(self.out_features, self.in_features)

    def groups(self) -> torch.Tensor:
        """int64 ``[K]``: each input column's group."""
        if self.g_idx is not None:
            return self.g_idx
        k = torch.arange(self.in_features, device=self.qweight.device)
        return k // self.group_size

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32: the reference every backend's ``int4_linear`` is held to."""
        g = self.groups()
        q = self.unpack().float()
        zero = torch.full_like(q, 8.0) if self.zeros is None else self.zeros.float()[:, g]
        return (q - zero) * self.scales.float()[:, g]
