"""FP8 (e4m3) weights with per-channel scales, and the activation quantization of W8A8: the
holder :class:`Fp8Weight` that compressed-tensors ``float-quantized`` checkpoints, FBGEMM FP8
checkpoints and ``--quantization fp8`` all load into, multiplied by ``Backend.fp8_linear``.

    W[n, k] = weight[n, k] · scale[n]         (a per-tensor scale is broadcast to every n)
    x̂[t, k] = fp8(x[t, k] / s[t]) · s[t],    s[t] = min(max_k |x[t, k]|, ub) / 448 (dynamic,
                                              per token; ``ub``: FBGEMM's activation_scale_ub,
                                              else none), or the static ``input_scale``
    y = x̂ W^T (+ bias)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@dataclass
class Fp8Weight:
    """``weight``: float8_e4m3fn ``[N, K]``; ``scale``: float32 ``[N]``; ``input_scale``:
    float32 scalar tensor (static activation scale) or ``None`` (dynamic per token);
    ``input_scale_ub``: the bound of a dynamic row's ``max |x|`` (FBGEMM), or ``None``."""

    weight: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None = None
    input_scale_ub: float | None = None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32."""
        return self.weight.float() * self.scale.float()[:, None]


def quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None, scale_ub: float | None = None
) -> torch.Tensor:
    """``x [T, K]`` → ``x̂ [T, K]`` float32 (above): the reference of the activation rounding
    every ``fp8_linear`` applies. A zero row stays zero."""
    xf = x.float()
    if input_scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)  # [T, 1]
        if scale_ub is not None:
            amax = amax.clamp(max=scale_ub)
        s = amax / FP8_MAX
        s = torch.where(s == 0, torch.ones_like(s), s)
    else:
        s = input_scale.float().reshape(1, 1)
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.float() * s


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """``w [N, K]`` float → :class:`Fp8Weight` with per-channel scales ``max_k |w[n, k]| / 448``
    (a zero row: scale 1), dynamic activations (``--quantization fp8``, as vLLM's)."""
    wf = w.float()
    scale = wf.abs().amax(dim=1) / FP8_MAX  # [N]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale)
