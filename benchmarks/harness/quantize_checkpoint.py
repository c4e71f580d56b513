"""A dense checkpoint's decoder linears written in a quantized checkpoint format, from the
formats' documented layouts (the bench's own quantizer: round to nearest, no calibration).

* ``fp8``: compressed-tensors ``float-quantized`` (llm-compressor's ``FP8_DYNAMIC``): ``weight``
  float8_e4m3fn ``[N, K]`` = ``W / s`` with ``weight_scale [N, 1]`` float32,
  ``s = max|W_n| / 448`` per output channel; activations dynamic per token.
* ``awq``: AutoAWQ's GEMM packing, 4 bits, asymmetric groups of ``group_size`` inputs:
  ``scales [K/G, N]`` float16 ``(max - min) / 15``, zero ``z = round(-min / s)`` in 0..15,
  ``q = clamp(round(W / s) + z, 0, 15)``; ``qweight [K, N/8]`` and ``qzeros [K/G, N/8]`` int32,
  nibble ``i`` of word ``j`` (bits ``4i .. 4i + 3``) = column ``8j + [0, 2, 4, 6, 1, 3, 5, 7][i]``.

Embeddings, norms and the LM head stay dense (``ignore: [lm_head]``). ``main`` writes one:
``python -m benchmarks harness quantize_checkpoint DENSE OUT --format awq``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FORMATS = ("fp8", "awq")


def quantization_config(fmt: str, group_size: int) -> dict[str, Any]:
    """The ``quantization_config`` of ``config.json`` for ``fmt``."""
    if fmt == "awq":
        awq = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True}
        return awq | {"version": "gemm", "modules_to_not_convert": None}
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    inputs = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True}
    scheme = {
        "targets": ["Linear"],
        "weights": weights | {"dynamic": False},
        "input_activations": inputs | {"dynamic": True},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": scheme},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }


def fp8_tensors(prefix: str, w: Any) -> dict[str, Any]:
    """``w [N, K]`` → ``{prefix.weight, prefix.weight_scale}`` (module docstring)."""
    import torch

    wf = w.float()
    scale = wf.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (wf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale}


def pack_awq(values: Any) -> Any:
    """uint 0..15 ``[R, C]`` (C a multiple of 8) → int32 ``[R, C/8]`` in AWQ's nibble order."""
    import torch

    v = values.to(torch.int64).view(values.shape[0], -1, 8)  # [R, C/8, 8]
    words = torch.zeros(v.shape[:2], dtype=torch.int64, device=v.device)
    for i, column in enumerate(AWQ_ORDER):
        words |= v[:, :, column] << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_tensors(prefix: str, w: Any, group_size: int) -> dict[str, Any]:
    """``w [N, K]`` → ``{prefix.qweight, prefix.qzeros, prefix.scales}`` (module docstring)."""
    import torch

    n, k = w.shape
    if k % group_size or n % 8:
        raise ValueError(f"{prefix}: [{n}, {k}] does not split into groups of {group_size}")
    g = w.float().view(n, k // group_size, group_size)  # [N, K/G, G]
    lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)  # [N, K/G]
    scales = ((hi - lo) / 15).clamp(min=1e-6).to(torch.float16)
    s = scales.float()
    zeros = (-lo / s).round().clamp(0, 15)
    q = ((g / s[..., None]).round() + zeros[..., None]).clamp(0, 15).view(n, k)
    return {
        f"{prefix}.qweight": pack_awq(q.t().contiguous()),  # [K, N/8]
        f"{prefix}.qzeros": pack_awq(zeros.t().contiguous()),  # [K/G, N/8]
        f"{prefix}.scales": scales.t().contiguous(),  # [K/G, N]
    }


def write_quantized(dense: Path, out: Path, fmt: str, group_size: int = 64) -> Path:
    """``dense`` (one ``model.safetensors``) with its decoder linears in ``fmt`` at ``out``."""
    from safetensors.torch import load_file, save_file

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose one of {FORMATS}")
    tensors = load_file(str(dense / "model.safetensors"))
    stored: dict[str, Any] = {}
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight") or prefix.rpartition(".")[2] not in LINEARS:
            stored[name] = w
        elif fmt == "fp8":
            stored |= fp8_tensors(prefix, w)
        else:
            stored |= awq_tensors(prefix, w, group_size)
    out.mkdir(parents=True, exist_ok=True)
    for item in dense.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy2(item, out / item.name)
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group_size)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("dense", type=Path, help="a checkpoint directory (model.safetensors)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--group-size", type=int, default=64, help="AWQ: inputs per group")
    args = parser.parse_args(argv)
    write_quantized(args.dense, args.out, args.format, args.group_size)
    return 0
