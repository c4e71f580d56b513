"""What every reader of a checkpoint's ``config.json`` shares: JSON whose errors name the
file, and the ``torch_dtype`` values shardserve can serve."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The dtypes a checkpoint's ``torch_dtype`` may name (and ``--dtype`` choose): bytes each.
CHECKPOINT_DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def read_json(path: Path) -> Any:
    """The JSON in ``path``; ``ValueError`` naming the file when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable JSON ({exc})") from exc


def checkpoint_dtype(raw: dict[str, Any], source: str) -> str:
    """A config.json's ``torch_dtype`` (``dtype`` in transformers >= 5; float32 when
    absent); ``ValueError`` naming it and the supported ones when shardserve has no such dtype."""
    name = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
    if name not in CHECKPOINT_DTYPES:
        raise ValueError(
            f"{source}: torch_dtype {name!r} is not supported; "
            f"supported: {', '.join(CHECKPOINT_DTYPES)}"
        )
    return name


@dataclass(frozen=True)
class TransformerShape:
    """What every served model's ``config.json`` says first: its architecture and sizes.
    :class:`~model_shards.config.model.ModelConfig` (decoders) and
    :class:`~model_shards.config.encoder.EncoderConfig` (encoders) extend it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
