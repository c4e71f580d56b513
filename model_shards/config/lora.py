"""LoRA adapters in the PEFT format, read without torch: the ``--lora-modules`` options and the
checks an adapter passes before any rank sees it (at start-up, or on a runtime load).

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``) and ``adapter_model.safetensors``: per targeted module of layer ``i``,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight [r, in]`` and
``….lora_B.weight [out, r]``. A module's output gains ``scale * x A^T B^T``, ``scale =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rslora).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_shards.config.model import ModelConfig

#: The modules an adapter may target (Llama-family names).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The decoders whose linear layers take adapters.
LORA_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_FLOAT_DTYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class LoraOptions:
    """The LoRA flags: adapters served from start-up (``--lora-modules``, name → path), slots
    of adapters computed at once (``--max-loras``), the largest rank (``--max-lora-rank``),
    adapters kept in host memory (``--max-cpu-loras``)."""

    modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    def check(self) -> None:
        """``ValueError`` naming the flag unless the sizes are consistent."""
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"--max-lora-rank must be in 1..512, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras {self.max_cpu_loras} is below --max-loras {self.max_loras}; "
                "raise it to at least --max-loras"
            )


@dataclass(frozen=True)
class AdapterInfo:
    """One checked adapter: its rank, the scale of its product, the modules it targets."""

    name: str
    path: str
    rank: int
    scale: float
    target_modules: tuple[str, ...]


def parse_lora_modules(specs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``["NAME=PATH", …]`` → ``((name, path), …)``; ``ValueError`` naming the flag."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, eq, path = spec.partition("=")
        if not (eq and name.strip() and path.strip()):
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH")
        if any(name == n for n, _ in out):
            raise ValueError(f"--lora-modules: adapter name {name!r} is given twice")
        out.append((name.strip(), path.strip()))
    return tuple(out)


def module_shape(model: ModelConfig, module: str) -> tuple[int, int]:
    """``(in, out)`` features of the base model's ``module`` (one of :data:`TARGET_MODULES`)."""
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    h, inter = model.hidden_size, model.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }[module]


def read_adapter(
    name: str, path: str, model: ModelConfig, max_rank: int, flag: str = "--lora-modules"
) -> AdapterInfo:
    """Check the adapter at ``path`` against the base ``model``: its files, rank (at most
    ``max_rank``), targets, and every tensor's name and shape. ``ValueError`` naming ``flag``,
    the adapter and the field or tensor."""
    where = f"{flag} {name}={path}"
    if model.architecture not in LORA_ARCHITECTURES:
        raise ValueError(f"{where}: {model.architecture} takes no LoRA adapters")
    cfg = _read_config(Path(path), where)
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: {CONFIG_FILE} 'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank r={rank} is above --max-lora-rank {max_rank}")
    targets = _targets(cfg, where)
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{where}: {CONFIG_FILE} 'lora_alpha' must be a number, got {alpha!r}")
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    _check_tensors(Path(path), where, model, rank, targets)
    return AdapterInfo(name, str(path), rank, float(scale), targets)


def _read_config(path: Path, where: str) -> dict[str, Any]:
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / file).is_file():
            raise ValueError(f"{where}: no {file} in that directory")
    try:
        cfg = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: {CONFIG_FILE} 'bias' {cfg.get('bias')!r}: only 'none'")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: {CONFIG_FILE} 'modules_to_save' is not supported")
    return cfg


def _targets(cfg: dict[str, Any], where: str) -> tuple[str, ...]:
    raw = cfg.get("target_modules")
    targets = [raw] if isinstance(raw, str) else raw
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{where}: {CONFIG_FILE} 'target_modules' must list modules")
    unknown = [t for t in targets if t not in TARGET_MODULES]
    if unknown:
        raise ValueError(
            f"{where}: unknown target module(s) {unknown} in 'target_modules'; "
            f"supported: {', '.join(TARGET_MODULES)}"
        )
    return tuple(targets)


def safetensors_header(file: Path, where: str) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name → dtype, shape, offsets)."""
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ValueError(f"{where}: {file.name} is not a safetensors file ({exc})") from exc
    header.pop("__metadata__", None)
    return dict(header)


def _check_tensors(
    path: Path, where: str, model: ModelConfig, rank: int, targets: tuple[str, ...]
) -> None:
    header = safetensors_header(path / WEIGHTS_FILE, where)
    if not header:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no tensors")
    for key, entry in header.items():
        match = _KEY.fullmatch(key)
        if match is None or match.group(2) not in targets:
            raise ValueError(f"{where}: unexpected tensor {key!r} in {WEIGHTS_FILE}")
        layer, module, ab = int(match.group(1)), match.group(2), match.group(3)
        if layer >= model.num_layers:
            raise ValueError(f"{where}: tensor {key!r}: the model has {model.num_layers} layers")
        if entry.get("dtype") not in _FLOAT_DTYPES:
            raise ValueError(f"{where}: tensor {key!r} has dtype {entry.get('dtype')!r}")
        n_in, n_out = module_shape(model, module)
        want = [rank, n_in] if ab == "A" else [n_out, rank]
        if list(entry.get("shape", [])) != want:
            raise ValueError(
                f"{where}: tensor {key!r} has shape {entry.get('shape')}, the base model's "
                f"{module} needs {want}"
            )
