"""PEFT-format LoRA adapters written directly (no peft): for the checks of a bad adapter and
for frontends that only read an adapter's files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

#: The shape of :func:`tests.server.conftest.write_tiny_model_config`: hidden 64, 4 heads and
#: 2 KV heads of 16, intermediate 128, 2 layers (in, out of each module).
TINY_SHAPES = {
    "q_proj": (64, 64),
    "k_proj": (64, 32),
    "v_proj": (64, 32),
    "o_proj": (64, 64),
    "gate_proj": (64, 128),
    "up_proj": (64, 128),
    "down_proj": (128, 64),
}


def write_raw_adapter(
    out: Path,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    *,
    r: int = 4,
    layers: int = 2,
    shapes: dict[str, tuple[int, int]] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """An adapter of ``r`` for ``targets`` of every layer, shaped for ``shapes`` (default the
    tiny config's); ``config`` overrides fields of ``adapter_config.json``."""
    shapes = shapes or TINY_SHAPES
    tensors = {}
    for i in range(layers):
        for t in targets:
            n_in, n_out = shapes.get(t, (8, 8))
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.zeros(r, n_in)
            tensors[f"{key}.lora_B.weight"] = torch.zeros(n_out, r)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets)}
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return out
