"""Model families, one file each, and the registry from HF architecture names
(:data:`model_shards.config.architectures.DECODER_FAMILIES`'s) to the class of each.

- ``decoder``: the protocols a family's class and model meet (worker, loader, graphs)
- ``causal_lm``: the family classes' bases, ``CausalLM`` (the loader's) and ``DecoderLM``
- ``stack``: this stage's layer stack, the pre-norm decoder layer, Llama's fused names
- ``stages``: pipeline stages, which layers each builds
- ``plain_decode``: a stage's decode steps in one backend call where its layers are plain
- ``piecewise``: a plain stack's forward cut at its attention cores (piecewise graphs' pieces)
- ``naming``: parameter names ↔ checkpoint names of fused projections
- ``sparse_moe``: the MoE families' layers and the loader's view of their experts
- ``llama``: Llama, Mistral, Qwen2
- ``qwen3``: Qwen3 (per-head QK-norm)
- ``gemma``: Gemma 2 and 3 (sandwich norms, soft-caps, sliding layers)
- ``olmo2``: OLMo 2 (post-norms, QK-norm over the projection)
- ``phi3``: Phi-3 (fused checkpoint projections, longrope, partial rotary)
- ``gpt2``: GPT-2 (learned positions, ``Conv1D`` weights)
- ``mixtral``: Mixtral (MoE)
- ``qwen2_moe``: Qwen2-MoE (MoE with a gated shared expert)
- ``qwen3_moe``: Qwen3-MoE
- ``deepseek_v2``: DeepSeek-V2 (multi-head latent attention, grouped MoE routing)
- ``llava``: LLaVA (CLIP tower, projector, Llama language model)
- ``clip_vision``: the CLIP vision tower
- ``qwen2_5_vl/``: Qwen2.5-VL (its vision tower and M-RoPE positions)
- ``bert``: the BERT sentence encoder (embeddings) and sequence classifier (cross-encoders)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from model_shards.config.architectures import DECODER_FAMILIES
from model_shards.models.decoder import DecoderModel, DecoderModelClass
from model_shards.models.deepseek_v2 import DeepseekV2ForCausalLM
from model_shards.models.gemma import GemmaForCausalLM
from model_shards.models.gpt2 import GPT2LMHeadModel
from model_shards.models.llama import LlamaForCausalLM
from model_shards.models.llava import LlavaForConditionalGeneration
from model_shards.models.mixtral import MixtralForCausalLM
from model_shards.models.olmo2 import Olmo2ForCausalLM
from model_shards.models.phi3 import Phi3ForCausalLM
from model_shards.models.qwen2_5_vl.model import Qwen2_5_VLForConditionalGeneration
from model_shards.models.qwen2_moe import Qwen2MoeForCausalLM
from model_shards.models.qwen3 import Qwen3ForCausalLM
from model_shards.models.qwen3_moe import Qwen3MoeForCausalLM

_FAMILY_CLASSES: Mapping[str, DecoderModelClass] = {
    "deepseek_v2": DeepseekV2ForCausalLM,
    "gemma": GemmaForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "llama": LlamaForCausalLM,
    "llava": LlavaForConditionalGeneration,
    "mixtral": MixtralForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}

MODEL_REGISTRY: Mapping[str, DecoderModelClass] = MappingProxyType(
    {arch: _FAMILY_CLASSES[family] for arch, family in DECODER_FAMILIES.items()}
)
"""HF architecture name → the class that builds a stage of that model."""

__all__ = ["MODEL_REGISTRY", "DecoderModel", "DecoderModelClass"]
