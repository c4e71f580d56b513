"""Frozen, validated configuration: the model's shape and the replica's layout.

Everything here is checked before any process is spawned; a bad combination is
a ``ValueError`` that names the flag and the fix. A decoder's shape is
:class:`ModelConfig`, an encoder's :class:`~model_shards.config.encoder.EncoderConfig`
(:func:`load_model_config` picks by ``architectures``); :class:`ReplicaConfig`
is the replica's flags, checked against the model by :meth:`ReplicaConfig.validate`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from model_shards.config.architectures import SUPPORTED_ARCHITECTURES
from model_shards.config.encoder import ENCODER_ARCHITECTURES, EncoderConfig
from model_shards.config.hf_json import (
    CHECKPOINT_DTYPES,
    TransformerShape,
    checkpoint_dtype,
    read_json,
)
from model_shards.config.kv_layout import KVLayout, peak_blocks
from model_shards.config.moe import check_expert_layout
from model_shards.config.rope import RopeConfig, parse_rope
from model_shards.config.scheduler import check_step_limits
from model_shards.config.vlm import flatten_text_config, is_vlm, vision_tp_problem

DTYPE_CHOICES: tuple[str, ...] = ("auto", *CHECKPOINT_DTYPES)


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
    # the whole config.json, read-only: a family's own fields (QK-norm, windows, …) are
    # read from it by that family's model file
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_dir(model_dir: str | os.PathLike[str]) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"--model {model_dir}: no config.json in that directory")
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


def ranks_use_gpus(device: str, ranks: int, gpu_count: int, ranks_text: str) -> bool:
    """Whether ``ranks`` ranks run on GPUs, one each, under ``--device``: never with ``cpu``,
    else when ``gpu_count`` covers them. ``ValueError`` naming the flags when ``cuda``
    lacks GPUs and when ``auto`` sees some but fewer than ranks: a machine with GPUs never
    silently serves on its CPU. ``ranks_text`` says what was counted (e.g. ``dp*tp*pp = 4``).
    """
    if device == "cpu":
        return False
    if gpu_count >= ranks:
        return True
    if device == "cuda" or gpu_count > 0:
        raise ValueError(
            f"--device {device} needs one GPU per rank: {ranks_text} but {gpu_count} CUDA "
            f"device(s) are visible; lower -dp/-tp/-pp or pass --device cpu to serve on CPU"
        )
    return False


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica: a ``tp * pp`` world serving one model directory."""

    model_dir: str
    tp: int = 1
    pp: int = 1
    dtype: str = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes per rank; default: see worker.kv_cache_blocks
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode-only steps
    batch_invariant: bool = False  # CUDA: fixed-reduction-order kernels (--batch-invariant)
    enable_prefix_caching: bool = True
    pipeline_overlap: bool = True  # up to pp micro-batches in flight when pp > 1
    pp_layer_partition: str = "even"  # see ModelConfig.layer_partition
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    collective_timeout_s: float = 120.0
    threads_per_rank: int | None = None  # CPU only; default: cores // world size, at least 1
    enable_expert_parallel: bool = False  # MoE: whole experts per TP rank (moe_config.py)
    dp_attention: bool = False  # -dp replicas share their experts (dp_attention_launch.py)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def check_flags(self) -> None:
        """The checks that need no model: dtype, the scheduler's rules on its limits
        (:func:`~model_shards.config.scheduler.check_step_limits`), block size, KV cache
        memory and GPU memory utilization; ``ValueError`` naming the flag."""
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype {self.dtype!r} invalid; choose one of {DTYPE_CHOICES}")
        check_step_limits(self.max_num_seqs, self.max_num_batched_tokens, self.block_size)
        if self.block_size > 1024:
            raise ValueError(f"--block-size must be in 1..1024, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def validate(self) -> ModelConfig | EncoderConfig:
        """Check flags, the model directory and the layout; return the model's config.

        Needs only the flags and the checkpoint's ``config.json``: each mistake is a
        ``ValueError`` naming the flag, before any process is spawned.
        """
        self.check_flags()
        if not Path(self.model_dir).is_dir():
            raise ValueError(f"--model {self.model_dir}: not a directory")
        model = load_model_config(self.model_dir)
        model.check_layout(self.tp, self.pp)
        if isinstance(model, ModelConfig):
            model.layer_partition(self.pp, self.pp_layer_partition)
            check_expert_layout(model, self.tp, self.enable_expert_parallel)
        elif self.enable_expert_parallel:
            raise ValueError("--enable-expert-parallel: encoder (embedding) models have no experts")
        elif self.pp_layer_partition != "even":
            raise ValueError("--pp-layer-partition: encoder (embedding) models run with -pp 1")
        if self.max_model_len is not None and not (
            1 <= self.max_model_len <= model.max_position_embeddings
        ):
            raise ValueError(
                f"--max-model-len {self.max_model_len} must be in "
                f"1..{model.max_position_embeddings} (the model's max_position_embeddings)"
            )
        if isinstance(model, ModelConfig):
            self._check_kv_cache_memory(model)
        return model

    def _check_kv_cache_memory(self, model: ModelConfig) -> None:
        """``--kv-cache-memory`` must hold one ``max_model_len``-token sequence on every rank.

        Each rank checks again once its dtype is known (``worker.kv_cache_blocks``); here
        the smallest element the dtype may resolve to is assumed (``auto`` off CPU may
        serve a float32 checkpoint in bfloat16), so a refusal here is certain there too.
        """
        if self.kv_cache_memory is None:
            return
        name = model.torch_dtype if self.dtype == "auto" else self.dtype
        itemsize = CHECKPOINT_DTYPES[name]
        if self.dtype == "auto" and self.device != "cpu":
            itemsize = min(itemsize, CHECKPOINT_DTYPES["bfloat16"])
        layout = KVLayout.for_model(model)
        counts = model.layer_partition(self.pp, self.pp_layer_partition)
        starts = [sum(counts[:s]) for s in range(len(counts))]
        layers = max(layout.slots_on(range(a, a + n)) for a, n in zip(starts, counts, strict=True))
        per_block = model.kv_block_bytes(self.tp, layers, self.block_size, itemsize)
        max_len = self.resolved_max_model_len(model)
        chunk = self.max_num_batched_tokens
        need = peak_blocks(layout.windows, max_len, self.block_size, chunk) * per_block
        if self.kv_cache_memory < need:
            raise ValueError(
                f"--kv-cache-memory {self.kv_cache_memory} bytes cannot hold one {max_len}-token "
                f"sequence per rank (K and V of {layers} layers: {need} bytes); raise "
                f"--kv-cache-memory or lower --max-model-len"
            )

    def resolved_max_model_len(self, model: ModelConfig | EncoderConfig) -> int:
        if isinstance(model, EncoderConfig):
            return min(self.max_model_len or model.max_seq_length, model.max_seq_length)
        return self.max_model_len or model.max_position_embeddings


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"`` → bytes; ``ValueError`` on anything else."""
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number) :]
    if unit not in _SIZE_UNITS or not number:
        raise ValueError(f"invalid size {text!r}; use e.g. 512MiB, 2GiB, 4GB")
    value = float(number) * _SIZE_UNITS[unit]
    if not 0 < value < math.inf:
        raise ValueError(f"size {text!r} must be positive and finite")
    return int(value)


def load_model_config(model_dir: str | os.PathLike[str]) -> ModelConfig | EncoderConfig:
    """The decoder or encoder config of a checkpoint directory, by its ``architectures``."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {model_dir}: no config.json in that directory")
    raw = read_json(path)
    if any(a in ENCODER_ARCHITECTURES for a in raw.get("architectures") or []):
        return EncoderConfig.from_dir(model_dir)
    return ModelConfig.from_dict(raw, source=str(path))
