"""Tiny random checkpoints of every GGUF architecture served, written as llama.cpp would
(:mod:`tests.model_shards.gguf.writer`), and transformers' reading of them as the reference.

=======  ==========================================================================
llama    hidden 256 (4 heads x 64, 2 kv), inter 256, 2 layers, vocab 301, untied head;
         K-quants (Q4_K q, Q5_K k, Q6_K v and head), Q8_0 o, Q4_0 / Q4_1 / Q5_0 MLP
qwen2    hidden 64 (4 x 16, 2 kv), inter 96, q/k/v biases, tied; Q8_0, F16 and BF16
qwen3    hidden 64 (4 x 32 head_dim, 2 kv), inter 128, QK-norm; Q4_0, Q5_1
gemma2   hidden 64 (2 x 32, 1 kv), inter 128, window 4, soft-caps 20 / 15; Q8_0
gemma3   hidden 64 (2 x 32, 1 kv), inter 128, window 4, QK-norm; Q8_0, Q4_1
phi3     hidden 64 (4 x 16, 4 kv), inter 96 (fused gate_up), fused qkv; Q8_0, Q5_0
=======  ==========================================================================

transformers' GGUF reader drops what it has no key for; :func:`hf_reference` hands it
the config fields llama.cpp's metadata means (Gemma's attention scale and soft-caps,
Qwen3's ``key_length`` as its head_dim).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tests.checkpoints import randomize
from tests.model_shards.gguf.writer import Q, write_gguf

VOCAB = 301
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_BASE: dict[str, Any] = {
    "dtype": "float32",
    "vocab_size": VOCAB,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SPECS: dict[str, tuple[type, dict[str, Any], dict[str, Q]]] = {
    "llama": (
        transformers.LlamaConfig,
        {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 256, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0,
         "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_0, "output": Q.Q6_K},
    ),
    "qwen2": (
        transformers.Qwen2Config,
        {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "tie_word_embeddings": True, "rope_parameters": ROPE},
        {"attn_q": Q.F16, "attn_v": Q.BF16, "ffn_down": Q.F16},
    ),
    "qwen3": (
        transformers.Qwen3Config,
        {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "intermediate_size": 128, "tie_word_embeddings": True, "rope_parameters": ROPE},
        {"attn_q": Q.Q4_0, "attn_k": Q.Q5_1, "ffn_up": Q.Q5_1},
    ),
    "gemma2": (
        transformers.Gemma2Config,
        {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
         "intermediate_size": 128, "sliding_window": 4, "query_pre_attn_scalar": 32,
         "attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0,
         "rope_parameters": ROPE},
        {},
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
         "intermediate_size": 128, "sliding_window": 4, "query_pre_attn_scalar": 32},
        {"ffn_gate": Q.Q4_1},
    ),
    "phi3": (
        transformers.Phi3Config,
        {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
         "intermediate_size": 96, "tie_word_embeddings": False, "rope_parameters": ROPE,
         "pad_token_id": 0},
        {"ffn_down": Q.Q5_0},
    ),
}  # fmt: skip
# what llama.cpp reads from the metadata and transformers' GGUF config mapping leaves out
_REFERENCE_FIELDS: dict[str, tuple[str, ...]] = {
    "gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"),
    "gemma3": ("query_pre_attn_scalar", "sliding_window"),
    "qwen3": ("head_dim",),  # its key_length
    "phi3": ("pad_token_id",),  # Phi3Config's default 32000 is outside the tiny vocab
}


def hf_model(arch: str) -> transformers.PreTrainedModel:
    config_cls, fields, _ = SPECS[arch]
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**_BASE, **fields}))
    randomize(model.to(torch.float32), seed=sum(map(ord, arch)))
    return model


def build(arch: str, directory: Path, **kwargs: Any) -> Path:
    """``directory/tiny-{arch}.gguf`` (or its split shards) of :data:`SPECS` ``arch``."""
    return write_gguf(hf_model(arch), directory / f"tiny-{arch}.gguf", arch, SPECS[arch][2], **kwargs)


def hf_reference(path: Path, arch: str | None = None) -> transformers.PreTrainedModel:
    """transformers' model of the GGUF file ``path`` (dequantized, float32, eval): its GGUF
    config and its GGUF tensor loader (names, un-permutation, dequantization), the steps of
    ``from_pretrained(gguf_file=...)`` without its ``accelerate`` requirement; every
    parameter must come from the file (a tied head from the embedding)."""
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for field in _REFERENCE_FIELDS.get(arch or "", ()):
        setattr(config, field, SPECS[str(arch)][1][field])
    config.dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(loaded["tensors"], strict=False)
    tied = ["lm_head.weight"] if config.tie_word_embeddings else []
    assert (missing, unexpected) == (tied, []), (missing, unexpected)
    model.tie_weights()
    return model.eval()


def greedy_and_logits(
    model: transformers.PreTrainedModel, prompt: list[int], new_tokens: int
) -> tuple[torch.Tensor, list[int]]:
    """The prompt's last-position logits and ``new_tokens`` greedy tokens (no KV cache)."""
    ids = list(prompt)
    first: torch.Tensor | None = None
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
    assert first is not None
    return first, ids[len(prompt) :]
