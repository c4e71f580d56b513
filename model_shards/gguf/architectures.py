"""GGUF architectures served, each mapped onto a Hugging Face architecture (and so onto a
shardserve family): its metadata → a ``config.json``-style dict, its tensor names → the HF
names the family loads, and what llama.cpp's converter did to a tensor that must be undone.

* ``llama`` (Llama, Mistral, SmolLM): q and k rows were permuted per head
  (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``: each head's two rotary halves
  interleaved); stored row ``h·D + 2i + s`` is HF row ``h·D + s·D/2 + i``. Llama 3's rope
  scaling is stored as ``rope_freqs.weight`` (one divisor per frequency): served as
  ``longrope`` with those divisors and no attention factor, which is the same rotation.
* ``gemma2`` / ``gemma3``: the converter stored every ``*norm.weight`` as ``1 + w``; the
  source gives back ``w``. The attention scale is llama.cpp's: ``head_dim ** -0.5``, or
  ``(hidden / heads) ** -0.5`` for the 27B models (46 / 62 layers).
* ``phi3``: ``attn_qkv`` and ``ffn_up`` hold the fused ``qkv_proj`` / ``gate_up_proj``, as in
  HF; longrope's factors are the ``rope_factors_{short,long}.weight`` tensors.
* ``qwen2`` (q/k/v biases), ``qwen3`` (``attn_q_norm`` / ``attn_k_norm``): names only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from model_shards.gguf.reader import FLOAT_TYPES, GGUFModel, read_gguf

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER = {**_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# consumed into the config (rope frequency divisors), not loaded as weights
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class TensorPlan:
    """How the HF tensor ``name`` is read from the GGUF tensor ``gguf_name``: rows
    un-permuted over ``permute_heads`` heads (0: as stored), ``shift`` subtracted."""

    name: str
    gguf_name: str
    permute_heads: int = 0
    shift: float = 0.0


@dataclass(frozen=True)
class Architecture:
    hf_architecture: str
    layer_names: Mapping[str, str]
    config: Callable[[GGUFModel, dict[str, Any]], None] = lambda m, raw: None
    permute_qk: bool = False
    norm_shift: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)


def _gemma_scale(model: GGUFModel, raw: dict[str, Any], big_layers: int) -> None:
    """Gemma's own fields, as llama.cpp reads them (see the module docstring)."""
    big = raw["num_hidden_layers"] == big_layers
    raw["query_pre_attn_scalar"] = (
        raw["hidden_size"] // raw["num_attention_heads"] if big else raw["head_dim"]
    )
    raw["sliding_window"] = int(model.field("attention.sliding_window", 4096))
    raw["hidden_activation"] = "gelu_pytorch_tanh"


def _gemma2(model: GGUFModel, raw: dict[str, Any]) -> None:
    _gemma_scale(model, raw, big_layers=46)
    raw["attn_logit_softcapping"] = model.field("attn_logit_softcapping")
    raw["final_logit_softcapping"] = model.field("final_logit_softcapping")
    n = raw["num_hidden_layers"]
    raw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def _gemma3(model: GGUFModel, raw: dict[str, Any]) -> None:
    _gemma_scale(model, raw, big_layers=62)
    raw["rope_local_base_freq"] = 10000.0  # llama.cpp's fixed sliding-layer base
    n = raw["num_hidden_layers"]
    raw["layer_types"] = [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
    ]


def _phi3(model: GGUFModel, raw: dict[str, Any]) -> None:
    rotary = model.field("rope.dimension_count")
    if rotary:
        raw["partial_rotary_factor"] = int(rotary) / raw["head_dim"]
    window = model.field("attention.sliding_window")
    raw["sliding_window"] = int(window) if window else None
    if "rope_factors_long.weight" in model.tensors:
        original = int(model.field("rope.scaling.original_context_length", 4096))
        raw["original_max_position_embeddings"] = original
        raw["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": model.read_floats("rope_factors_short.weight"),
            "long_factor": model.read_floats("rope_factors_long.weight"),
            "attention_factor": model.field("rope.scaling.attn_factor"),
        }


ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType(
    {
        "llama": Architecture("LlamaForCausalLM", _LAYER, permute_qk=True),
        "qwen2": Architecture("Qwen2ForCausalLM", _LAYER),
        "qwen3": Architecture("Qwen3ForCausalLM", _LAYER),
        "gemma2": Architecture("Gemma2ForCausalLM", _GEMMA_LAYER, _gemma2, norm_shift=1.0),
        "gemma3": Architecture("Gemma3ForCausalLM", _GEMMA_LAYER, _gemma3, norm_shift=1.0),
        "phi3": Architecture("Phi3ForCausalLM", _PHI3_LAYER, _phi3),
    }
)
"""GGUF ``general.architecture`` → how it is served."""


