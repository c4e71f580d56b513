"""Checkpoint → this rank's parameters, strictly, reading only this rank's slices.

Strict means: a checkpoint tensor the model does not know, a parameter the
checkpoint lacks, or a shape or dtype that does not fit is a
:class:`~model_shards.worker.checkpoint.CheckpointError` naming the tensor. Tensors
of other pipeline stages are checked by name but never read.

A checkpoint saved from Hugging Face's *base* model (``GPT2Model`` rather than
``GPT2LMHeadModel``, as ``openai-community/gpt2`` was) names its tensors without the
wrapper's prefix (``h.0.ln_1.weight`` for ``transformer.h.0.ln_1.weight``): a model that
declares ``base_model_prefix`` (HF's attribute of that name) has it added back when no
checkpoint name carries it; an unexpected tensor is named as the checkpoint spells it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Protocol

from torch import nn

from model_shards.worker.checkpoint import CheckpointError, TensorStore


class LoadableModel(Protocol):
    """What a model file tells the loader (see models/llama.py, models/bert.py)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]]
    ignored_suffixes: ClassVar[tuple[str, ...]]
    ignored_prefixes: ClassVar[tuple[str, ...]]

    @property
    def tied_sources(self) -> dict[str, str]: ...

    def owns(self, name: str) -> bool: ...

    def expected_checkpoint_names(self) -> set[str]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


ShardId = str | int | tuple[int, str]


def _to_param_name(model: LoadableModel, name: str) -> tuple[str, ShardId | None]:
    """The parameter a checkpoint tensor fills and its shard id: the model's optional
    ``stacked_param_of(name)`` first (several tensors stacked into one parameter: MoE
    experts, see ``models/sparse_moe.py``), then ``packed_modules_mapping``."""
    stacked = getattr(model, "stacked_param_of", None)
    found = stacked(name) if stacked is not None else None
    if found is not None:
        return found
    for part, (fused, shard_id) in model.packed_modules_mapping.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def _names_in_checkpoint(model: LoadableModel, checkpoint: TensorStore) -> dict[str, str]:
    """Each checkpoint tensor by the model's name for it → its name in the checkpoint
    (the same, unless the checkpoint lacks the model's ``base_model_prefix`` throughout)."""
    names = list(checkpoint.names())
    prefix = getattr(model, "base_model_prefix", "")  # optional: most models have none
    if not prefix or any(n.startswith(f"{prefix}.") for n in names):
        mapped = {n: n for n in names}
    else:
        mapped = {f"{prefix}.{n}": n for n in names}
    # optional: checkpoint name prefix → the model's (another export's spelling)
    renames: dict[str, str] = getattr(model, "checkpoint_renames", {})
    for old, new in renames.items():
        mapped = {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in mapped.items()}
    return mapped


def load_weights(model: LoadableModel, checkpoint: TensorStore) -> None:
    """Fill every parameter of ``model`` (this stage, this TP rank) from ``checkpoint``."""
    expected = model.expected_checkpoint_names()
    stored = _names_in_checkpoint(model, checkpoint)
    present = {
        n
        for n in stored
        if not n.endswith(model.ignored_suffixes)
        and not n.startswith(model.ignored_prefixes)
        and n not in model.tied_sources
    }
    unexpected = sorted(stored[n] for n in present - expected)
    if unexpected:
        raise CheckpointError(f"unexpected tensor(s) in checkpoint: {unexpected[:8]}")
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(f"tensor(s) missing from checkpoint: {missing[:8]}")

    params: dict[str, nn.Parameter] = dict(model.named_parameters())
    loaded: set[str] = set()
    tied = model.tied_sources
    for name in sorted(present):
        if not model.owns(name):
            continue
        param_name, shard_id = _to_param_name(model, name)
        targets = [param_name, *(p for p, src in tied.items() if src == name)]
        source = checkpoint.source(stored[name])
        for target in targets:
            param = params.get(target)
            if param is None:
                continue
            loader = param.weight_loader  # type: ignore[attr-defined]
            if shard_id is None:
                loader(param, source)
            else:
                loader(param, source, shard_id)
            loaded.add(target if shard_id is None else f"{target}[{shard_id}]")
    not_loaded = [
        n for n in params if n not in loaded and not any(k.startswith(f"{n}[") for k in loaded)
    ]
    if not_loaded:
        raise CheckpointError(f"parameter(s) not filled by the checkpoint: {not_loaded[:8]}")
