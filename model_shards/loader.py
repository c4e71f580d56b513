"""Checkpoint → this rank's parameters, strictly, reading only this rank's slices.

Strict means: a checkpoint tensor the model does not know, a parameter the
checkpoint lacks, or a shape or dtype that does not fit is a
:class:`~model_shards.checkpoint.CheckpointError` naming the tensor. Tensors
of other pipeline stages are checked by name but never read.
"""

from __future__ import annotations

from torch import nn

from model_shards.checkpoint import Checkpoint, CheckpointError
from model_shards.models.llama import LlamaForCausalLM


def _to_param_name(model: LlamaForCausalLM, name: str) -> tuple[str, str | int | None]:
    for part, (fused, shard_id) in model.packed_modules_mapping.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def expected_checkpoint_names(model: LlamaForCausalLM) -> set[str]:
    """Every tensor name the *whole* model (all stages) reads from a checkpoint."""
    first_local = model.model.layers[model.model.start]
    layer_suffixes: set[str] = set()
    fused_to_parts: dict[str, list[str]] = {}
    for part, (fused, _) in model.packed_modules_mapping.items():
        fused_to_parts.setdefault(fused, []).append(part)
    for pname, _ in first_local.named_parameters():
        module, _, leaf = pname.rpartition(".")
        parent, _, last = module.rpartition(".")
        for part in fused_to_parts.get(last, [last]):
            layer_suffixes.add(f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}")
    names = {
        f"model.layers.{i}.{s}" for i in range(model.config.num_layers) for s in layer_suffixes
    }
    names |= {"model.embed_tokens.weight", "model.norm.weight"}
    if not model.config.tie_word_embeddings:
        names.add("lm_head.weight")
    return names


def load_weights(model: LlamaForCausalLM, checkpoint: Checkpoint) -> None:
    """Fill every parameter of ``model`` (this stage, this TP rank) from ``checkpoint``."""
    expected = expected_checkpoint_names(model)
    present = {
        n for n in checkpoint.names()
        if not n.endswith(model.ignored_suffixes)
        and not (model.config.tie_word_embeddings and n == "lm_head.weight")
    }  # fmt: skip
    unexpected = sorted(present - expected)
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
        source = checkpoint.source(name)
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
        n for n in params
        if n not in loaded and not any(k.startswith(f"{n}[") for k in loaded)
    ]  # fmt: skip
    if not_loaded:
        raise CheckpointError(f"parameter(s) not filled by the checkpoint: {not_loaded[:8]}")
