"""Quantized checkpoints of the tiny Llama (``tests/checkpoints.py``), written the way AWQ, GPTQ,
compressed-tensors and FBGEMM write theirs, and the dense copy of the values they hold.

Every matrix of the decoder layers is quantized (the embedding and the LM head stay dense, as
``ignore: [lm_head]`` / ``modules_to_not_convert`` leave them). The packers here are written
from each format's documented layout with explicit bit operations on numpy words, independent of
``model_shards``' unpacking:

* AWQ ``qweight [K, N/8]``: word ``j`` of row ``k`` holds columns ``8j + AWQ[i]`` in bits
  ``4i..4i+3``, ``AWQ = [0, 2, 4, 6, 1, 3, 5, 7]``; ``qzeros [K/G, N/8]`` the same;
  ``scales [K/G, N]``.
* GPTQ ``qweight [K/8, N]``: word ``j`` of column ``n`` holds inputs ``8j + i``; ``qzeros
  [K/G, N/8]`` packed along N (``gptq``: ``z - 1``; ``gptq_v2``: ``z``); ``g_idx [K]``.
* compressed-tensors ``weight_packed [N, K/8]`` of ``q_signed + 8`` along K, ``weight_scale
  [N, K/G]``, ``weight_zero_point [N/8, K/G]`` of ``z_signed + 8`` along N, ``weight_shape``.
* FP8: ``weight`` e4m3 ``[N, K]``, ``weight_scale [N, 1]`` (channel) or ``[1]`` (tensor),
  ``input_scale [1]`` (static).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Spec:
    """One checkpoint format: its ``quantization_config`` and how its tensors are made."""

    layout: str  # awq | gptq | ct-int4 | ct-fp8 | fbgemm
    config: dict[str, Any]
    group_size: int = 32
    symmetric: bool = True
    act_order: bool = False
    static_input: bool = False
    per_tensor: bool = False


def _ct_int4(group: int, symmetric: bool) -> dict[str, Any]:
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group"}
    weights |= {"group_size": group, "dynamic": False, "actorder": None}
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": scheme},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }


def _ct_fp8(static: bool) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    weights["strategy"] = "tensor" if static else "channel"
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static}
    inputs["strategy"] = "tensor" if static else "token"
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": scheme},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }


SPECS: dict[str, Spec] = {
    "awq": Spec(
        "awq",
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 32,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        },
        symmetric=False,
    ),
    "gptq": Spec(
        "gptq",
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 32,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        },
    ),
    "gptq-actorder": Spec(
        "gptq",
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 16,
            "desc_act": True,
            "sym": False,
            "checkpoint_format": "gptq_v2",
        },
        group_size=16,
        symmetric=False,
        act_order=True,
    ),
    "ct-w4a16": Spec("ct-int4", _ct_int4(32, True)),
    "ct-w4a16-asym": Spec("ct-int4", _ct_int4(32, False), symmetric=False),
    "ct-fp8-dynamic": Spec("ct-fp8", _ct_fp8(static=False)),
    "ct-fp8-static": Spec("ct-fp8", _ct_fp8(static=True), static_input=True, per_tensor=True),
    "fbgemm-fp8": Spec(
        "fbgemm",
        {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": ["lm_head"],
        },
    ),
}


def pack_words(values: np.ndarray, axis: int, order: list[int] | None = None) -> np.ndarray:
    """uint 0..15 ``values`` (2-D) → int32 words, eight values per word along ``axis``: value
    ``8j + order[i]`` (``order`` default: ``i``) in bits ``4i .. 4i + 3`` of word ``j``."""
    v = values.astype(np.uint32)
    if axis == 0:
        v = v.T
    rows, cols = v.shape
    out = np.zeros((rows, cols // 8), dtype=np.uint32)
    order = order or list(range(8))
    for j in range(cols // 8):
        for i in range(8):
            out[:, j] |= v[:, 8 * j + order[i]] << np.uint32(4 * i)
    out = out.view(np.int32)
    return np.ascontiguousarray(out.T if axis == 0 else out)


def quantize_int4(
    w: torch.Tensor, spec: Spec, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` → ``q [N, K]`` (0..15), fp16 ``scales [N, groups]``, ``zeros [N, groups]``
    (1..15; 8 when symmetric), ``g_idx [K]`` (a random permutation's groups with act-order)."""
    n, k = w.shape
    g = spec.group_size
    if spec.act_order:  # GPTQ desc_act: inputs quantized in a permuted order, g per group
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // g
    else:
        g_idx = torch.arange(k) // g
    groups = k // g
    scales = torch.empty(n, groups)
    zeros = torch.full((n, groups), 8, dtype=torch.int64)
    for j in range(groups):
        cols = w[:, g_idx == j]
        if spec.symmetric:
            scales[:, j] = cols.abs().amax(1) / 7
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, j] = (hi - lo) / 14
            zeros[:, j] = (-lo / scales[:, j]).round().clamp(1, 15).long()
    scales = scales.to(torch.float16)
    s, z = scales.float()[:, g_idx], zeros[:, g_idx]
    q = ((w / s).round() + z).clamp(0, 15).long()
    return q, scales, zeros, g_idx


