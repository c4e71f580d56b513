"""The benchmark checkpoint: a ~135M-parameter Llama with random weights, built once.

Three variants share every size; two differ in the attention head split, one in family:

- ``main``: 9 query / 3 key-value heads of 64 (SmolLM-135M's shape). 9 heads admit
  only tensor-parallel sizes 1, 3 and 9, so ``-tp 2`` cannot serve it;
- ``tp2``: 12 query / 4 key-value heads of 48. The projections keep their shapes
  (576 → 576 for q/o, 576 → 192 for k/v), so parameters and FLOPs per token are the
  same; only the attention split differs. Used for the tp=2 vs tp=1 rows;
- ``qwen3``: ``main``'s sizes as a ``Qwen3ForCausalLM`` (per-head q/k RMSNorm before
  RoPE); the family row of ``make bench``.

Checkpoints are written into ``benchmarks/.cache/<variant>`` (temp dir + rename),
with the built-in byte-level BPE tokenizer (1024 tokens). The tied embedding rows of
ids ≥ 1024 and of the 256 single-byte tokens are zero: with random weights greedy
decoding would otherwise pick ids the tokenizer cannot decode, or loop on a byte that
is not valid UTF-8 alone, and a server would stream usage but no text. The LM head
still multiplies all 49152 rows, so the work per token is unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from benchmarks.harness.paths import CACHE
from benchmarks.harness.whole_dir import write_whole

Variant = Literal["main", "tp2", "qwen3"]
VERSION = "v3"  # bump when the bytes change
SEED = 0
BYTE_TOKENS = slice(2, 2 + 256)
"""Ids of the tokenizer's single-byte symbols (after ``<s>`` and ``</s>``)."""


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int = 576
    layers: int = 30
    heads: int = 9
    kv_heads: int = 3
    intermediate: int = 1536
    vocab: int = 49152
    max_positions: int = 2048
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k (2 x head_dim weights a layer)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def matmul_params(self) -> int:
        """Weights multiplied per token: every layer's projections plus the LM head."""
        kv = self.kv_heads * self.head_dim
        per_layer = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        per_layer += 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.vocab * self.hidden

    def total_params(self) -> int:
        """Stored parameters (tied embedding counted once, norms included)."""
        norms = (2 * self.layers + 1) * self.hidden
        if self.qk_norm:
            norms += 2 * self.head_dim * self.layers
        return self.matmul_params() + norms

    def flops_per_output_token(self, prompt_len: int, output_len: int) -> float:
        """Useful FLOPs per generated token, prefill included (shared over the outputs).

        Decode: 2 × matmul params, plus attention ``4 · hidden`` per layer per context
        position (QKᵀ and PV), at the mean context. Prefill: 2 × layer params per prompt
        token (the LM head runs for the last one only) plus its causal attention.
        """
        layer_params = self.matmul_params() - self.vocab * self.hidden
        mean_ctx = prompt_len + (output_len + 1) / 2
        decode = 2 * self.matmul_params() + 4 * self.hidden * self.layers * mean_ctx
        prefill = float(prompt_len * 2 * layer_params)
        prefill += 4 * self.hidden * self.layers * prompt_len * (prompt_len + 1) / 2
        return decode + prefill / output_len


SHAPES: dict[Variant, Shape] = {
    "main": Shape(),
    "tp2": Shape(heads=12, kv_heads=4),
    "qwen3": Shape(qk_norm=True),  # Qwen3ForCausalLM at the bench model's sizes
}


def model_dir(variant: Variant) -> Path:
    family = "qwen3" if variant == "qwen3" else "llama"
    return CACHE / f"{family}135m-{variant}-{VERSION}"


def ensure_model(variant: Variant = "main") -> Path:
    """Return the checkpoint directory of ``variant``, writing it first if missing."""
    return ensure_checkpoint(model_dir(variant), lambda path: _write(path, SHAPES[variant]))


def ensure_checkpoint(target: Path, write: Callable[[Path], None]) -> Path:
    """``target`` (a checkpoint with its ``tokenizer.json``); when missing, ``write(tmp)``
    fills a temporary directory beside it, renamed into place once complete."""
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    write_whole(target, write)
    return target


def zero_undecodable_embeddings(model: Any) -> None:
    """Zero the tied embedding rows of ids the built-in tokenizer cannot decode on their own
    (ids past its vocabulary and the single-byte symbols; see the module docstring)."""
    import torch

    from model_shards.launch.default_model import build_tokenizer

    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[build_tokenizer().get_vocab_size() :].zero_()
        embedding[BYTE_TOKENS].zero_()


def _write(path: Path, shape: Shape) -> None:
    import torch
    import transformers

    from model_shards.launch.default_model import BOS_TOKEN_ID, EOS_TOKEN_ID, write_tokenizer

    config_class = transformers.Qwen3Config if shape.qk_norm else transformers.LlamaConfig
    config = config_class(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        vocab_size=shape.vocab,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    zero_undecodable_embeddings(model)
    stored = sum(p.numel() for p in model.parameters())
    if stored != shape.total_params():
        raise RuntimeError(f"built {stored} parameters, expected {shape.total_params()}")
    model.save_pretrained(path)
    write_tokenizer(path, max_length=shape.max_positions)
    (path / "bench_model.json").write_text(json.dumps({"parameters": stored}) + "\n")
