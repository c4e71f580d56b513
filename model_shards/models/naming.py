"""How parameter names relate to checkpoint tensor names (fused projections)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn


def checkpoint_names_of(module: nn.Module, packed: Mapping[str, tuple[str, str | int]]) -> set[str]:
    """The checkpoint tensor names that fill ``module``'s parameters.

    A fused parameter (``qkv_proj.weight``) comes from each of its parts
    (``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``) per ``packed``.
    """
    fused_to_parts: dict[str, list[str]] = {}
    for part, (fused, _) in packed.items():
        fused_to_parts.setdefault(fused, []).append(part)
    names = set()
    for pname, _ in module.named_parameters():
        module_path, _, leaf = pname.rpartition(".")
        parent, _, last = module_path.rpartition(".")
        for part in fused_to_parts.get(last, [last]):
            names.add(f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}")
    return names
