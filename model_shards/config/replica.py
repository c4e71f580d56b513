"""A replica's flags, frozen and validated against its model before any process is spawned:
:class:`ReplicaConfig` (a bad combination is a ``ValueError`` naming the flag and the fix),
:func:`ranks_use_gpus` (``--device`` against the visible GPUs) and :func:`parse_size`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from model_shards.config.encoder import EncoderConfig
from model_shards.config.hf_json import CHECKPOINT_DTYPES
from model_shards.config.kv_layout import KVLayout, peak_blocks
from model_shards.config.lora import LoraOptions, parse_lora_modules, read_adapter
from model_shards.config.model import ModelConfig, load_model_config
from model_shards.config.moe import check_expert_layout, moe_config
from model_shards.config.quantization import (
    CPU_ONLY_QUANTIZATION,
    QUANTIZATION_CHOICES,
    check_group_splits,
    check_quantization_flag,
)
from model_shards.config.scheduler import check_step_limits
from model_shards.config.speculative import SpeculativeConfig, check_draft
from model_shards.gguf.files import is_gguf

DTYPE_CHOICES: tuple[str, ...] = ("auto", *CHECKPOINT_DTYPES)


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


# --kv-cache-dtype: the model's dtype, or e4m3 with per-tensor scales (GPU ranks only)
KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = ("auto", "fp8")
KV_FP8_ON_CPU = (
    "--kv-cache-dtype fp8: the CPU backend keeps float K/V (FP8 K/V is served by CUDA ranks); "
    "drop the flag or serve on GPUs"
)


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
    enable_expert_parallel: bool = False  # MoE: whole experts per TP rank (config/moe.py)
    dp_attention: bool = False  # -dp replicas share their experts (launch/dp_attention.py)
    # --quantization: one of QUANTIZATION_CHOICES (GGML blocks: CPU only; fp8: any device)
    quantization: str | None = None
    grammar_compile_timeout_s: float = 10.0  # a structured-output grammar compiling longer: 400
    scheduling_policy: str = "fcfs"  # or "priority" (config.scheduler.SCHEDULING_POLICIES)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: one of KV_CACHE_DTYPE_CHOICES
    # --enable-lora: serve LoRA adapters (config/lora.py); --lora-modules' NAME=PATH entries
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # default: --max-loras
    speculative_config: str | None = None  # --speculative-config's JSON (config/speculative.py)
    # --async-scheduling: plan each step before the last one's tokens are back (None: on CUDA)
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        # a tuple however it came (``--config-json`` carries a JSON list to torchrun's ranks)
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def lora_options(self) -> LoraOptions | None:
        """The LoRA flags (``None`` without ``--enable-lora``); ``ValueError`` naming a flag."""
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return None
        cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        modules = parse_lora_modules(self.lora_modules)
        opts = LoraOptions(modules, self.max_loras, self.max_lora_rank, cpu)
        opts.check()
        return opts

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed ``--speculative-config`` (``ValueError`` naming it), ``None`` if off."""
        text = self.speculative_config
        return None if text is None else SpeculativeConfig.parse(text)

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
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"--quantization {self.quantization!r} invalid; choose one of "
                f"{QUANTIZATION_CHOICES}"
            )
        if self.quantization in CPU_ONLY_QUANTIZATION and self.device == "cuda":
            raise ValueError(
                f"--quantization {self.quantization}: quantized weights are served on CPU only; "
                "drop the flag or use --device cpu"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r} invalid; choose one of "
                f"{KV_CACHE_DTYPE_CHOICES}"
            )
        if self.kv_cache_dtype == "fp8" and self.device == "cpu":
            raise ValueError(KV_FP8_ON_CPU)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        _ = self.speculative
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("--async-scheduling cannot be combined with --speculative-config")
        if self.async_scheduling and self.pp > 1:
            raise ValueError(
                "--async-scheduling needs -pp 1 (pipeline stages overlap their micro-batches)"
            )

    def validate(self) -> ModelConfig | EncoderConfig:
        """Check flags, the model directory and the layout; return the model's config.

        Needs only the flags and the checkpoint's ``config.json``: each mistake is a
        ``ValueError`` naming the flag, before any process is spawned.
        """
        self.check_flags()
        if not Path(self.model_dir).is_dir() and not is_gguf(self.model_dir):
            raise ValueError(f"--model {self.model_dir}: not a directory nor a .gguf file")
        model = load_model_config(self.model_dir)
        model.check_layout(self.tp, self.pp)
        if isinstance(model, ModelConfig):
            model.layer_partition(self.pp, self.pp_layer_partition)
            check_expert_layout(model, self.tp, self.enable_expert_parallel)
            check_quantization_flag(self.quantization, model.quant)
            check_group_splits(model.quant, self.tp, _row_parallel_inputs(model))
        elif self.enable_expert_parallel:
            raise ValueError("--enable-expert-parallel: encoder (embedding) models have no experts")
        elif self.pp_layer_partition != "even":
            raise ValueError("--pp-layer-partition: encoder (embedding) models run with -pp 1")
        elif self.quantization is not None:
            raise ValueError(
                f"--quantization {self.quantization}: encoder (embedding) models are not "
                "quantized; drop the flag"
            )
        if self.max_model_len is not None and not (
            1 <= self.max_model_len <= model.max_position_embeddings
        ):
            raise ValueError(
                f"--max-model-len {self.max_model_len} must be in "
                f"1..{model.max_position_embeddings} (the model's max_position_embeddings)"
            )
        if self.kv_cache_dtype == "fp8" and not isinstance(model, ModelConfig):
            raise ValueError("--kv-cache-dtype fp8: encoder (embedding) models keep no KV cache")
        if isinstance(model, ModelConfig):
            if self.kv_cache_dtype == "fp8" and model.kv_latent:
                raise ValueError(
                    "--kv-cache-dtype fp8: multi-head latent attention keeps its latent cache "
                    "in the model dtype; drop the flag"
                )
            self._check_kv_cache_memory(model)
        self._check_lora(model)
        spec = self.speculative
        if spec is not None:
            if not isinstance(model, ModelConfig):
                raise ValueError("--speculative-config: encoder models generate no tokens")
            if spec.model is not None:
                check_draft(spec, model, self.model_dir, self.pp)
        return model

    def _check_lora(self, model: ModelConfig | EncoderConfig) -> None:
        """The LoRA flags, and each ``--lora-modules`` adapter against ``model``."""
        opts = self.lora_options()
        if opts is None:
            return
        if not isinstance(model, ModelConfig):
            raise ValueError("--enable-lora: encoder (embedding) models take no adapters")
        for name, path in opts.modules:
            read_adapter(name, path, model, opts.max_lora_rank)

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
        auto_fp8 = model.kv_fp8_scales and self.device != "cpu" and not model.kv_latent
        if self.kv_cache_dtype == "fp8" or (self.kv_cache_dtype == "auto" and auto_fp8):
            itemsize = 1  # e4m3: one byte per element
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


def _row_parallel_inputs(model: ModelConfig) -> dict[str, int]:
    """The inputs ``K`` of the row-parallel weights a quantized checkpoint's groups must split
    on: attention's output projection, a dense MLP's down projection, a shared expert's (a
    routed expert's slice off its groups is read dense: ``layers/moe.py``)."""
    inputs: dict[str, int] = {}
    if not model.kv_latent:
        inputs["the attention output projection"] = model.num_heads * model.head_dim
    moe = moe_config(model)
    if moe is None or moe.dense_layers:
        inputs["the MLP down projection"] = model.intermediate_size
    if moe is not None and moe.shared_intermediate_size:
        inputs["the shared expert's down projection"] = moe.shared_intermediate_size
    return inputs


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
