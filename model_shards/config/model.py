"""A checkpoint's model shape, frozen and validated: :class:`ModelConfig` for a decoder,
:class:`~model_shards.config.encoder.EncoderConfig` for an encoder
(:func:`load_model_config` picks by ``architectures``). A bad ``config.json`` is a
``ValueError`` naming the field, before any process is spawned.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType
from typing import Any

from model_shards.config.architectures import SUPPORTED_ARCHITECTURES
from model_shards.config.encoder import ENCODER_ARCHITECTURES, EncoderConfig
from model_shards.config.hf_json import (
    TransformerShape,
    checkpoint_dtype,
    read_json,
)
from model_shards.config.quantization import (
    CheckpointQuant,
    parse_kv_cache_scheme,
    parse_quantization_config,
)
from model_shards.config.rope import RopeConfig, parse_rope
from model_shards.config.vlm import flatten_text_config, is_vlm, vision_tp_problem
from model_shards.gguf.architectures import load_hf_config
from model_shards.gguf.files import is_gguf


@dataclass(frozen=True)
class ModelConfig(TransformerShape):
    """The subset of a Hugging Face ``config.json`` a decoder-only Llama-family model needs."""

    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    # multi-head latent attention (DeepSeek-V2): each token's K/V is one compressed latent of
    # head_dim = kv_lora_rank + qk_rope_head_dim values (num_kv_heads 1), K and V one buffer
    kv_latent: bool = False
    # the checkpoint's quantization_config (AWQ, GPTQ, compressed-tensors, FBGEMM FP8); None:
    # dense (or GGUF blocks)
    quant: CheckpointQuant | None = None
    # a compressed-tensors kv_cache_scheme: per-layer FP8 K/V scales in the checkpoint
    kv_fp8_scales: bool = False
    # the whole config.json, read-only: a family's own fields (QK-norm, windows, …) are
    # read from it by that family's model file
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_dir(model_dir: str | os.PathLike[str]) -> ModelConfig:
        """A checkpoint directory's ``config.json``, or a GGUF checkpoint's metadata."""
        if is_gguf(model_dir):
            return ModelConfig.from_dict(load_hf_config(model_dir), source=str(model_dir))
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"--model {model_dir}: no config.json nor .gguf in that directory")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--model {model_dir}: config.json is not valid JSON ({exc})") from exc
        return ModelConfig.from_dict(raw, source=str(path))

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: architectures {archs} not supported; "
                f"shardserve serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        torch_dtype = checkpoint_dtype(raw, source)
        quant = parse_quantization_config(raw, source)
        kv_fp8_scales = parse_kv_cache_scheme(raw, source)
        try:
            if arch in _GPT2_ARCHITECTURES:
                raw = _with_gpt2_names(raw)
            if is_vlm(raw):  # LLaVA: the language model's fields sit under text_config
                raw = flatten_text_config(raw)
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            mla = arch in _MLA_ARCHITECTURES  # the cache holds the latent, not per-head K/V
            return ModelConfig(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=1 if mla else int(raw.get("num_key_value_heads") or num_heads),
                # transformers' DeepseekV2Config defaults
                head_dim=int(raw.get("kv_lora_rank", 512)) + int(raw.get("qk_rope_head_dim", 64))
                if mla
                else int(raw.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rope=parse_rope(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v bias; Llama and Mistral say so in config.
                attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                torch_dtype=torch_dtype,
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                kv_latent=mla,
                quant=quant,
                kv_fp8_scales=kv_fp8_scales,
                extra=MappingProxyType(dict(raw)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed or missing field ({exc!r})") from exc

    def kv_heads_per_rank(self, tp: int) -> int:
        """Key/value heads a TP rank holds: ``nkv / tp``, or one (replicated on
        ``tp / nkv`` ranks) when tp exceeds them."""
        return max(1, self.num_kv_heads // tp)

    def kv_block_bytes(self, tp: int, num_layers: int, block_size: int, itemsize: int) -> int:
        """Bytes of one paged KV block on a rank: K and V of ``num_layers`` layers,
        ``block_size`` tokens, this rank's KV heads, ``itemsize``-byte elements (with
        ``kv_latent``, the one latent buffer: K and V are the same)."""
        heads = self.kv_heads_per_rank(tp)
        buffers = 1 if self.kv_latent else 2
        return buffers * num_layers * block_size * heads * self.head_dim * itemsize

    def layer_partition(self, pp: int, spec: str = "even") -> list[int]:
        """Decoder layers per pipeline stage; ``ValueError`` naming the flag on a bad ``spec``.

        ``even``: as equal as possible, the first stages taking the remainder.
        ``balanced``: equal decode time per stage, the last stage's LM head counted
        as ``vocab * hidden / (1.5 * parameters of one layer)`` layers: a decoder
        layer's decode step costs about 1.5 times its GEMMs (attention over the KV
        cache, norms, rotary, per-op overhead) while the LM head is one large,
        efficient GEMM. Measured on the benchmark's 135M shape, CPU, micro-batches of
        16, with our GEMM kernel: stage 0's step took 28.4 ms with 17 + 13 layers and
        then waited 2.2 ms (median) for stage 1; with 18 + 12, 29.4 ms and 0.3 ms;
        with 19 + 11, 32.4 ms. Embedding lookups are nearly free; fewer layers go to
        the last stage. ``"a,b,..."``: explicit.
        Every stage gets at least one layer.
        """
        if spec == "even":
            base, extra = divmod(self.num_layers, pp)
            return [base + (1 if r < extra else 0) for r in range(pp)]
        if spec == "balanced":
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            h = self.hidden_size
            layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size
            head = self.vocab_size * h / (1.5 * layer)
            share = (self.num_layers + head) / pp
            bounds = [0]
            for r in range(1, pp):
                lo, hi = bounds[-1] + 1, self.num_layers - (pp - r)
                bounds.append(min(max(round(r * share), lo), hi))
            bounds.append(self.num_layers)
            return [b - a for a, b in pairwise(bounds)]
        try:
            counts = [int(part) for part in spec.split(",")]
        except ValueError:
            counts = []
        if len(counts) != pp or min(counts, default=0) < 1 or sum(counts) != self.num_layers:
            raise ValueError(
                f"--pp-layer-partition {spec!r}: use 'even', 'balanced' or {pp} positive "
                f"layer counts that sum to the model's {self.num_layers} layers"
            )
        return counts

    def valid_tp_sizes(self) -> list[int]:
        """Every tensor-parallel size this model's shapes can be split into."""
        return [t for t in range(1, self.num_heads + 1) if not self._tp_problem(t)]

    def _tp_problem(self, tp: int) -> str | None:
        if self.num_heads % tp:
            return f"{self.num_heads} attention heads are not divisible by {tp}"
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            return f"{self.num_kv_heads} key/value heads neither divide nor are divisible by {tp}"
        if self.intermediate_size % tp:
            return f"intermediate_size {self.intermediate_size} is not divisible by {tp}"
        return vision_tp_problem(self.extra, tp)

    def check_layout(self, tp: int, pp: int) -> None:
        """Raise ``ValueError`` naming the flag when the model cannot take this layout."""
        if tp < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
        if pp < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {pp}")
        problem = self._tp_problem(tp)
        if problem:
            raise ValueError(
                f"--tensor-parallel-size {tp} does not fit this model: {problem}; "
                f"valid sizes: {self.valid_tp_sizes()}"
            )
        if pp > self.num_layers:
            raise ValueError(
                f"--pipeline-parallel-size {pp} exceeds the model's {self.num_layers} layers; "
                f"choose 1..{self.num_layers}"
            )


