"""Model families, one file each, and the registry from HF architecture names."""

from __future__ import annotations

from model_shards.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