def dequantize_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    return (q - zeros[:, g_idx]).float() * scales.float()[:, g_idx]


Made = tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]


def as_q4_1(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``W`` as GGML Q4_1 blocks of it hold it: ``d q + m`` in float32, ``d = scale``, ``m`` the
    float16 of ``-zero · scale`` (groups ``k // group_size``)."""
    per = q.shape[1] // scales.shape[1]
    d = scales.float().repeat_interleave(per, dim=1)
    m = (-zeros.float().repeat_interleave(per, dim=1) * d).to(torch.float16).float()
    return d * q.float() + m


def int4_tensors(name: str, w: torch.Tensor, spec: Spec, gen: torch.Generator) -> Made:
    """The stored tensors of ``name`` (``P.weight``) in ``spec``'s layout, ``W`` as they hold
    it (float32), and ``W`` as Q4_1 blocks hold it (asymmetric, no act-order; else ``W``)."""
    p = name.removesuffix(".weight")
    q, scales, zeros, g_idx = quantize_int4(w.float(), spec, gen)
    qn, zn = q.numpy(), zeros.numpy()
    t = torch.from_numpy
    if spec.layout == "awq":
        out = {
            f"{p}.qweight": t(pack_words(qn.T, 1, AWQ_ORDER)),
            f"{p}.qzeros": t(pack_words(zn.T, 1, AWQ_ORDER)),
            f"{p}.scales": scales.t().contiguous(),
        }
    elif spec.layout == "gptq":
        v2 = spec.config.get("checkpoint_format") == "gptq_v2"
        out = {
            f"{p}.qweight": t(pack_words(qn.T, 0)),
            f"{p}.qzeros": t(pack_words(zn.T - (0 if v2 else 1), 1)),
            f"{p}.scales": scales.t().contiguous(),
            f"{p}.g_idx": g_idx.to(torch.int32),
        }
    else:
        out = {
            f"{p}.weight_packed": t(pack_words(qn, 1)),
            f"{p}.weight_scale": scales,
            f"{p}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
        }
        if not spec.symmetric:
            out[f"{p}.weight_zero_point"] = t(pack_words(zn, 0))
    held = dequantize_int4(q, scales, zeros, g_idx)
    blocks = held if spec.symmetric or spec.act_order else as_q4_1(q, scales, zeros)
    return out, held, blocks


def fp8_tensors(name: str, w: torch.Tensor, spec: Spec, gen: torch.Generator) -> Made:
    """The FP8 tensors of ``name`` and ``W`` as they hold it (float32, twice: as
    :func:`int4_tensors`)."""
    p, wf = name.removesuffix(".weight"), w.float()
    if spec.per_tensor:
        scale = (wf.abs().amax() / 448).reshape(1)
    else:
        scale = wf.abs().amax(1, keepdim=True) / 448  # [N, 1]
    q = (wf / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = {name: q, f"{p}.weight_scale": scale.float()}
    if spec.static_input:
        out[f"{p}.input_scale"] = (torch.rand(1, generator=gen) * 0.01 + 0.02).float()
    held = q.float() * scale
    return out, held, held


def write_quantized(dense_dir: Path, spec_name: str, out: Path, ref: Path, blocks: Path) -> None:
    """``dense_dir`` (one ``model.safetensors``) in ``spec_name``'s format at ``out``; the dense
    values it holds at ``ref`` (same config, no ``quantization_config``), for transformers, and
    at ``blocks`` as Q4_1 blocks hold them (:func:`as_q4_1`; else the same values). Both get
    ``input_scales.json`` (static FP8: each module's activation scale)."""
    spec = SPECS[spec_name]
    gen = torch.Generator().manual_seed(7)
    tensors = load_file(str(dense_dir / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    as_blocks: dict[str, torch.Tensor] = {}
    input_scales: dict[str, float] = {}
    for name, w in sorted(tensors.items()):
        if not (name.endswith(".weight") and any(f".{x}." in name for x in LINEARS)):
            stored[name] = dense[name] = as_blocks[name] = w
            continue
        make = fp8_tensors if spec.layout in ("ct-fp8", "fbgemm") else int4_tensors
        parts, held, in_blocks = make(name, w, spec, gen)
        stored |= parts
        dense[name], as_blocks[name] = held.to(w.dtype), in_blocks.to(w.dtype)
        scale = parts.get(name.removesuffix("weight") + "input_scale")
        if scale is not None:
            input_scales[name.removesuffix(".weight")] = float(scale)
    for directory, data in ((out, stored), (ref, dense), (blocks, as_blocks)):
        shutil.copytree(dense_dir, directory)
        (directory / "model.safetensors").unlink()
        save_file(data, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = spec.config
    (out / "config.json").write_text(json.dumps(config))
    for directory in (ref, blocks):
        (directory / "input_scales.json").write_text(json.dumps(input_scales))