_GPT2_ARCHITECTURES = ("GPT2LMHeadModel",)
_MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM",)
# GPT-2's config.json names of the common fields (transformers' GPT2Config.attribute_map)
_GPT2_NAMES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
}


def _with_gpt2_names(raw: dict[str, Any]) -> dict[str, Any]:
    """A GPT-2 ``config.json`` with the common fields also under the names
    :meth:`ModelConfig.from_dict` reads: ``n_embd`` → ``hidden_size``, … (:data:`_GPT2_NAMES`),
    ``n_inner`` → ``intermediate_size`` (``null``: ``4 * n_embd``), and the LM head tied to
    ``wte`` unless ``tie_word_embeddings`` says otherwise (GPT2Config's default). GPT-2's own
    fields (``layer_norm_epsilon``, ``activation_function``, …) are ``models/gpt2.py``'s."""
    out = dict(raw)
    for gpt2_name, name in _GPT2_NAMES.items():
        if gpt2_name in raw:
            out.setdefault(name, raw[gpt2_name])
    if out.get("intermediate_size") is None:
        inner = raw.get("n_inner")
        out["intermediate_size"] = 4 * int(out["hidden_size"]) if inner is None else int(inner)
    out.setdefault("tie_word_embeddings", True)
    return out


def load_model_config(model_dir: str | os.PathLike[str]) -> ModelConfig | EncoderConfig:
    """The decoder or encoder config of a checkpoint directory, by its ``architectures``
    (a GGUF checkpoint, file or directory: always a decoder)."""
    if is_gguf(model_dir):
        return ModelConfig.from_dir(model_dir)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {model_dir}: no config.json nor .gguf in that directory")
    raw = read_json(path)
    if any(a in ENCODER_ARCHITECTURES for a in raw.get("architectures") or []):
        return EncoderConfig.from_dir(model_dir)
    return ModelConfig.from_dict(raw, source=str(path))
