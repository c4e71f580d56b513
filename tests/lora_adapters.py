"""Random PEFT LoRA adapters for the tiny test checkpoints, and transformers + peft as their
reference.

:func:`write_adapter` wraps the base model with peft's ``get_peft_model`` and saves the adapter
(``adapter_config.json`` + ``adapter_model.safetensors``) after redrawing every LoRA matrix
(``N(0, std)``, B included, so the adapter changes the outputs); :func:`peft_greedy` decodes
greedily with the base model and that adapter.
"""

from __future__ import annotations

from pathlib import Path

import peft
import torch

from tests.checkpoints import load_hf_model


def write_adapter(
    base: Path,
    out: Path,
    targets: list[str],
    *,
    r: int,
    alpha: int,
    rslora: bool = False,
    seed: int = 0,
    std: float = 0.2,
) -> Path:
    """A random LoRA adapter of ``base`` (an HF checkpoint directory) saved into ``out``."""
    model = load_hf_model(base)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0
    )
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(wrapped.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.empty(param.shape).normal_(0.0, std, generator=gen))
    wrapped.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt`` from ``base`` with ``adapter`` (or none),
    re-running the whole sequence each step (no KV cache)."""
    model = load_hf_model(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids], dtype=torch.long)).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]
