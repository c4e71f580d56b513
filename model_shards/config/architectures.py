"""The Hugging Face ``architectures`` names a decoder replica serves, listed once.

Each name maps to its model family: :data:`model_shards.models.MODEL_REGISTRY`
holds the family's class for every name here, and
:meth:`model_shards.config.model.ModelConfig.from_dir` refuses a checkpoint naming
none of them before any process is spawned. No torch import: the CLI validates
configs with this module alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

DECODER_FAMILIES: Mapping[str, str] = MappingProxyType(
    {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "llama",
        "Qwen2ForCausalLM": "llama",
        "GPT2LMHeadModel": "gpt2",
        "Qwen3ForCausalLM": "qwen3",
        "Olmo2ForCausalLM": "olmo2",
        "Phi3ForCausalLM": "phi3",
        "Gemma2ForCausalLM": "gemma",
        "Gemma3ForCausalLM": "gemma",
        "MixtralForCausalLM": "mixtral",
        "Qwen2MoeForCausalLM": "qwen2_moe",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "DeepseekV2ForCausalLM": "deepseek_v2",
        "LlavaForConditionalGeneration": "llava",
        "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    }
)
"""HF architecture name → model family (a file in ``model_shards/models/``)."""

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(DECODER_FAMILIES)
