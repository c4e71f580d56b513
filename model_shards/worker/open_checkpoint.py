"""A ``--model`` path's checkpoint, whatever its format: a Hugging Face safetensors
directory (:class:`~model_shards.worker.checkpoint.Checkpoint`) or a GGUF file, directory or
split set (:class:`~model_shards.worker.gguf_checkpoint.GGUFCheckpoint`)."""

from __future__ import annotations

import os

from model_shards.gguf.files import is_gguf
from model_shards.worker.checkpoint import Checkpoint
from model_shards.worker.gguf_checkpoint import GGUFCheckpoint


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint | GGUFCheckpoint:
    """The checkpoint at ``path``; ``CheckpointError`` naming the file when it is unusable."""
    return GGUFCheckpoint(path) if is_gguf(path) else Checkpoint(path)


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Parse every header (cheap) so a corrupt checkpoint fails before any process starts."""
    open_checkpoint(path).close()