def architecture_of(model: GGUFModel) -> Architecture:
    """The served architecture of ``model``; ``ValueError`` naming it and the supported ones."""
    arch = ARCHITECTURES.get(model.architecture)
    if arch is None:
        raise ValueError(
            f"{model.files[0]}: GGUF architecture {model.architecture!r} is not supported; "
            f"shardserve serves {', '.join(ARCHITECTURES)}"
        )
    return arch


def tensor_plans(model: GGUFModel) -> dict[str, TensorPlan]:
    """Every weight of ``model`` by its HF name; an unknown GGUF name keeps its own (the
    loader then refuses it, naming it)."""
    arch = architecture_of(model)
    heads = int(model.field("attention.head_count"))
    kv_heads = int(model.field("attention.head_count_kv", heads))
    plans: dict[str, TensorPlan] = {}
    for gguf_name in model.tensors:
        if gguf_name in _CONFIG_TENSORS:
            continue
        stem, _, suffix = gguf_name.rpartition(".")
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in arch.layer_names:
            hf = f"model.layers.{parts[1]}.{arch.layer_names[parts[2]]}.{suffix}"
            kind = parts[2]
        elif stem in _TOP:
            hf, kind = f"{_TOP[stem]}.{suffix}", stem
        else:
            plans[gguf_name] = TensorPlan(gguf_name, gguf_name)
            continue
        permute = 0
        if arch.permute_qk and kind in ("attn_q", "attn_k"):
            permute = heads if kind == "attn_q" else kv_heads
        shift = arch.norm_shift if kind.endswith("norm") and suffix == "weight" else 0.0
        plans[hf] = TensorPlan(hf, gguf_name, permute, shift)
    return plans


def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json``-style dict of the GGUF checkpoint at ``path`` (:func:`hf_config`)."""
    return hf_config(read_gguf(path))


def hf_config(model: GGUFModel) -> dict[str, Any]:
    """``model``'s metadata as the ``config.json`` its HF architecture would have;
    ``ValueError`` naming a missing or malformed key."""
    arch = architecture_of(model)
    try:
        raw = _common_config(model, arch)
        arch.config(model, raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{model.files[0]}: malformed or missing GGUF metadata ({exc})") from exc
    return raw


def _required(model: GGUFModel, key: str) -> int:
    value = model.field(key)
    if value is None:
        raise KeyError(f"{model.architecture}.{key}")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"{model.architecture}.{key} differs per layer ({value[:8]})")
        value = value[0]
    return int(value)


def _common_config(model: GGUFModel, arch: Architecture) -> dict[str, Any]:
    hidden = _required(model, "embedding_length")
    heads = _required(model, "attention.head_count")
    if "token_embd.weight" not in model.tensors:
        raise KeyError("token_embd.weight")
    md = model.metadata
    eos = [md.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return {
        "architectures": [arch.hf_architecture],
        "vocab_size": model.tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": _required(model, "feed_forward_length"),
        "num_hidden_layers": _required(model, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(model.field("attention.head_count_kv") or heads),
        "head_dim": int(model.field("attention.key_length") or hidden // heads),
        "rms_norm_eps": float(model.field("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": _required(model, "context_length"),
        "rope_theta": float(model.field("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(model),
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "torch_dtype": _dtype(model),
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
    }


def _rope_scaling(model: GGUFModel) -> dict[str, Any] | None:
    kind = str(model.field("rope.scaling.type") or "none")
    factor = float(model.field("rope.scaling.factor") or 1.0)
    if "rope_freqs.weight" in model.tensors:  # Llama 3: the divisors themselves
        divisors = model.read_floats("rope_freqs.weight")
        original = int(model.field("context_length"))
        return {
            "rope_type": "longrope",
            "short_factor": divisors,
            "long_factor": divisors,
            "attention_factor": 1.0,
            "original_max_position_embeddings": original,
        }
    if kind == "none" or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = model.field("rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ValueError(f"{model.architecture}.rope.scaling.type {kind!r} (none, linear, yarn)")


def _dtype(model: GGUFModel) -> str:
    """``float16`` / ``bfloat16`` when every matrix is stored so, else ``float32`` (the
    dtype quantized tensors are dequantized to)."""
    types = {t.ggml_type for t in model.tensors.values() if len(t.shape) >= 2}
    names = {int(FLOAT_TYPES[1]): "float16", int(FLOAT_TYPES[2]): "bfloat16"}
    return names.get(types.pop(), "float32") if len(types) == 1 else "float32"
